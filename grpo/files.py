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


def write_atomically(path: str | os.PathLike, text: str) -> None:
    """Write to a unique temporary file beside `path`, fsync, rename over it, fsync the folder.

    The temporary name is unique, so two processes writing the same file cannot collide.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
