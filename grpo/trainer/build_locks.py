"""Build locks of torch's JIT-compiled extensions (DeepSpeed's ops), so that a trainer never waits
on one without a word.

torch builds an extension under the file lock `<extensions root>/<build folder>/<name>/lock`: the
builder creates it, keeps it open while it compiles and removes it when done; any other process
loading the extension waits, silently and for ever, until the file is gone. A builder killed
mid-build (kill -9, an OOM kill, Ctrl-C during start-up) leaves the file behind, and every later
trainer on the machine then hangs at start. Before DeepSpeed loads its ops, the trainer removes
the locks that no process holds open (`clear_stale_locks`, one log line each) and, while it
starts, names any lock a live builder holds after a few seconds (`LockWaitReporter`).
`make install` compiles DeepSpeed's CPU op into the venv, so a run normally takes no lock at all.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

WAIT_REPORT_S = 5.0  # a build holds its lock ~1 minute: say what is waited for after this long


def extensions_root() -> Path:
    """Where torch builds extensions: $TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_locks(root: Path) -> list[Path]:
    """The lock files under `root`: <root>/<name>/lock ($TORCH_EXTENSIONS_DIR) or
    <root>/<py311_cpu>/<name>/lock (the default root)."""
    return sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})


def lock_holders(path: Path) -> list[int]:
    """The pids of the processes of this machine that have `path` open (the builder keeps it open)."""
    target, holders = str(path.resolve()), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:  # gone, or another user's
            continue
        for fd in fds:
            try:
                if os.readlink(fd) == target:
                    holders.append(int(entry.name))
                    break
            except OSError:
                continue
    return holders


def clear_stale_locks(root: Path) -> list[Path]:
    """Remove the build locks under `root` that no process holds (their builder was killed);
    each one removed is logged. The removed paths."""
    return [path for path in build_locks(root) if _remove_if_stale(path)]


def _remove_if_stale(path: Path) -> bool:
    """Remove `path` when it is this user's and no process of this machine holds it open, saying so;
    whether it was removed. Another user's lock is left alone: its holder would not be seen. The
    file is removed only if it is still the one looked at (a new build may have taken the name)."""
    try:
        seen = path.stat()
    except FileNotFoundError:  # its builder finished meanwhile
        return False
    if seen.st_uid != os.getuid() or lock_holders(path):
        return False
    try:
        now = path.stat()
        if (now.st_ino, now.st_dev) != (seen.st_ino, seen.st_dev):
            return False
        age = time.time() - now.st_mtime
        path.unlink()
    except FileNotFoundError:
        return False
    log.warning("removed the build lock %s: no process holds it (a build of %s was killed %s ago); it would "
                "have made this start wait for ever", path, path.parent.name, _duration(age))
    return True


def _duration(seconds: float) -> str:
    return (f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200
            else f"{seconds / 3600:.0f} h")


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


class LockWaitReporter:
    """While the trainer starts, a daemon thread that logs, once per lock, which live process
    holds a build lock that has existed for WAIT_REPORT_S: what the start is waiting for (or that
    this process builds). Use as a context manager around the start (DeepSpeed loads its ops in
    `init_distributed`)."""

    def __init__(self, root: Path, after_s: float = WAIT_REPORT_S, poll_s: float = 1.0, remove_stale: bool = True):
        """`remove_stale`: also remove a lock whose builder dies while this start waits (one process of
        the machine's ranks does, so that two never race to remove each other's locks)."""
        self.root, self.after_s, self.poll_s, self.remove_stale = root, after_s, poll_s, remove_stale
        self.reported: set[Path] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="build-lock-reporter", daemon=True)

    def __enter__(self) -> "LockWaitReporter":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        first_seen: dict[Path, float] = {}
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            for path in build_locks(self.root):
                first_seen.setdefault(path, now)
                if now - first_seen[path] < self.after_s:
                    continue
                if self.remove_stale and _remove_if_stale(path):  # its builder was killed while this start waited
                    first_seen.pop(path)
                    self.reported.discard(path)
                    continue
                if path in self.reported:
                    continue
                others = [pid for pid in lock_holders(path) if pid != os.getpid()]
                if others:
                    who = ", ".join(f"pid {pid} ({_command_line(pid)})" for pid in others)
                    log.warning("waiting for the build lock %s: held by %s, building %s; a build takes about a "
                                "minute", path, who, path.parent.name)
                else:
                    log.info("building %s (about a minute; its lock is %s)", path.parent.name, path)
                self.reported.add(path)
