"""Experiment trackers beside metrics.jsonl and TensorBoard: W&B and trackio (`logging.backend`).

Every metrics row goes to the tracker under its metrics.jsonl names, against the row's `step`
(an evaluation's step is its weights version, as in metrics.jsonl). W&B's own step must grow with
each call while evaluation rows may arrive for a version already logged, so `step` is declared the
x-axis of every metric (define_metric) and W&B's step is left to count calls. One run per run
folder: its W&B id is derived from the folder, so a resumed trainer, and the sampler's final
evaluation row, continue the same run (resume="allow"). W&B's offline mode (the default,
`logging.wandb_mode`) writes <run.dir>/wandb and needs no network (`wandb sync` uploads it later);
trackio writes its local database ($TRACKIO_DIR, default ~/.cache/huggingface/trackio).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

TRACKERS = ("none", "wandb", "trackio")  # logging.backend
WANDB_MODES = ("offline", "online")  # logging.wandb_mode


def numeric(row: dict) -> dict[str, float]:
    """The row's numbers (what trackers plot); bools and strings are left out."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def run_id(run_dir: Path) -> str:
    """A W&B run id of the run folder: the same for every process and restart of this run."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


class WandbTracker:
    def __init__(self, logging_cfg, run_dir: Path, name: str, config: dict):
        import wandb

        self.run = wandb.init(project=logging_cfg.project, name=name, id=run_id(run_dir), dir=str(run_dir),
                              mode=logging_cfg.wandb_mode, config=config, resume="allow")
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict) -> None:
        self.run.log(numeric(row))

    def finish(self) -> None:
        self.run.finish()


class TrackioTracker:
    def __init__(self, logging_cfg, run_dir: Path, name: str, config: dict):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=logging_cfg.project, name=name, config=config, resume="allow")

    def log(self, row: dict) -> None:
        values = numeric(row)
        self.trackio.log({k: v for k, v in values.items() if k != "step"}, step=int(row["step"]))

    def finish(self) -> None:
        self.trackio.finish()


def open_tracker(logging_cfg, run_dir: Path, name: str, config: dict):
    """The configured tracker (None for logging.backend=none)."""
    kinds = {"wandb": WandbTracker, "trackio": TrackioTracker}
    if logging_cfg.backend == "none":
        return None
    return kinds[logging_cfg.backend](logging_cfg, Path(run_dir), name, config)
