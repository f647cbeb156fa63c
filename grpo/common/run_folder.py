"""Where a run's files are: one place for their names.

    runs/<name>/config.yaml          the resolved config (every key), as the workers saved it
    runs/<name>/metrics.jsonl        one row per step, and one per evaluation
    runs/<name>/completions.jsonl    each step's first completions with their rewards (logging.completions_per_step)
    runs/<name>/tb/                  TensorBoard events
    runs/<name>/trainer_state.json   the trainer's position (the samplers re-send from it)
    runs/<name>/checkpoints/         DeepSpeed checkpoints, step<N>/
    runs/<name>/weights/             published versions (unless weights.dir puts them elsewhere)
    runs/<name>/address              the transport address of a running launch
    runs/<name>/secret               the run's secret (mode 0600): signs batches, spool files, checkpoint manifests
    runs/<name>/<process>.log        each process's log (sampler.log, sampler0.log, trainer.log)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RunFolder:
    root: Path

    def __init__(self, root: str | os.PathLike):
        object.__setattr__(self, "root", Path(root))

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def completions(self) -> Path:
        return self.root / "completions.jsonl"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tb"

    @property
    def trainer_state(self) -> Path:
        return self.root / "trainer_state.json"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def secret(self) -> Path:
        return self.root / "secret"

    @property
    def address(self) -> Path:
        return self.root / "address"

    def log(self, process: str) -> Path:
        return self.root / f"{process}.log"
