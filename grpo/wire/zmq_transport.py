"""Frames over ZeroMQ (tcp://, ipc://, inproc://): PUSH from each sampler, PULL on the trainer's rank 0.
The interface every transport gives is in grpo/wire/transport.py."""

from __future__ import annotations

import zmq

from grpo.wire.codec import MAX_HEADER_BYTES
from grpo.wire.transport import AddressInUse, TransportTimeout


class Sender:
    """PUSH, connected to the trainer; blocks at the high-water mark for at most send_timeout_s."""

    def __init__(self, address: str, high_water_mark: int, send_timeout_s: float):
        self.address, self.send_timeout_s = address, send_timeout_s
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, high_water_mark)
        self._socket.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._socket.setsockopt(zmq.LINGER, int(send_timeout_s * 1000))  # flush queued batches at close
        self._socket.connect(address)

    def send(self, frames: list[bytes]) -> None:
        try:
            self._socket.send_multipart(frames, copy=False)
        except zmq.Again:
            raise TransportTimeout(f"no trainer is receiving on {self.address} after {self.send_timeout_s:g} s "
                                   "(is the trainer running with the same transport.address?)") from None

    def close(self, flush: bool = True) -> None:
        """flush=False drops what is still queued: the sampler keeps it in its spool, for the next start."""
        self._socket.close(linger=None if flush else 0)
        self._context.term()


class Receiver:
    """PULL, bound; messages over max_bytes are dropped by ZeroMQ unread."""

    def __init__(self, address: str, high_water_mark: int, max_bytes: int):
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.RCVHWM, high_water_mark)
        self._socket.setsockopt(zmq.MAXMSGSIZE, max_bytes + MAX_HEADER_BYTES)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as e:
            self.close()
            raise AddressInUse(f"transport.address {address} cannot be bound ({e}): another run or trainer uses it; "
                               "set transport.address=tcp://127.0.0.1:<free port> for both processes (the launcher "
                               "picks a free one by itself)") from None

    def receive(self, timeout_s: float) -> list[bytes] | None:
        """The next message's frames, or None when none came within timeout_s."""
        if not self._socket.poll(max(int(timeout_s * 1000), 0)):
            return None
        return self._socket.recv_multipart(copy=True)

    def close(self) -> None:
        self._socket.close()
        self._context.term()


def connect(address: str, high_water_mark: int, send_timeout_s: float) -> Sender:
    return Sender(address, high_water_mark, send_timeout_s)


def bind(address: str, high_water_mark: int, max_bytes: int) -> Receiver:
    return Receiver(address, high_water_mark, max_bytes)
