"""Weights through the filesystem.

    <weights>/v000012/  adapter_model.safetensors + adapter_config.json   (LoRA, PEFT format)
                        or model.safetensors + config.json                 (full fine-tune)
                        manifest.json  {"version", "step", "kind", "files": {name: sha256}}
    <weights>/LATEST    "12"
    <weights>/digests.jsonl  {"version", "digest"} per publish: the sha256 of that manifest.json

The writer fills a temporary folder, fsyncs it, renames it into place, records the manifest's
digest, then replaces LATEST by write-temp-and-rename, so a reader never sees a half-written
version nor one whose digest is unrecorded. The reader verifies every checksum before loading
and keeps the weights it has when anything is wrong. Each batch names the digest of the version
it was sampled with, and the trainer accepts only digests it recorded (grpo/wire/behaviour.py): a
re-publish after a restart adds a line, so batches from before the restart still match.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from grpo.common.files import fsync_path, write_atomically

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LATEST = "LATEST"
DIGESTS = "digests.jsonl"
INITIAL_DIGEST = "initial"  # version 0: the weights both processes build from model.name_or_path
LORA_FILES = ("adapter_model.safetensors", "adapter_config.json")
FULL_FILES = ("model.safetensors", "config.json")


class WeightsError(RuntimeError):
    """A published version that is missing, incomplete or corrupted."""


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version:06d}"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_weights(model, folder: Path, hub_names: bool = False) -> str:
    """Write the adapter (PEFT model) or the full model into `folder`; returns the kind. Full weights carry the
    model's own names, which the HF engine copies them by; transformers' Hub format renames some (a vision-language
    model's model.language_model.X is model.X there, an MoE's experts are a tensor each), and vLLM reads those
    (`hub_names`). from_pretrained reads either."""
    if hasattr(model, "peft_config"):
        model.save_pretrained(folder, safe_serialization=True)
        return "lora"
    model.save_pretrained(folder, safe_serialization=True, save_original_format=hub_names)
    return "full"


def publish(model, root: str | os.PathLike, version: int, step: int, keep_last: int = 3,
            hub_names: bool = False) -> Path:
    """Publish `model`'s weights as `version` (`hub_names`: see save_weights); returns the version's folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    target = version_dir(root, version)
    tmp = root / f".tmp-{target.name}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        kind = save_weights(model, tmp, hub_names)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        manifest = json.dumps({"version": version, "step": step, "kind": kind, "files": files}, indent=1).encode()
        (tmp / MANIFEST).write_bytes(manifest)
        for p in tmp.iterdir():
            fsync_path(p)
        fsync_path(tmp)
        if target.exists():  # a re-publish after a restart: replace the old copy whole
            shutil.rmtree(target)
        os.rename(tmp, target)
        fsync_path(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record_digest(root, version, hashlib.sha256(manifest).hexdigest())
    write_atomically(root / LATEST, str(version))
    prune(root, keep_last)
    return target


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` versions (never the one LATEST names), and the
    temporary folders a publisher killed mid-write left behind (invisible to readers)."""
    for leftover in root.glob(".tmp-v*"):
        shutil.rmtree(leftover, ignore_errors=True)
    latest = read_latest(root)
    versions = sorted(published_versions(root))
    for v in versions[:-keep_last] if keep_last > 0 else versions:
        if v != latest:
            shutil.rmtree(version_dir(root, v), ignore_errors=True)


def record_digest(root: Path, version: int, digest: str) -> None:
    with open(Path(root) / DIGESTS, "a") as f:
        f.write(json.dumps({"version": version, "digest": digest}) + "\n")
        f.flush()
        os.fsync(f.fileno())


def published_digests(root: str | os.PathLike) -> dict[int, set[str]]:
    """Every manifest digest published into `root`, by version (a version re-published after a
    trainer restart has two). A line cut short by a crash is skipped."""
    out: dict[int, set[str]] = {}
    path = Path(root) / DIGESTS
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            out.setdefault(int(entry["version"]), set()).add(str(entry["digest"]))
        except (ValueError, KeyError, TypeError):
            continue
    return out


def published_versions(root: Path) -> list[int]:
    root = Path(root)
    if not root.is_dir():
        return []
    return [int(p.name[1:]) for p in root.iterdir() if p.is_dir() and p.name.startswith("v") and p.name[1:].isdigit()]


def read_latest(root: str | os.PathLike) -> int | None:
    """The version LATEST names, or None before the first publish."""
    path = Path(root) / LATEST
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise WeightsError(f"{path} holds {text[:40]!r}, not a version number")
    return int(text)


def verify(folder: Path) -> dict:
    """The manifest of a published version, after checking every file's sha256; its own sha256
    is added as "digest" (what a batch sampled with it names)."""
    manifest_path = folder / MANIFEST
    try:
        raw = manifest_path.read_bytes()
        manifest = {**json.loads(raw), "digest": hashlib.sha256(raw).hexdigest()}
        files = manifest["files"]
        int(manifest["version"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"{manifest_path}: unreadable manifest ({type(e).__name__}: {e})") from None
    required = LORA_FILES if manifest.get("kind") == "lora" else FULL_FILES
    missing = [name for name in required if name not in files]
    if missing:
        raise WeightsError(f"{folder}: manifest lists no {', '.join(missing)}")
    for name, expected in files.items():
        path = folder / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise WeightsError(f"{folder}: file {name!r} is missing")
        actual = sha256_file(path)
        if actual != expected:
            raise WeightsError(f"{path}: checksum mismatch (manifest {expected[:12]}…, file {actual[:12]}…)")
    return manifest


def load_into(model, folder: Path, manifest: dict) -> None:
    """Copy a verified version's weights into the live model, all or nothing."""
    stage_into(model, folder, manifest).commit()


def stage_into(model, folder: Path, manifest: dict) -> "Staged":
    """Read a verified version's weights and check that they fit the live model; its commit copies them in."""
    from safetensors.torch import load_file

    if manifest["kind"] == "lora":
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        if not hasattr(model, "peft_config"):
            raise WeightsError(f"{folder} is a LoRA adapter but the sampler's model has no adapter (lora.enabled?)")
        state = load_file(folder / "adapter_model.safetensors")
        _check_fits(folder, state, get_peft_model_state_dict(model), exact=True)

        def commit_adapter():
            with torch.no_grad():
                set_peft_model_state_dict(model, state)
        return Staged(commit_adapter)
    from safetensors import safe_open

    own = model.state_dict()
    with safe_open(folder / "model.safetensors", "pt") as f:  # the names alone: the file is read once below
        own_names = all(k in own for k in f.keys())
    # written for vLLM under the Hub's names: transformers renames them
    state = load_file(folder / "model.safetensors") if own_names else _under_own_names(model, folder)
    _check_fits(folder, state, own, exact=False)  # tied weights are saved once

    def commit_full():
        with torch.no_grad():
            for k, v in state.items():
                own[k].copy_(v)
    return Staged(commit_full)


def _under_own_names(model, folder: Path) -> dict:
    """The folder's weights under `model`'s own names, read as from_pretrained reads the Hub's (a vision-language
    model's modules renamed, an MoE's experts fused): a model of its class loaded from the folder, on the CPU. A
    folder it cannot read is left to _check_fits to name."""
    try:
        loaded = type(model).from_pretrained(folder, dtype=next(model.parameters()).dtype)
    except (OSError, ValueError, RuntimeError) as e:
        from safetensors.torch import load_file

        log.warning("%s: its weights' names are not the model's, and transformers cannot read them (%s)", folder, e)
        return load_file(folder / "model.safetensors")
    return loaded.state_dict()


def _check_fits(folder: Path, state: dict, own: dict, exact: bool) -> None:
    """Checked before anything is copied, so a bad file never leaves the model half-updated."""
    unknown = [k for k in state if k not in own]
    missing = [k for k in own if k not in state] if exact else []
    bad_shape = [k for k in state if k in own and own[k].shape != state[k].shape]
    if unknown or missing or bad_shape:
        raise WeightsError(f"{folder}: weights do not fit the model (unknown {unknown[:2]}, missing {missing[:2]}, "
                           f"wrong shape {bad_shape[:2]})")


def _identity(folder: Path) -> tuple:
    try:
        st = (folder / MANIFEST).stat()
        return st.st_ino, st.st_mtime_ns
    except OSError:
        return None, None


@dataclass
class LoadResult:
    version: int
    loaded: bool
    error: str | None = None


@dataclass
class Staged:
    """A version one copy of the weights has read and checked but does not serve yet. `commit`
    serves it and fails only where nothing could have checked beforehand; `discard` drops it."""

    commit: Callable[[], None]
    discard: Callable[[], None] = lambda: None


@dataclass
class Prepared:
    """A version verified and staged in every copy of the weights, not served yet (WeightWatcher.commit)."""

    version: int
    folder: Path
    staged: list[Staged]
    seconds: float  # verifying and staging it

    def discard(self) -> None:
        for copy in self.staged:
            copy.discard()


# (verified folder, its manifest, version) -> the version staged in one copy; raises when it cannot be
Stager = Callable[[Path, dict, int], Staged]


class WeightsDiverged(RuntimeError):
    """A commit failed after others succeeded: the copies of the weights serve different versions."""


def stager_for_model(model) -> Stager:
    """Stages each version for a live transformers/PEFT model (the sampler's scoring copy)."""
    return lambda folder, manifest, version: stage_into(model, folder, manifest)


class WeightWatcher:
    """The sampler's side: verify each new published version, then stage it in every copy of the
    weights (the rollout engine's `stage_weights`, and the scoring model when the engine keeps
    its own copy) and commit it only when all of them could: the copies never serve two versions.

    On any failure (half-written, checksum mismatch, incompatible, refused by one copy) it keeps
    serving the version it has, logs why, and counts the failure; a later version is tried afresh.
    """

    def __init__(self, root: str | os.PathLike, stagers: list[Stager], initial_version: int = 0):
        self.root, self.stagers = Path(root), list(stagers)
        self.version = initial_version
        self.failures = 0
        self.load_seconds = 0.0  # spent verifying and copying versions in, in all
        self.commits = 0  # versions served so far (a version number can come back after a trainer restart)
        self._refused: dict[int, tuple] = {}  # version -> identity of the folder that failed

    def latest(self) -> int | None:
        try:
            return read_latest(self.root)
        except (WeightsError, OSError) as e:
            log.warning("cannot read %s/LATEST: %s", self.root, e)
            return None

    def poll(self, prefer: int | None = None) -> LoadResult | None:
        """Load the version LATEST names when it is not ours; None when nothing changed. `prefer`:
        a version wanted on its way there (an evaluation mark): when it is newer than ours and
        published, the oldest version on disk at or past it is loaded instead of LATEST.

        LATEST moves back only when a trainer restarts from an older checkpoint: the versions
        after it belong to a trajectory being redone, so the sampler follows it back."""
        prepared = self.prepare(prefer)
        return self.commit(prepared) if isinstance(prepared, Prepared) else prepared

    def prepare(self, prefer: int | None = None) -> Prepared | LoadResult | None:
        """`poll`'s first half, which serves nothing yet (another thread may run it): the version to load
        verified and staged in every copy (Prepared), refused (LoadResult), or None when nothing changed."""
        latest = self.latest()
        if latest is not None and prefer is not None and self.version < prefer <= latest:
            wanted = min((v for v in published_versions(self.root) if prefer <= v <= latest), default=latest)
            if self._refused.get(wanted) != _identity(version_dir(self.root, wanted)):  # else on to LATEST
                latest = wanted
        if latest is None or latest == self.version:
            return None
        folder = version_dir(self.root, latest)
        identity = _identity(folder)
        if self._refused.get(latest) == identity:
            return None  # already refused this copy; a re-published one is tried afresh
        started, staged = time.perf_counter(), []
        try:
            manifest = verify(folder)
            if manifest["version"] != latest:
                raise WeightsError(f"{folder}: manifest says version {manifest['version']}")
            for stage in self.stagers:
                staged.append(stage(folder, manifest, latest))
        except (WeightsError, OSError, ValueError, RuntimeError) as e:
            for copy in staged:
                copy.discard()
            self.load_seconds += time.perf_counter() - started
            self.failures += 1
            self._refused[latest] = identity
            log.error("refused weights v%d (%s); still serving v%d", latest, e, self.version)
            return LoadResult(latest, False, str(e))
        return Prepared(latest, folder, staged, time.perf_counter() - started)

    def commit(self, prepared: Prepared) -> LoadResult:
        """Serve a prepared version: every copy takes it."""
        started = time.perf_counter()
        for i, copy in enumerate(prepared.staged):
            try:
                copy.commit()
            except Exception as e:
                raise WeightsDiverged(f"serving weights v{prepared.version} from {prepared.folder} failed in copy "
                                      f"{i + 1} of {len(prepared.staged)} after the others took it ({e}); the "
                                      "sampler stops rather than sample with one version and score with "
                                      "another") from e
        self.load_seconds += prepared.seconds + time.perf_counter() - started
        self.version, self.commits = prepared.version, self.commits + 1
        log.info("loaded weights v%d from %s", prepared.version, prepared.folder)
        return LoadResult(prepared.version, True)


class Publisher:
    """The trainer's end: each version into weights.dir, the oldest beyond weights.keep_last removed."""

    def __init__(self, root: str | os.PathLike, keep_last: int, hub_names: bool = False):
        self.root, self.keep_last, self.hub_names = Path(root), keep_last, hub_names

    def publish(self, model, version: int, step: int) -> Path:
        return publish(model, self.root, version, step, self.keep_last, self.hub_names)


def publisher(cfg) -> Publisher:
    return Publisher(cfg.weights_dir, cfg.weights.keep_last, hub_names=cfg.sampling.engine == "vllm")


def watcher(cfg, stagers: list[Stager], initial_version: int = 0) -> WeightWatcher:
    return WeightWatcher(cfg.weights_dir, stagers, initial_version)
