"""The run's secrets: what signs every batch on the wire and in the spool, and the manifest of every
checkpoint, so that only the run's own processes can write what the trainer trains on or resumes
from (a tool, a reward or an environment cannot: none of them ever holds them).

Batches are signed with `transport.secret`, else the environment's GRPO_TRANSPORT_SECRET (a Slurm
job's), else the run folder's `secret` file; manifests always with that file. It is made on first
use (32 random bytes as hex, mode 0600, linked into place whole, so that a sampler and a trainer
starting together read the same one). Workers on machines that do not share the run folder need
`transport.secret` on both.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

from grpo.common.run_folder import RunFolder
from grpo.wire.codec import resolve_secret


def run_secret(transport_secret: str | None, run_dir: str | os.PathLike) -> bytes:
    """The secret that signs the run's batches (see the module's docstring)."""
    return resolve_secret(transport_secret) or folder_secret(run_dir)


def folder_secret(run_dir: str | os.PathLike) -> bytes:
    """The run folder's own secret, whatever transport.secret is: it signs the checkpoints' manifests,
    so that a resume does not depend on the transport setting of the start that wrote them."""
    return read_or_make_secret(RunFolder(run_dir).secret).encode()


def read_or_make_secret(path: Path) -> str:
    """The secret in `path`; one made there first when there is none (mode 0600, never seen half-written)."""
    if not path.exists():
        made = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        _write_private(made, secrets.token_hex(32) + "\n")
        try:
            os.link(made, path)  # fails where another process linked its own first: theirs is read below
        except FileExistsError:
            pass
        except OSError:  # a file system without hard links: created in place (a reader waits for its line)
            try:
                _write_private(path, made.read_text())
            except FileExistsError:
                pass
        finally:
            made.unlink(missing_ok=True)
    for _ in range(100):
        text = path.read_text().strip()
        if text:
            return text
        time.sleep(0.01)  # being written in place by another process
    raise ValueError(f"{path} is empty: delete it to have a new secret made, or set transport.secret")


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
