"""The one writer of a run's metrics: metrics.jsonl rows, TensorBoard scalars and the tracker's rows
(grpo/run/tracking.py: W&B or trackio, when logging.backend names one). The trainer's rank 0
writes every step's row, the evaluations the samplers send with their batches and the completions
they show (completions.jsonl, the tracker's 'completions' table); a sampler writes only the final
evaluation, once the trainer has written its last row."""

from __future__ import annotations

import json
from pathlib import Path

from grpo.common.files import reported_write, write_atomically
from grpo.common.run_folder import RunFolder
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
        self.path, self.completions_path = folder.metrics, folder.completions
        self.evaluated: set[int] = set()  # versions with an evaluation row
        if resumed_step is not None:
            kept = rows_through(self.path, resumed_step)
            self.evaluated = {row["step"] for row in kept if is_evaluation_row(row)}
            rows_through(self.completions_path, resumed_step)
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

    def write_completions(self, step: int, sampler: int, records: list) -> None:
        """The completions a sampler showed with the batch trained at `step`: one line each in
        completions.jsonl (a single O_APPEND write), and the tracker's table."""
        rows = [{"step": step, "sampler": sampler, **{k: v for k, v in record.items() if k not in ("step", "sampler")}}
                for record in records if isinstance(record, dict)]
        if not rows:
            return
        with reported_write(f"completions of step {step}", self.completions_path):
            with open(self.completions_path, "a") as f:
                f.write("".join(json.dumps(row) + "\n" for row in rows))
        if self.tracker is not None:
            self.tracker.log_table("completions", step, rows)

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


def rows_through(path: Path, step: int) -> list[dict]:
    """The rows of a JSON-lines file up to `step`, kept in it (rewritten atomically); those of later steps,
    trained again after a resume, and a line a crash cut short are dropped."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= step:
            kept.append(row)
    write_atomically(path, "".join(json.dumps(row) + "\n" for row in kept))
    return kept
