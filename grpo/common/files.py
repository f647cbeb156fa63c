"""Durable small files (written aside, fsynced, renamed into place), folder names, checkpoint marks."""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike, content: str | bytes) -> None:
    """Write to a unique temporary file beside `path`, fsync, rename over it, fsync the folder.

    The temporary name is unique, so two processes writing the same file cannot collide; a
    failed write (a full disk) removes it and raises, leaving the old content in place.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb" if isinstance(content, bytes) else "w") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def aside_name(path: Path, stamp: str) -> Path:
    """A free name beside `path` to move it to instead of deleting it: <name>.replaced-<stamp>[-n]."""
    target, n = path.with_name(f"{path.name}.replaced-{stamp}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.replaced-{stamp}-{n}")
    return target


class RunFolderError(OSError):
    """The run folder cannot be created or written."""


def ensure_writable(folder: str | os.PathLike) -> Path:
    """Create `folder` and prove it takes a file, so that a bad run folder stops a process at
    its start with one clear line instead of at its first weights or metrics."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-test-{uuid.uuid4().hex[:8]}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise RunFolderError(f"the run folder {folder} is not writable ({e.strerror}: {e.filename}); "
                             "set run.dir to a folder you can write") from None
    return folder


CHECKPOINT_MARK = "latest"  # DeepSpeed writes it once a checkpoint is whole


def is_checkpoint_folder(path: str | os.PathLike) -> bool:
    """A DeepSpeed checkpoint folder: it names its last whole checkpoint in `latest`."""
    return (Path(path) / CHECKPOINT_MARK).is_file()


class WriteFailed(RuntimeError):
    """Weights, a checkpoint or metrics could not be written (a full disk, lost permissions)."""


@contextlib.contextmanager
def reported_write(what: str, path: Path):
    try:
        yield
    except OSError as e:
        raise WriteFailed(f"cannot write {what} to {path}: {e}") from e
    except RuntimeError as e:  # how torch.save reports a failed write
        raise WriteFailed(f"cannot write {what} to {path} (a full disk or a file size limit?): {e}") from e
