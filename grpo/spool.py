"""The sampler's spool: each batch it sends, kept on disk until the trainer has checkpointed past it.

The delivery rule (docs/reliability.md): at-least-once, de-duplicated by sampler step.
- The sampler writes a batch's encoded frames here before it sends them, and deletes the
  files below the trainer's checkpointed position (`trainer_state.json: next_sampler_step`).
- A (re)started trainer resumes at its checkpoint and writes a new `incarnation`; the sampler
  then re-sends the spooled steps from that position, in order. A restarted sampler does the
  same before it generates anything new, so no step is generated twice either.
- The trainer trains sampler steps strictly in order: it drops a step it has already
  trained and holds a step that arrives early until the ones before it are in.

File format (written and read only by this module; never unpickled): b"GRPOSPL1", the
frame count (uint32 LE), each frame's length (uint64 LE), then the frames.
"""

import logging
import struct
import time
from pathlib import Path

from grpo.files import write_atomically
from grpo.training import TrainerState

MAGIC = b"GRPOSPL1"
log = logging.getLogger("sampler")


class SpoolError(ValueError):
    """A spool file that is not what this module wrote."""


def _pack(frames: list[bytes]) -> bytes:
    lengths = struct.pack(f"<I{len(frames)}Q", len(frames), *(len(f) for f in frames))
    return MAGIC + lengths + b"".join(bytes(f) for f in frames)


def _unpack(data: bytes, path: Path) -> list[bytes]:
    if data[:8] != MAGIC or len(data) < 12:
        raise SpoolError(f"{path} is not a spool file (bad magic or too short)")
    (count,) = struct.unpack_from("<I", data, 8)
    start = 12 + 8 * count
    if len(data) < start:
        raise SpoolError(f"{path}: header names {count} frames but the file ends at byte {len(data)}")
    lengths = struct.unpack_from(f"<{count}Q", data, 12)
    if start + sum(lengths) != len(data):
        raise SpoolError(f"{path}: frames add up to {start + sum(lengths)} bytes, the file has {len(data)}")
    frames = []
    for n in lengths:
        frames.append(data[start:start + n])
        start += n
    return frames


class Spool:
    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, step: int) -> Path:
        return self.folder / f"step{step:08d}.batch"

    def put(self, step: int, frames: list[bytes]) -> None:
        write_atomically(self._path(step), _pack(frames))

    def get(self, step: int) -> list[bytes]:
        path = self._path(step)
        return _unpack(path.read_bytes(), path)

    def steps(self) -> list[int]:
        return sorted(int(p.stem[4:]) for p in self.folder.glob("step*.batch") if p.stem[4:].isdigit())

    def prune(self, below: int) -> None:
        for step in self.steps():
            if step < below:
                self._path(step).unlink(missing_ok=True)


class Redelivery:
    """The sampler's half of the rule: when a trainer (re)starts (a new `incarnation` in its
    state file), re-send the spooled steps it has not checkpointed past, in order."""

    def __init__(self, spool: Spool, send_frames, trainer_state_path: str | Path):
        self.spool, self.send_frames, self.path = spool, send_frames, Path(trainer_state_path)
        self.served: str | None = None  # the trainer incarnation we have re-sent to
        self.pruned_below = 0
        self.state: TrainerState | None = None  # as last read

    def check(self, next_step: int) -> list[int]:
        """Prune what the trainer has checkpointed; re-send the rest below `next_step` to a new
        trainer. Returns the steps re-sent."""
        try:
            state = TrainerState.load(self.path)
        except (OSError, ValueError, TypeError) as e:
            log.warning("cannot read %s (%s); not re-sending anything this time", self.path, e)
            return []
        self.state = state
        if state is None:
            return []  # no trainer has started yet
        durable, incarnation = state.next_sampler_step, state.incarnation
        if durable > self.pruned_below:  # called at every poll while waiting: prune once per checkpoint
            self.spool.prune(below=durable)
            self.pruned_below = durable
        if incarnation == self.served:
            return []
        self.served = incarnation
        steps = [s for s in self.spool.steps() if s < next_step]
        for step in steps:
            self.send_frames(self.spool.get(step))
        missing = sorted(set(range(durable, next_step)) - set(steps))
        if missing:  # only if someone deleted spool files
            log.error("sampler steps %s are neither checkpointed by the trainer nor in %s: they are lost",
                      missing, self.spool.folder)
        if steps:
            log.info("trainer %s resumes at sampler step %d: re-sent spooled steps %d..%d", incarnation, durable,
                     steps[0], steps[-1])
        return steps

    def wait_until_checkpointed(self, end_step: int, timeout_s: float, poll_s: float = 0.2) -> None:
        """After the last step: keep serving restarted trainers until one has checkpointed every
        step, so that a trainer killed near the end still gets the batches it lacks. Returns at
        once when no trainer has started (nothing will read the spool)."""
        deadline, announced = time.monotonic() + timeout_s, False
        while True:
            self.check(end_step)
            if self.state is None or self.state.next_sampler_step >= end_step:
                return
            if not announced:
                log.info("all %d steps sent; waiting for the trainer to checkpoint past them", end_step)
                announced = True
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"after {timeout_s:g} s the trainer has checkpointed only sampler steps below "
                    f"{self.state.next_sampler_step} of {end_step}; the rest stay in {self.spool.folder} and are "
                    "re-sent when the trainer and sampler are started again (sampling.wait_timeout_s)")
            time.sleep(poll_s)
