"""Batches between the processes: the codec (grpo/wire/codec.py) over a transport of byte frames,
chosen by the address's scheme.

A transport is a module with a sender (`connect(address, high_water_mark, send_timeout_s)`, then
`send(frames)`, raising TransportTimeout when nobody takes them; `close(flush)`, flush=False dropping what
is queued) and a receiver (`bind(address, high_water_mark, max_bytes)`, raising AddressInUse, then
`receive(timeout_s) -> frames | None`; `close()`); TRANSPORTS names it for each scheme. ZeroMQ serves
tcp://, ipc:// and inproc:// (grpo/wire/zmq_transport.py).
"""

from __future__ import annotations

import importlib
import logging
import time

from grpo.wire.batch import RolloutBatch
from grpo.wire.codec import (
    DEFAULT_MAX_BYTES,
    MessageError,
    decode_batch,
    encode_batch,
    resolve_secret,
    signature_problem,
)

log = logging.getLogger(__name__)

TRANSPORTS = {"tcp": "grpo.wire.zmq_transport", "ipc": "grpo.wire.zmq_transport", "inproc": "grpo.wire.zmq_transport"}


class TransportTimeout(TimeoutError):
    """Nobody received or sent within the configured time."""


class AddressInUse(OSError):
    """The trainer's transport.address is taken (another run, or a trainer still running)."""


def transport_name(address: str) -> str:
    """The module that carries frames for `address`, by its scheme; ValueError for a scheme none serves."""
    scheme = address.split("://", 1)[0] if "://" in address else ""
    if scheme not in TRANSPORTS:
        raise ValueError(f"transport.address must start with one of {', '.join(f'{s}://' for s in TRANSPORTS)} "
                         f"(a transport for each); got {address!r}")
    return TRANSPORTS[scheme]


def transport_of(address: str):
    return importlib.import_module(transport_name(address))


class BatchSender:
    """The sampler's end: encodes (signed when a secret is set) and sends, blocking at the high-water mark."""

    def __init__(self, address: str, *, high_water_mark: int = 2, send_timeout_s: float = 600.0,
                 secret: str | bytes | None = None):
        self.address = address
        self._secret = resolve_secret(secret)
        self._frames = transport_of(address).connect(address, high_water_mark, send_timeout_s)

    def signature_problem(self, frames: list[bytes]) -> str | None:
        """Why spooled `frames` would be refused by a trainer with this secret; None when they would not."""
        return signature_problem(frames, self._secret) if self._secret else None

    def encode(self, batch: RolloutBatch) -> list[bytes]:
        """The frames `send_frames` sends: signed when a secret is set."""
        return encode_batch(batch, self._secret)

    def send(self, batch: RolloutBatch) -> None:
        self.send_frames(self.encode(batch))

    def send_frames(self, frames: list[bytes]) -> None:
        self._frames.send(frames)

    def close(self, flush: bool = True) -> None:
        """flush: wait up to send_timeout_s for queued batches to leave; False drops them (they are spooled)."""
        self._frames.close(flush)


class BatchReceiver:
    """The trainer's end: receives and decodes; a bad message is logged, counted and skipped."""

    def __init__(self, address: str, *, high_water_mark: int = 2, max_bytes: int = DEFAULT_MAX_BYTES,
                 secret: str | bytes | None = None):
        self.address, self.max_bytes = address, max_bytes
        self.rejected = 0
        self._secret = resolve_secret(secret)
        self._frames = transport_of(address).bind(address, high_water_mark, max_bytes)

    def expect_secret(self, secret: str | bytes) -> None:
        """From now on every message must be signed with `secret` (the run's: grpo/run/secret.py)."""
        self._secret = resolve_secret(secret)

    def receive_frames(self, timeout_s: float) -> tuple[list[bytes], RolloutBatch]:
        """The next valid message's frames (signature stripped) and its decoded batch."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            frames = self._frames.receive(left)
            if frames is None:
                break
            try:
                batch = decode_batch(frames, self._secret, self.max_bytes)
            except MessageError as e:
                self.rejected += 1
                log.warning("rejected a message on %s: %s", self.address, e)
                continue
            return (frames[1:] if self._secret else frames), batch
        raise TransportTimeout(f"no valid batch arrived on {self.address} in {timeout_s:g} s "
                               "(is the sampler running with the same transport.address?)")

    def close(self) -> None:
        self._frames.close()
