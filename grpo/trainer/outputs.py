"""What the trainer writes besides the model: metrics rows, TensorBoard and a tracker, published weights, checkpoints.

Every write that can fail (a full disk, lost permissions) raises `WriteFailed` naming what and
where; the trainer then exits with its own code and nothing partial is visible, since weights
and checkpoints are written aside and renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.files import write_atomically
from grpo.run.rows import is_evaluation_row
from grpo.wire.delivery import TrainerState
from grpo.wire.weights import publish

if TYPE_CHECKING:
    from grpo.settings import Config


class WriteFailed(RuntimeError):
    """Weights, a checkpoint or metrics could not be written (a full disk, lost permissions)."""


@contextlib.contextmanager
def reported_write(what: str, path: Path):
    try:
        yield
    except OSError as e:
        raise WriteFailed(f"cannot write {what} to {path}: {e}") from e
    except RuntimeError as e:  # how torch.save reports a failed write
        raise WriteFailed(f"cannot write {what} to {path} (a full disk or a file size limit?): {e}") from e


class MetricsLog:
    """Rank 0's metrics.jsonl (one row per step), TensorBoard events, and the rows to `tracker`
    (grpo/run/tracking.py: W&B or trackio, when logging.backend names one).

    Opened on a resumed run, it drops the rows of steps after the checkpoint: those steps are
    trained again and would otherwise appear twice. An evaluation's row is written once per
    version, though a restarted trainer receives the batch that carried it again."""

    def __init__(self, run_dir: Path, resumed_step: int, tensorboard: bool, tracker=None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.evaluated: set[int] = set()  # versions with an evaluation row
        if self.path.is_file():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if row.get("step", 0) <= resumed_step:
                    kept.append(line)
                    if is_evaluation_row(row):
                        self.evaluated.add(row["step"])
            write_atomically(self.path, "".join(line + "\n" for line in kept))
        self.file = open(self.path, "a")
        self.writer, self.tracker = None, tracker
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(Path(run_dir) / "tb"))

    def write(self, row: dict) -> None:
        if self.tracker is not None:
            row = {**row, "tracker/failures": self.tracker.failures}
        with reported_write(f"metrics of step {row['step']}", self.path):
            self.file.write(json.dumps(row) + "\n")
            self.file.flush()
        if self.writer is not None:
            for key, value in row.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, row["step"])
        if self.tracker is not None:
            self.tracker.log(row)

    def write_evaluation(self, row: dict) -> None:
        """An evaluation's row (the sampler's, sent with a batch), unless that version has one."""
        if row["step"] not in self.evaluated:
            self.evaluated.add(row["step"])
            self.write(row)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.tracker is not None:
            self.tracker.finish()


def publish_weights(model, cfg: Config, version: int, rank: int) -> None:
    """Rank 0 writes the adapter (or the full model); under ZeRO-3 every rank first takes part
    in gathering the partitioned parameters, so all ranks call this."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad] if cfg.lora.enabled else list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=cfg.deepspeed.zero_stage == 3):
        if rank == 0:
            with reported_write(f"weights v{version}", cfg.weights_dir):
                publish(model, cfg.weights_dir, version, version, cfg.weights.keep_last)


def save_checkpoint(engine, cfg: Config, state: TrainerState, rank: int) -> None:
    """DeepSpeed checkpoint (every rank) plus the trainer state the samplers resume from.
    DeepSpeed names a checkpoint in `latest` only once it is written whole."""
    ckpt_dir = cfg.run_dir / "checkpoints"
    with reported_write(f"the checkpoint of step {state.step}", ckpt_dir):
        engine.save_checkpoint(str(ckpt_dir), tag=f"step{state.step:06d}", client_state={"trainer": vars(state)})
    if rank == 0:
        state_path = cfg.run_dir / "trainer_state.json"
        with reported_write("the trainer state", state_path):
            state.save(state_path)
        tags = sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step"))
        for old in tags[:-cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
