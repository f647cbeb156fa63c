"""Fresh start or resume: what a run folder holds decides, and no start ever deletes what a run made.

`checkpoint.resume` is `auto` (the run folder's last checkpoint, if it has one), `never`, or a
checkpoint folder. A resume from the run folder's own checkpoints continues the run (the trainer
then drops the versions published after the checkpoint: they belong to the steps it redoes). Any
other start is a fresh start of this run folder (from the model, or from another run's checkpoint
until this run has one of its own); into a folder that already holds published weights,
checkpoints or metrics it refuses, unless `run.overwrite=true`, which moves the old contents
aside into a dated folder beside it (nothing is deleted).

A start that trained no step leaves nothing that counts: its config files, logs, address,
`trainer_state.json` at step 0, spool, metrics rows of step 0 (the evaluation of the starting
weights) and a checkpoint of step 0 (which earlier versions wrote on SIGTERM) neither make the
folder used nor are resumed from; the next start is a fresh one (its metrics file is moved aside;
a sampler drops what a start with other settings left: grpo/sampler/state.py).

A run folder is in use while its trainer runs: rank 0 holds an exclusive lock on
`.<name>.lock` beside the folder (`hold_run_folder`; the kernel drops it when the process ends), so
a second launch or trainer into a live run stops instead of resuming or moving it under the first.
The launcher checks the lock and prepares the folder before it starts anything.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.common.files import CHECKPOINT_MARK, RunFolderError, aside_name, is_checkpoint_folder
from grpo.common.run_folder import RunFolder

if TYPE_CHECKING:
    from grpo.settings import Config

UNTRAINED_TAG = "step000000"  # the checkpoint of a start stopped before its first step (written until this version)
DEEPSPEED_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")  # DeepSpeed copies them beside a ZeRO checkpoint


class RunFolderInUse(RunFolderError):
    """A fresh start into a run folder that holds an earlier run's outputs, or a run whose trainer still runs."""


def resume_source(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint folder a trainer with `checkpoint.resume=resume` loads; None: from the model.
    A folder elsewhere starts this run from it only until the run has a checkpoint of its own."""
    own = RunFolder(run_dir).checkpoints
    if resume == "never":
        return None
    if is_checkpoint_folder(own) and latest_tag(own) != UNTRAINED_TAG:  # auto, or a folder elsewhere
        return own  # that this run has moved on from
    return Path(resume) if resume != "auto" and is_checkpoint_folder(resume) else None


def continues_the_run(resume: str, run_dir: Path) -> bool:
    """True when the start resumes from the run folder's own checkpoints (not a fresh start)."""
    source = resume_source(resume, run_dir)
    return source is not None and source.resolve() == (RunFolder(run_dir).checkpoints).resolve()


def earlier_outputs(run_dir: Path, weights_dir: Path) -> list[str]:
    """What an earlier run left in the run folder that a fresh start would mix with its own or lose."""
    from grpo.weights.folder import published_versions  # late: torch

    found = []
    versions = sorted(published_versions(weights_dir))
    if versions:
        found.append(f"published weights v{versions[0]}..v{versions[-1]}" if len(versions) > 1
                     else f"published weights v{versions[0]}")
    checkpoints = RunFolder(run_dir).checkpoints
    if checkpoints.is_dir() and not all(untrained_checkpoint_file(p) for p in checkpoints.iterdir()):
        found.append("checkpoints")
    rows = metrics_rows(RunFolder(run_dir).metrics)
    if any(row.get("step") != 0 for row in rows):
        found.append(f"{RunFolder(run_dir).metrics.name} ({len(rows)} rows)")
    return found


def trained_nothing(run_dir: Path, weights_dir: Path) -> bool:
    """No step of the run folder's run was trained: what earlier starts left there does not count."""
    return not earlier_outputs(run_dir, weights_dir)


def latest_tag(checkpoints: Path) -> str:
    """The checkpoint DeepSpeed's `latest` names ('' without one)."""
    mark = Path(checkpoints) / CHECKPOINT_MARK
    return mark.read_text().strip() if mark.is_file() else ""


def untrained_checkpoint_file(path: Path) -> bool:
    """Part of a checkpoint of step 0 (a start stopped before its first step), or DeepSpeed's scripts."""
    return path.name in (UNTRAINED_TAG, *DEEPSPEED_SCRIPTS) or \
        (path.name == CHECKPOINT_MARK and latest_tag(path.parent) == UNTRAINED_TAG)


def metrics_rows(path: Path) -> list[dict]:
    """The rows of a metrics file; a line that is not a JSON object (cut short by a crash) is `{}`."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                row = {}
            rows.append(row if isinstance(row, dict) else {})
    return rows


def refusal(cfg: Config, found: list[str]) -> str:
    """The one line that refuses a fresh start into a run folder holding `found`."""
    resume = cfg.checkpoint.resume
    why = ("checkpoint.resume=never" if resume == "never" else "there is no checkpoint to resume from"
           if resume == "auto" else f"checkpoint.resume={resume} is another run's checkpoint")
    return (f"run folder {cfg.run_dir} (run.name={cfg.run.name}) already holds {', '.join(found)}, and this start is "
            f"a fresh one ({why}); nothing was changed. Pick a new run.name, or set run.overwrite=true to move the "
            "old contents aside into a dated folder")


def planned_start(cfg: Config) -> tuple[str, str]:
    """What a start would do with the run folder, changing nothing: ("resume" | "fresh" | "overwrite"
    | "refuse" | "in use", the same in words). `prepare_run_folder` decides the same way."""
    run_dir = Path(cfg.run_dir)
    holder = lock_holder(run_dir)
    if holder is not None:
        return "in use", in_use_message(cfg, holder)
    source = resume_source(cfg.checkpoint.resume, run_dir)
    start = f"from {source} (checkpoint {(source / CHECKPOINT_MARK).read_text().strip()})" if source else ""
    if continues_the_run(cfg.checkpoint.resume, run_dir):
        return "resume", f"resume {start}"
    found = earlier_outputs(run_dir, Path(cfg.weights_dir))
    fresh = f"fresh start {start}".strip()
    if not found:
        return "fresh", fresh
    if cfg.run.overwrite:
        return "overwrite", (f"{fresh}; the old contents ({', '.join(found)}) are first moved aside into "
                             f"{run_dir.name}.replaced-<date> beside it (run.overwrite=true)")
    return "refuse", refusal(cfg, found)


def prepare_run_folder(cfg: Config, held: bool = False) -> Path | None:
    """Refuse a fresh start into a used run folder, or move its contents aside with run.overwrite;
    returns the folder they were moved to (None when nothing was moved). A resume changes nothing;
    a fresh start over one that trained nothing moves only its metrics.jsonl aside.
    `held`: the caller holds the run's lock (`hold_run_folder`); else it is taken for the check."""
    run_dir, weights_dir = Path(cfg.run_dir), Path(cfg.weights_dir)
    with contextlib.nullcontext() if held else _exclusive(run_dir, cfg):
        if continues_the_run(cfg.checkpoint.resume, run_dir):
            return None
        found = earlier_outputs(run_dir, weights_dir)
        if not found:
            _move_untrained_metrics_aside(run_dir)
            return None
        if not cfg.run.overwrite:
            raise RunFolderInUse(refusal(cfg, found))
        try:
            return _move_aside(run_dir, weights_dir)
        except OSError as e:
            raise RunFolderError(f"run.overwrite=true could not move the old contents of {run_dir} aside ({e}); "
                                 "nothing was deleted: move them yourself or pick a new run.name") from None


def hold_run_folder(cfg: Config):
    """The trainer's claim on its run for as long as it runs: an open file holding the exclusive
    lock (keep it referenced). RunFolderInUse when another process holds it."""
    path = _lock_path(Path(cfg.run_dir))
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RunFolderInUse(in_use_message(cfg, holder)) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def in_use_message(cfg: Config, holder: str) -> str:
    return (f"run folder {cfg.run_dir} (run.name={cfg.run.name}) is in use by a running trainer (pid {holder}); "
            "stop it first, or pick a new run.name")


def lock_holder(run_dir: Path) -> str | None:
    """The pid written by the process that holds the run's lock, or None when no one holds it."""
    path = _lock_path(run_dir, create=False)
    if not path.is_file():
        return None
    with open(path) as f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return f.read().strip() or "?"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def _lock_path(run_dir: Path, create: bool = True) -> Path:
    real = Path(run_dir).resolve()  # beside the folder itself, so that it stays put when the folder is moved
    if create:
        real.parent.mkdir(parents=True, exist_ok=True)
    return real.parent / f".{real.name}.lock"


@contextlib.contextmanager
def _exclusive(run_dir: Path, cfg: Config):
    """The run's lock for a check-and-move; RunFolderInUse when a running trainer holds it."""
    f = hold_run_folder(cfg)
    try:
        yield
    finally:
        f.close()


def _move_untrained_metrics_aside(run_dir: Path) -> None:
    """A fresh start over a start that trained nothing: its rows (evaluations of its starting
    weights, maybe of another model) go to metrics.jsonl.replaced-<date>, so that this start
    evaluates its own (the trainer writes one evaluation row per version)."""
    metrics = RunFolder(run_dir).metrics
    if metrics_rows(metrics):
        os.rename(metrics, aside_name(metrics, time.strftime("%Y%m%d-%H%M%S")))


def _move_aside(run_dir: Path, weights_dir: Path) -> Path:
    """Rename the run folder (the real one, when run.dir is a link) to `<name>.replaced-<date>`, and
    a weights folder kept outside it to `<weights>.replaced-<date>` beside itself (a rename within
    its own file system); REPLACED.json in the moved run folder says where each went."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    real_run, real_weights = run_dir.resolve(), weights_dir.resolve()
    outside = real_weights.is_dir() and not real_weights.is_relative_to(real_run)
    weights_target = aside_name(real_weights, stamp) if outside else None
    target = aside_name(real_run, stamp)
    if weights_target is not None:
        os.rename(real_weights, weights_target)
    os.rename(real_run, target)
    real_run.mkdir()
    (target / "REPLACED.json").write_text(json.dumps(
        {"run_dir": str(run_dir), "weights_dir": str(weights_dir), "moved_at": stamp,
         "weights_moved_to": str(weights_target) if outside else str(target / "weights")}, indent=1) + "\n")
    return target
