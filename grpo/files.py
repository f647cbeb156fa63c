"""Durable small-file writes: a reader sees the old content or the new, never a half-written file."""

from __future__ import annotations

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
