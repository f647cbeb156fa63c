"""A checkpoint is loaded only as the run wrote it, and never runs code.

- After every checkpoint, rank 0 writes `manifest.json` in its folder: each file's size and sha256,
  signed (HMAC-SHA256) with the run folder's secret (grpo/run/secret.py), which no tool or reward
  ever holds. Before a resume loads a checkpoint of its own run, every file is checked against it:
  a file changed, added or taken away after the run wrote it stops the start, naming it. (A
  checkpoint written before there were manifests has none: it is loaded, with a warning.)
- DeepSpeed's files are read with `torch.load(weights_only=True)`: tensors, containers and numbers,
  plus the few classes DeepSpeed's own state holds (SAFE_GLOBALS), allowed by name. A pickle that
  would run code (a planted `__reduce__`) is refused before anything of it runs.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import pickle
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 2**22


class CheckpointChanged(RuntimeError):
    """A checkpoint whose files are not the ones the run wrote (or that a safe load refuses)."""


def safe_globals() -> list:
    """The classes DeepSpeed's checkpoints hold (ZeRO's optimizer state, the loss scaler), by name."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_without_code(path: str, map_location=None):
    """DeepSpeed's checkpoint engine's `load`, with nothing unpickled but data (weights_only)."""
    import torch

    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointChanged(f"{path} holds something a safe load refuses ({str(e).splitlines()[0]}): it was "
                                "not written by this trainer, or by a DeepSpeed that saves other classes") from None


def load_safely(engine) -> None:
    """Every file `engine` (a DeepSpeed engine) loads from now on is loaded by load_without_code."""
    engine.checkpoint_engine.load = load_without_code


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _signed(files: dict, secret: bytes) -> str:
    return hmac.new(secret, json.dumps(files, sort_keys=True).encode(), hashlib.sha256).hexdigest()


def write_manifest(folder: Path, secret: bytes) -> None:
    """`folder`'s files (but the manifest), their sizes and digests, signed with `secret`."""
    from grpo.common.files import write_atomically

    files = {p.name: [p.stat().st_size, _digest(p)] for p in sorted(Path(folder).iterdir())
             if p.is_file() and p.name != MANIFEST}
    write_atomically(Path(folder) / MANIFEST, json.dumps({"files": files, "signature": _signed(files, secret)},
                                                         indent=1) + "\n")


def manifest_secret(checkpoints: Path, cfg) -> bytes | None:
    """The secret of the run that wrote `checkpoints`: this run's for its own folder; for a folder
    elsewhere (checkpoint.resume), its run's `secret` file beside it, None where there is none."""
    from grpo.common.run_folder import RunFolder
    from grpo.run.secret import folder_secret

    if Path(checkpoints).resolve() == RunFolder(cfg.run_dir).checkpoints.resolve():
        return folder_secret(cfg.run_dir)
    other = RunFolder(Path(checkpoints).parent).secret
    return other.read_text().strip().encode() if other.is_file() else None


def check_manifest(folder: Path, secret: bytes | None) -> str | None:
    """CheckpointChanged unless `folder` holds exactly the files its manifest lists, as listed, and
    the manifest is signed with `secret` (None: a folder of another run whose secret is not beside
    it: the files are checked against the manifest, its signature is not). A folder without a
    manifest (written before checkpoints had one) is not refused: what to log is returned, and its
    files are still loaded without code (load_without_code)."""
    folder, path = Path(folder), Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
        files, signature = manifest["files"], manifest["signature"]
    except FileNotFoundError:
        return (f"{folder} has no {MANIFEST} (written by an earlier version of the trainer, or its manifest was "
                "removed): its files cannot be checked against what the run wrote; they are loaded as data only")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointChanged(f"{path} cannot be read ({e})") from None
    if not isinstance(files, dict) or secret is not None and not hmac.compare_digest(str(signature),
                                                                                       _signed(files, secret)):
        raise CheckpointChanged(f"{path} is not signed with this run's secret: the checkpoint was changed after the "
                                "run wrote it, or belongs to another run")
    present = {p.name for p in folder.iterdir() if p.is_file() and p.name != MANIFEST}
    if present != set(files):
        raise CheckpointChanged(f"{folder} holds other files than the run wrote: added {sorted(present - set(files))}, "
                                f"missing {sorted(set(files) - present)}")
    for name, (size, digest) in files.items():
        if (folder / name).stat().st_size != size or _digest(folder / name) != digest:
            raise CheckpointChanged(f"{folder / name} was changed after the run wrote it")
    return None
