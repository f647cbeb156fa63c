"""The budgets of a jailed call's whole process tree (grpo/common/jail.py): memory and processes.

Where a cgroup can be made beside the warden's own (cgroup v2 with the memory and pids controllers
delegated, or v1's memory and pids hierarchies writable, as for root in most containers), each call
gets one: the kernel then refuses the fork past `max_processes` and, past `memory_mb`, its OOM killer
takes a process of the call, never the sampler. Elsewhere the warden watches the call's processes
every tick (their count and their resident memory, from /proc) and ends the call past either: a
fork bomb can then run past the count for up to a tick before it is ended.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _own_cgroups() -> dict[str, str]:
    """controller (or "" for cgroup v2) -> this process's cgroup path, from /proc/self/cgroup."""
    own = {}
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
    except (OSError, ValueError):
        pass
    return own


def _limits_v2(memory_mb: int, max_processes: int) -> dict[str, str]:
    return {"memory.max": str(memory_mb * 2**20) if memory_mb else "max",
            "memory.swap.max": "0", "pids.max": str(max_processes) if max_processes else "max"}


class CallBudget:
    """One call's budgets: `folders` are its cgroups (none: watched). `enter()` runs in the call's
    first process; `exceeded(processes)` says which budget the call went past, if any; `close()`
    removes the cgroups once the call's processes are gone."""

    def __init__(self, memory_mb: int, max_processes: int):
        self.memory_mb, self.max_processes = memory_mb, max_processes
        self.folders: list[Path] = []
        self.kind = "watched"
        if memory_mb or max_processes:
            self._make_groups()

    def _make_groups(self) -> None:
        name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"  # the warden's pid: swept when it is gone
        v2 = _v2_parent()
        if v2 is not None:
            if self._try(v2 / name, _limits_v2(self.memory_mb, self.max_processes)):
                self.kind = "cgroup v2"
                return
            self.close()
        memory = {key: str(self.memory_mb * 2**20) for key in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
                  } if self.memory_mb else {}  # memsw (where swap accounting is on): swap counts too
        pids = {"pids.max": str(self.max_processes)} if self.max_processes else {}
        parents = _v1_parents()
        for controller, limits in (("memory", memory), ("pids", pids)):
            if limits and (controller not in parents or not self._try(parents[controller] / name, limits)):
                self.close()
                return
        self.kind = "cgroup v1" if self.folders else "watched"

    def _try(self, folder: Path, limits: dict[str, str]) -> bool:
        try:
            folder.mkdir()
        except OSError:
            return False
        self.folders.append(folder)
        try:
            for key, value in limits.items():
                if (folder / key).exists() or key not in OPTIONAL_LIMITS:
                    (folder / key).write_text(value)
        except OSError:
            return False
        return True

    def enter(self) -> None:
        """The calling process (the call's first), and all it will start, into the call's cgroups."""
        for folder in self.folders:
            (folder / "cgroup.procs").write_text("0")

    def exceeded(self, processes: list[int]) -> str | None:
        """Which budget the call went past ('memory' or 'processes'), None while within both.
        `processes`: the call's live processes (for the watch where no cgroup holds it)."""
        if self.folders:
            if any(_count(f / name, "oom_kill") for f in self.folders for name in ("memory.events",
                                                                                   "memory.oom_control")):
                return "memory"
            return "processes" if any(_count(f / "pids.events", "max") for f in self.folders) else None
        if self.max_processes and len(processes) > self.max_processes:
            return "processes"
        if self.memory_mb and sum(map(_resident_bytes, processes)) > self.memory_mb * 2**20:
            return "memory"
        return None

    def close(self) -> None:
        """The cgroups removed (their processes are gone: a moment's retry for the last to be reaped)."""
        for folder in reversed(self.folders):
            _remove(folder)
        self.folders = []


PREFIX = "grpo-jail-"
OPTIONAL_LIMITS = ("memory.swap.max", "memory.memsw.limit_in_bytes")  # set where the kernel has them


def _v2_parent() -> Path | None:
    """This process's cgroup v2 folder where the memory and pids controllers are delegated to its children."""
    own = _own_cgroups()
    for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        folder = root / own.get("", "/").lstrip("/")
        if "" in own and (root / "cgroup.controllers").exists() and \
                {"memory", "pids"} <= set(_read(folder / "cgroup.subtree_control").split()):
            return folder
    return None


def _v1_parents() -> dict[str, Path]:
    """controller -> this process's cgroup v1 folder, for the memory and pids hierarchies mounted."""
    own = _own_cgroups()
    return {c: CGROUP_ROOT / c / own[c].lstrip("/") for c in ("memory", "pids")
            if c in own and (CGROUP_ROOT / c / own[c].lstrip("/")).is_dir()}


def sweep_cgroups(warden: int) -> None:
    """The cgroups of the warden `warden`'s calls, left where it was killed mid-call, removed (its
    calls' processes died with it)."""
    parents = [p for p in [_v2_parent(), *_v1_parents().values()] if p is not None]
    for parent in parents:
        for folder in parent.glob(f"{PREFIX}{warden}-*"):
            _remove(folder)


def _remove(folder: Path) -> None:
    for _ in range(50):
        try:
            folder.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)  # a process of it not reaped yet


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _count(path: Path, key: str) -> int:
    """The counter `key` of a cgroup's events file (0 where it has none)."""
    fields = _read(path).split()
    return int(dict(zip(fields[::2], fields[1::2])).get(key, 0))


def _resident_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
