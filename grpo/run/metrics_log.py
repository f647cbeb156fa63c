"""The one writer of a run's metrics: metrics.jsonl rows, TensorBoard scalars and the tracker's rows
(grpo/run/tracking.py: W&B or trackio, when logging.backend names one). The trainer's rank 0
writes every step's row and the evaluations the samplers send with their batches; a sampler
writes only the final evaluation, once the trainer has written its last row."""

from __future__ import annotations

import json
from pathlib import Path

from common.files import reported_write, write_atomically
from common.run_folder import RunFolder
from grpo.run.rows import is_evaluation_row


class MetricsLog:
    """Opened with `resumed_step` (the trainer), it drops the rows of steps after the checkpoint:
    those steps are trained again and would otherwise appear twice; opened with None (a sampler's
    final evaluation) it appends only. An evaluation's row is written once per version, though a
    restarted trainer receives the batch that carried it again. `events_suffix` keeps a second
    writer's TensorBoard events in a file of their own."""

    def __init__(self, run_dir: str | Path, resumed_step: int | None, tensorboard: bool, tracker=None,
                 events_suffix: str = ""):
        folder = RunFolder(run_dir)
        self.path = folder.metrics
        self.evaluated: set[int] = set()  # versions with an evaluation row
        if resumed_step is not None and self.path.is_file():
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

            self.writer = SummaryWriter(str(folder.tensorboard), filename_suffix=events_suffix)

    def write(self, row: dict) -> None:
        """One row: a single O_APPEND write of one line, then its scalars and the tracker's copy."""
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
