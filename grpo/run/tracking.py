"""Experiment trackers beside metrics.jsonl and TensorBoard: W&B and trackio (`logging.backend`).

Every metrics row goes to the tracker under its metrics.jsonl names, against the row's `step`
(an evaluation's step is its weights version, as in metrics.jsonl). W&B's own step must grow with
each call while evaluation rows may arrive for a version already logged, so `step` is declared the
x-axis of every metric (define_metric) and W&B's step is left to count calls. W&B: one run per
writer (each trainer incarnation, the sampler's final evaluation), grouped by the run folder;
trackio: one run per run folder. A tracker that fails is logged and counted, never fatal.
W&B's offline mode (the default,
`logging.wandb_mode`) writes <run.dir>/wandb and needs no network (`wandb sync` uploads it later);
trackio writes its local database ($TRACKIO_DIR, default ~/.cache/huggingface/trackio).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)



def numeric(row: dict) -> dict[str, float]:
    """The row's numbers (what trackers plot); bools and strings are left out."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def table_of(rows: list[dict]) -> tuple[list[str], list[list]]:
    """(columns, data) of a table of `rows`: each key a column in first-seen order; a nested value (a
    chat's turns, the rewards by name) as its JSON text."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cell = lambda value: json.dumps(value) if isinstance(value, (dict, list)) else value  # noqa: E731
    return columns, [[cell(row.get(key)) for key in columns] for row in rows]


def run_id(run_dir: Path) -> str:
    """A W&B run id of the run folder: the same for every process and restart of this run."""
    return hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]


def trackio_name(run_name: str, run_dir: Path) -> str:
    """trackio continues a run by its name: keyed by the run folder too, so that two folders with
    the same run.name (the default, say) are two runs."""
    return f"{run_name}-{run_id(run_dir)[:8]}"


class WandbTracker:
    """One W&B run per writer (a trainer incarnation, the sampler's final evaluation), grouped by
    the run folder: offline, two processes writing one run id make two offline runs whose sync
    replaces one history with the other."""

    def __init__(self, logging_cfg, run_dir: Path, name: str, config: dict, writer: str):
        import wandb

        self.run = wandb.init(project=logging_cfg.project, name=f"{name} ({writer})", id=f"{run_id(run_dir)}-{writer}",
                              group=run_id(run_dir), job_type=writer.split("-")[0], dir=str(run_dir),
                              mode=logging_cfg.wandb_mode, config=config)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, row: dict) -> None:
        self.run.log(numeric(row))

    def log_table(self, name: str, step: int, rows: list[dict]) -> None:
        import wandb

        columns, data = table_of(rows)
        self.run.log({"step": step, name: wandb.Table(columns=columns, data=data)})

    def finish(self) -> None:
        self.run.finish()


class TrackioTracker:
    def __init__(self, logging_cfg, run_dir: Path, name: str, config: dict, writer: str):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=logging_cfg.project, name=trackio_name(name, run_dir), config=config,
                                resume="allow")

    def log(self, row: dict) -> None:
        values = numeric(row)
        self.trackio.log({k: v for k, v in values.items() if k != "step"}, step=int(row["step"]))

    def log_table(self, name: str, step: int, rows: list[dict]) -> None:
        columns, data = table_of(rows)
        self.trackio.log({name: self.trackio.Table(columns=columns, data=data)}, step=step)

    def finish(self) -> None:
        self.trackio.finish()


class Guarded:
    """A tracker whose failures are logged and counted (`failures`), never raised: an exception on
    rank 0 would leave the other ranks waiting in the next collective, and metrics.jsonl holds
    every row anyway."""

    def __init__(self, tracker):
        self.tracker, self.failures = tracker, 0

    def _call(self, what: str, *args) -> None:
        try:
            getattr(self.tracker, what)(*args)
        except Exception as e:
            self.failures += 1
            if self.failures <= 3:
                log.warning("the tracker's %s failed (%s: %s); training goes on, metrics.jsonl has every row",
                            what, type(e).__name__, e)

    def log(self, row: dict) -> None:
        self._call("log", row)

    def log_table(self, name: str, step: int, rows: list[dict]) -> None:
        self._call("log_table", name, step, rows)

    def finish(self) -> None:
        self._call("finish")


def open_tracker(logging_cfg, run_dir: Path, name: str, config: dict, writer: str = "trainer"):
    """The configured tracker, guarded (None for logging.backend=none, or when it cannot start:
    said once, the run goes on). `writer` names the process's own tracker run (W&B)."""
    kinds = {"wandb": WandbTracker, "trackio": TrackioTracker}
    if logging_cfg.backend == "none":
        return None
    try:
        return Guarded(kinds[logging_cfg.backend](logging_cfg, Path(run_dir), name, config, writer))
    except Exception as e:
        log.warning("logging.backend=%s could not start (%s: %s); metrics.jsonl and TensorBoard only",
                    logging_cfg.backend, type(e).__name__, e)
        return None
