"""Delivery of batches from samplers to the trainer: exactly once per (sampler, step), in order.

The protocol, stated once (docs/reliability.md tests every rule):
1. A batch is keyed by (sampler id, sampler step). Each sampler numbers its steps 0, 1, 2, ...
   With N samplers, the run's global step g is sampler g % N's step g // N (`owner`): together
   they make the batches one sampler would (prompts, seeds and staleness follow g).
2. The sampler writes a batch's encoded frames to its own spool (`<run>/spool/sampler<i>/`)
   before it sends them: at-least-once.
3. The trainer trains global steps strictly in order: a step below the next one it wants from
   that sampler was trained already and is dropped (de-duplication); any other arrived early
   and is held until the ones before it are in.
4. The trainer's position (`TrainerState`: optimizer steps, the next step wanted per sampler)
   is saved to `trainer_state.json` with every checkpoint. Each trainer start writes a new
   `incarnation` there; a sampler that sees a new incarnation re-sends its spooled steps from
   the trainer's position, in order, and deletes the spooled steps below it.
5. A restarted sampler first re-sends (rule 4), and generates again only the steps its spool
   lacks, so nothing is generated twice unless the spool was deleted.

Both workers import this module; it imports neither worker's modules. File format of a
spool entry (written and read only here; never unpickled): b"GRPOSPL1", the frame count
(uint32 LE), each frame's length (uint64 LE), then the frames.
"""

from __future__ import annotations

import json
import logging
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from grpo.common.files import write_atomically
from grpo.wire.batch import SCHEMA
from grpo.wire.codec import EARLIER_SCHEMAS

MAGIC = b"GRPOSPL1"
WAIT_NOTE_S = 30.0  # how often a trainer waiting for a batch says so
log = logging.getLogger(__name__)


def owner(global_step: int, num_samplers: int) -> tuple[int, int]:
    """(sampler, its own step) that makes the run's global step `global_step` (rule 1)."""
    return global_step % num_samplers, global_step // num_samplers


def global_step(sampler: int, step: int, num_samplers: int) -> int:
    return step * num_samplers + sampler


def steps_of_sampler(sampler: int, total_steps: int, num_samplers: int) -> int:
    """How many of the run's `total_steps` global steps sampler `sampler` makes."""
    return max(0, -(-(total_steps - sampler) // num_samplers))


# ----------------------------------------------------------------------------- the trainer's position

@dataclass
class TrainerState:
    step: int = 0  # optimizer steps done == the weights version they produce
    next_steps: dict[int, int] = field(default_factory=dict)  # sampler id -> the step its next batch must carry
    incarnation: str = ""  # new at each trainer start: tells the samplers to re-send their spools
    updates: int = 0  # steps whose update was applied (not skipped): the learning-rate schedule's clock

    def next_step(self, sampler: int) -> int:
        return self.next_steps.get(sampler, 0)

    def delivered(self, sampler: int, step: int) -> None:
        self.next_steps[sampler] = step + 1

    def save(self, path: Path) -> None:
        write_atomically(path, json.dumps(asdict(self)))

    @classmethod
    def from_dict(cls, data: dict) -> "TrainerState":
        return cls(step=int(data["step"]), next_steps={int(k): int(v) for k, v in data["next_steps"].items()},
                   incarnation=str(data["incarnation"]), updates=int(data.get("updates", data["step"])))

    @classmethod
    def load(cls, path: Path) -> "TrainerState | None":
        return cls.from_dict(json.loads(path.read_text())) if path.is_file() else None


# ----------------------------------------------------------------------------- the sampler's spool

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
    """One sampler's sent batches, kept until the trainer has checkpointed past them (rule 2)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    @classmethod
    def of_sampler(cls, run_dir: Path, sampler: int) -> "Spool":
        return cls(Path(run_dir) / "spool" / f"sampler{sampler}")

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


def resume_step(spool: Spool, trainer: TrainerState | None, sampler: int, saved_next_step: int) -> int:
    """Where a restarted sampler generates next (rule 5): after its own last sent step, unless
    the trainer needs earlier steps that the spool no longer holds; those are generated again."""
    if trainer is None or trainer.next_step(sampler) >= saved_next_step:
        return saved_next_step
    missing = sorted(set(range(trainer.next_step(sampler), saved_next_step)) - set(spool.steps()))
    if missing:
        log.warning("trainer resumes at sampler %d step %d and the spool lacks step %d: rewinding from step %d",
                    sampler, trainer.next_step(sampler), missing[0], saved_next_step)
        return missing[0]
    return saved_next_step


class Redelivery:
    """The sampler's half of rule 4: when a trainer (re)starts (a new `incarnation` in its state
    file), re-send the spooled steps it has not checkpointed past, in order."""

    def __init__(self, spool: Spool, send_frames: Callable[[list[bytes]], None], trainer_state_path: str | Path,
                 sampler: int = 0, signature_problem: Callable[[list[bytes]], str | None] = lambda frames: None):
        """`signature_problem(frames)`: why a spooled step is not the run's own (signed with its secret), or None."""
        self.spool, self.send_frames, self.path, self.sampler = spool, send_frames, Path(trainer_state_path), sampler
        self.signature_problem = signature_problem
        self.served: str | None = None  # the trainer incarnation we have re-sent to
        self.pruned_below = 0
        self.state: TrainerState | None = None  # as last read

    def check(self, next_step: int) -> list[int]:
        """Prune what the trainer has checkpointed; re-send the rest below `next_step` to a new
        trainer. Returns the steps re-sent."""
        try:
            state = TrainerState.load(self.path)
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("cannot read %s (%s); not re-sending anything this time", self.path, e)
            return []
        self.state = state
        if state is None:
            return []  # no trainer has started yet
        durable, incarnation = state.next_step(self.sampler), state.incarnation
        if durable > self.pruned_below:  # called at every poll while waiting: prune once per checkpoint
            self.spool.prune(below=durable)
            self.pruned_below = durable
        if incarnation == self.served:
            return []
        self.served = incarnation
        steps = [s for s in self.spool.steps() if s < next_step]
        for step in steps:
            self.send_frames(self.signed(step))
        missing = sorted(set(range(durable, next_step)) - set(steps))
        if missing:  # only if someone deleted spool files
            log.error("sampler %d steps %s are neither checkpointed by the trainer nor in %s: they are lost",
                      self.sampler, missing, self.spool.folder)
        if steps:
            log.info("trainer %s resumes at sampler step %d: re-sent spooled steps %d..%d", incarnation, durable,
                     steps[0], steps[-1])
        return steps

    def signed(self, step: int) -> list[bytes]:
        """A spooled step's frames; SpoolError where they are not the run's own (changed after they were written)."""
        frames = self.spool.get(step)
        problem = self.signature_problem(frames)
        if problem:
            raise SpoolError(f"{self.spool._path(step)} was changed after this sampler wrote it, or transport.secret "
                             f"changed since ({problem}); nothing of it is sent. If something other than the run wrote "
                             "into the run folder, look for what; then delete the file and start the run again to "
                             "have the step made again")
        schema = _schema(frames[1])
        if schema in EARLIER_SCHEMAS:
            raise SpoolError(f"{self.spool._path(step)} holds a batch of schema {schema}, written by an earlier "
                             f"release, which this trainer (schema {SCHEMA}) cannot read; nothing of it is sent. "
                             f"Delete the sampler's spool folder {self.spool.folder} and start the run again to "
                             "have its steps made again")
        return frames

    def wait_until_checkpointed(self, end_step: int, timeout_s: float, poll_s: float = 0.2) -> None:
        """After the last step: keep serving restarted trainers until one has checkpointed every
        step, so that a trainer killed near the end still gets the batches it lacks. Returns at
        once when no trainer has started (nothing will read the spool)."""
        deadline, announced = time.monotonic() + timeout_s, False
        while True:
            self.check(end_step)
            if self.state is None or self.state.next_step(self.sampler) >= end_step:
                return
            if not announced:
                log.info("all %d steps sent; waiting for the trainer to checkpoint past them", end_step)
                announced = True
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"after {timeout_s:g} s the trainer has checkpointed only sampler steps below "
                    f"{self.state.next_step(self.sampler)} of {end_step}; the rest stay in {self.spool.folder} and "
                    "are re-sent when the trainer and sampler are started again (sampling.wait_timeout_s)")
            time.sleep(poll_s)


# ----------------------------------------------------------------------------- the trainer's inbox

class Inbox:
    """Rank 0's half of rule 3: the next batch in order, whichever sampler it comes from.

    `receive(timeout_s) -> (message, (sampler, step))` reads one validated message (it raises
    `TimeoutError` when none came; the message is kept as it came, e.g. its frames and the batch they
    decode to); `stop()` says whether to give up waiting (SIGTERM).
    """

    def __init__(self, receive: Callable[[float], tuple[Any, tuple[int, int]]], describe: str,
                 stop: Callable[[], bool] = lambda: False, num_samplers: int = 1):
        self.receive, self.describe, self.stop, self.num_samplers = receive, describe, stop, num_samplers
        self.pending: dict[tuple[int, int], Any] = {}  # (sampler, step) -> the message that arrived early

    def _ready(self, state: TrainerState) -> tuple[int, int] | None:
        wanted = owner(state.step, self.num_samplers)  # global order (rule 3)
        return wanted if wanted in self.pending and wanted[1] == state.next_step(wanted[0]) else None

    def next(self, state: TrainerState, timeout_s: float) -> Any:
        """The message of a batch that is next in order for its sampler; None when stopped."""
        for key in [k for k in self.pending if k[1] < state.next_step(k[0])]:
            del self.pending[key]
        start = time.monotonic()
        note_every = min(WAIT_NOTE_S, timeout_s / 4)
        next_note = start + note_every
        while not self.stop():
            ready = self._ready(state)
            if ready is not None:
                return self.pending.pop(ready)
            now = time.monotonic()
            if now >= next_note:
                log.warning("waiting for %s on %s for %.0f s (gives up after %g s; is sampling_worker.py "
                            "running?)", self._wanted(state), self.describe, now - start, timeout_s)
                next_note += note_every
            try:  # short polls, so that SIGTERM is noticed while waiting
                message, (sampler, step) = self.receive(min(1.0, max(start + timeout_s - now, 0.01)))
            except TimeoutError:
                if time.monotonic() >= start + timeout_s:
                    raise TimeoutError(f"no batch ({self._wanted(state)}) arrived on {self.describe} in "
                                       f"{timeout_s:g} s (is the sampler running? transport.recv_timeout_s)"
                                       ) from None
                continue
            wanted = state.next_step(sampler)
            if step < wanted or (sampler, step) in self.pending:
                log.info("dropping sampler %d step %d: already %s", sampler, step,
                         "trained" if step < wanted else "held")
            else:
                self.pending[(sampler, step)] = message
                if step > wanted:
                    log.info("holding sampler %d step %d until step %d arrives", sampler, step, wanted)
        return None

    def _wanted(self, state: TrainerState) -> str:
        sampler, _ = owner(state.step, self.num_samplers)
        return f"sampler {sampler} step {state.next_step(sampler)}"


def _schema(header: bytes) -> str | None:
    """The schema a spooled batch's header names (None where it names none: the trainer says what is wrong)."""
    try:
        return json.loads(header).get("schema")
    except (ValueError, AttributeError):
        return None
