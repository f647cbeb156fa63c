"""Fresh start or resume: what a run folder holds decides, and no start ever deletes what a run made.

`checkpoint.resume` is `auto` (the run folder's last checkpoint, if it has one), `never`, or a
checkpoint folder. A start that finds no checkpoint to resume from is a fresh start; into a run
folder that already holds published weights, checkpoints or metrics it refuses, unless
`run.overwrite=true`, which moves the old contents aside into a dated folder beside the run
folder (nothing is deleted). The launcher and the trainer call `prepare_run_folder` before they
write anything; a lock file beside the run folder makes the check and the move one step, so two
processes starting together move it at most once.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path

from grpo.files import RunFolderError

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
CHECKPOINT_MARK = "latest"  # DeepSpeed writes it once a checkpoint is whole


class RunFolderInUse(RunFolderError):
    """A fresh start into a run folder that holds an earlier run's weights, checkpoints or metrics."""


def is_checkpoint_folder(path: str | os.PathLike) -> bool:
    """A DeepSpeed checkpoint folder: it names its last whole checkpoint in `latest`."""
    return (Path(path) / CHECKPOINT_MARK).is_file()


def resume_source(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint folder a trainer with `checkpoint.resume=resume` continues from; None: a fresh start."""
    if resume == "never":
        return None
    folder = run_dir / CHECKPOINTS if resume == "auto" else Path(resume)
    return folder if is_checkpoint_folder(folder) else None


def earlier_outputs(run_dir: Path, weights_dir: Path) -> list[str]:
    """What an earlier run left in the run folder that a fresh start would mix with its own or lose."""
    from grpo.weights import published_versions  # late: torch

    found = []
    versions = sorted(published_versions(weights_dir))
    if versions:
        found.append(f"published weights v{versions[0]}..v{versions[-1]}" if len(versions) > 1
                     else f"published weights v{versions[0]}")
    checkpoints = run_dir / CHECKPOINTS
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append("checkpoints")
    metrics = run_dir / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        rows = sum(1 for line in metrics.read_text(errors="replace").splitlines() if line.strip())
        found.append(f"{METRICS} ({rows} rows)")
    return found


def refusal(cfg, found: list[str]) -> str:
    """The one line that refuses a fresh start into a run folder holding `found`."""
    why = "checkpoint.resume=never" if cfg.checkpoint.resume == "never" else "there is no checkpoint to resume from"
    return (f"run folder {cfg.run_dir} (run.name={cfg.run.name}) already holds {', '.join(found)}, and this start is "
            f"a fresh one ({why}); nothing was changed. Pick a new run.name, or set run.overwrite=true to move the "
            "old contents aside into a dated folder")


def planned_start(cfg) -> tuple[str, str]:
    """What a start would do with the run folder, changing nothing: ("resume" | "fresh" | "overwrite"
    | "refuse", the same in words). `prepare_run_folder` decides the same way."""
    run_dir = Path(cfg.run_dir)
    source = resume_source(cfg.checkpoint.resume, run_dir)
    if source is not None:
        return "resume", f"resume from {source} (checkpoint {(source / CHECKPOINT_MARK).read_text().strip()})"
    found = earlier_outputs(run_dir, Path(cfg.weights_dir))
    if not found:
        return "fresh", "fresh start"
    if cfg.run.overwrite:
        return "overwrite", (f"fresh start; the old contents ({', '.join(found)}) are first moved aside into "
                             f"{run_dir.name}.replaced-<date> beside it (run.overwrite=true)")
    return "refuse", refusal(cfg, found)


def prepare_run_folder(cfg) -> Path | None:
    """Refuse a fresh start into a used run folder, or move its contents aside with run.overwrite;
    returns the folder they were moved to (None when nothing was moved). A resume changes nothing."""
    run_dir, weights_dir = Path(cfg.run_dir), Path(cfg.weights_dir)
    if resume_source(cfg.checkpoint.resume, run_dir) is not None:
        return None
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(run_dir.parent / f".{run_dir.name}.lock"):
        found = earlier_outputs(run_dir, weights_dir)
        if not found:
            return None
        if not cfg.run.overwrite:
            raise RunFolderInUse(refusal(cfg, found))
        return _move_aside(run_dir, weights_dir)


def _move_aside(run_dir: Path, weights_dir: Path) -> Path:
    """Rename the run folder to `<name>.replaced-<date>` (and a weights folder kept elsewhere into it)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}")
    os.rename(run_dir, target)
    outside = weights_dir.resolve() != (run_dir / "weights").resolve() and weights_dir.is_dir() \
        and not weights_dir.resolve().is_relative_to(target.resolve())
    if outside:
        os.rename(weights_dir, target / "weights.moved")
    run_dir.mkdir(parents=True)
    (target / "REPLACED.json").write_text(json.dumps(
        {"run_dir": str(run_dir), "weights_dir": str(weights_dir), "moved_at": stamp,
         "weights_moved_to": "weights.moved" if outside else "weights"}, indent=1) + "\n")
    return target


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
