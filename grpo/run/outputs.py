"""Reading what a finished or running run left in its folder (grpo evaluate --run, grpo export).

    runs/<name>/config.yaml       the resolved config the trainer wrote at its start (every key)
    runs/<name>/metrics.jsonl     one row per step; evaluation rows have eval/answer_accuracy
    runs/<name>/weights/v000012/  a published version (grpo/weights/folder.py); weights/LATEST names the newest

Every failure is a `RunOutputsError` whose message names the path and says what to do. Nothing
here writes or deletes anything.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Sequence

import yaml

from grpo.common.run_folder import RunFolder
from grpo.config import Checks, Config, ConfigError, load_config
from grpo.run.rows import is_evaluation_row
from grpo.weights.folder import WeightsError, published_versions, read_latest, version_dir

log = logging.getLogger(__name__)

_VERSION_NAME = re.compile(r"^v\d+$")


class RunOutputsError(ValueError):
    """A run folder, version or metrics file that cannot be read as asked."""


def is_run_folder(path: str | os.PathLike) -> bool:
    return RunFolder(path).config.is_file()


def weights_root(path: str | os.PathLike) -> Path:
    """The published-weights folder of a run folder (its weights/, or the weights.dir its config
    names), or `path` itself when it is a weights folder."""
    path = Path(path)
    if RunFolder(path).weights.is_dir():
        return RunFolder(path).weights
    if is_run_folder(path):
        custom = saved_weights_dir(path)
        return Path(custom) if custom else RunFolder(path).weights
    return path


def saved_weights_dir(run_dir: Path) -> str:
    """The weights.dir a run folder's config names ("": its own weights/)."""
    try:
        saved = yaml.safe_load(RunFolder(run_dir).config.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise RunOutputsError(f"{RunFolder(run_dir).config} cannot be read ({e})") from None
    weights = saved.get("weights") if isinstance(saved, dict) else None
    return str(weights.get("dir") or "") if isinstance(weights, dict) else ""


def _listing(versions: list[int]) -> str:
    return ", ".join(str(v) for v in sorted(versions)) if versions else "none"


def version_folder(path: str | os.PathLike, version: int | None = None) -> Path:
    """The folder of published `version` (None: the one LATEST names) of a run or weights folder."""
    root = weights_root(path)
    if not root.is_dir():
        raise RunOutputsError(f"{root} does not exist: the run has published no weights yet "
                              "(the trainer publishes one version per weights.publish_every steps)")
    on_disk = published_versions(root)
    if version is None:
        try:
            version = read_latest(root)
        except WeightsError as e:
            raise RunOutputsError(f"{e}; pass a version (versions on disk: {_listing(on_disk)})") from None
        if version is None:
            raise RunOutputsError(f"{root} has no LATEST: no version was published yet "
                                  f"(versions on disk: {_listing(on_disk)})")
    folder = version_dir(root, version)
    if not folder.is_dir():
        raise RunOutputsError(f"{root} has no version {version} (versions on disk: {_listing(on_disk)}; "
                              "weights.keep_last keeps only the newest few); pass one of those")
    return folder


def run_of_weights(path: str | os.PathLike) -> Path | None:
    """The run folder that `path` belongs to when it is a run's weights folder or one of its
    versions (runs/<name>/weights/v000012 -> runs/<name>); None for weights outside a run, or a
    path that does not exist."""
    path = Path(os.path.abspath(path))
    if not path.is_dir():
        return None
    if _VERSION_NAME.match(path.name):
        path = path.parent
    if path.name == RunFolder(path.parent).weights.name and is_run_folder(path.parent):
        return path.parent
    return None


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    """The rows of run_dir/metrics.jsonl ([] when there is none). A line a running trainer is
    still writing (cut short) is skipped."""
    path = RunFolder(run_dir).metrics
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise RunOutputsError(f"cannot read {path}: {e.strerror}") from None
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
        except ValueError:
            log.warning("%s: line %d is not JSON (cut short?); skipped", path, number)
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def last_evaluation(run_dir: str | os.PathLike, step: int | None = None) -> dict | None:
    """The last evaluation row of metrics.jsonl (with `step`: the last one at that step), or None."""
    rows = [row for row in read_metrics(run_dir) if is_evaluation_row(row)]
    if step is not None:
        rows = [row for row in rows if row.get("step") == step]
    return rows[-1] if rows else None


def run_config(run_dir: str | os.PathLike, overrides: Sequence[str] = (), checks: Checks = ()) -> Config:
    """The run's resolved config (run_dir/config.yaml), with `key=value` overrides on top; `checks` as
    `grpo.config.load_config`'s."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunOutputsError(f"{run_dir} is not a folder; pass a run folder such as runs/<name>")
    if not is_run_folder(run_dir):
        raise RunOutputsError(f"{run_dir} is not a run folder: it has no config.yaml (the trainer writes it when a run "
                              "starts); pass runs/<name>, or --config for weights outside a run folder")
    try:
        # how the trainer resumed does not matter to a reader, and its checkpoint folder may be gone
        return load_config(RunFolder(run_dir).config, ["checkpoint.resume=auto", *overrides], written_by_a_run=True,
                           checks=checks)
    except ConfigError as e:
        raise RunOutputsError(f"{RunFolder(run_dir).config}: {e}") from None
