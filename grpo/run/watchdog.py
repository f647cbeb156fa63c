"""A start-up that cannot hang without a word: the launcher watches each worker's log until its
start-up is over (grpo.run.progress.READY). A worker that writes nothing for `launch.stall_s`
seconds before then gets its Python stacks written into its log (the workers register
faulthandler on SIGUSR1) and the console says where it is; still silent after twice that, the
launcher stops the run and says so."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

WORKER_SCRIPTS = ("training_worker.py", "sampling_worker.py")  # as started by hand
WORKER_MODULES = ("grpo.workers.trainer", "grpo.workers.sampler")  # as the launcher starts them (python -m)
DUMP_WAIT_S = 3.0  # how long the stacks may take to reach the log
FRAME_RE = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)', re.M)


def worker_processes(pid: int) -> list:
    """The process `pid` and its descendants that run a worker script (psutil processes): the ones
    that write their stacks on SIGUSR1. DeepSpeed's runner and launcher processes do not (to them
    SIGUSR1 is fatal)."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    found = []
    for p in tree:
        try:
            cmdline = p.cmdline()
        except psutil.Error:
            continue
        if is_worker(cmdline) and catches_sigusr1(p.pid):
            found.append(p)
    return found


def is_worker(cmdline: list[str]) -> bool:
    """A worker's command line: `python [-u] -m grpo.workers.trainer ...` or `python training_worker.py ...`
    (DeepSpeed's runner and launcher name the module too, but after their own flags: not as `-m`)."""
    if "-m" in cmdline[1:-1]:
        return cmdline[cmdline.index("-m", 1) + 1] in WORKER_MODULES
    args = [a for a in cmdline[1:] if not a.startswith("-")]
    return bool(args) and Path(args[0]).name in WORKER_SCRIPTS


def catches_sigusr1(pid: int) -> bool:
    """Whether the process has a handler for SIGUSR1 (bit 10 of SigCgt in /proc/<pid>/status): a
    worker still in its imports has none yet, and the signal would end it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M)
    return bool(caught) and bool(int(caught[1], 16) >> (signal.SIGUSR1 - 1) & 1)


def short_path(path: str) -> str:
    """A frame's file as a reader finds it: below site-packages, the standard library or the project."""
    if "site-packages/" in path:
        return path.rsplit("site-packages/", 1)[1]
    stdlib = re.search(r"/lib/python3\.\d+/(.+)$", path)
    if stdlib:
        return stdlib[1]
    root = str(Path(__file__).resolve().parents[2]) + "/"
    return path[len(root):] if path.startswith(root) else path


def where(dump: str, frames: int = 3) -> str:
    """The innermost `frames` frames of the thread that took the signal in a faulthandler dump
    ('Current thread'; else the last thread listed), as 'function (file:line) <- caller (...)'."""
    blocks = re.split(r"^(?=(?:Current thread|Thread) 0x)", dump, flags=re.M)
    threads = [b for b in blocks if b.startswith(("Current thread", "Thread"))]
    if not threads:
        return "an unknown place (no stacks reached the log)"
    current = next((b for b in threads if b.startswith("Current thread")), threads[-1])
    found = [f"{m['function']} ({short_path(m['file'])}:{m['line']})" for m in FRAME_RE.finditer(current)][:frames]
    return " <- ".join(found) or "an unknown place (no stacks reached the log)"


class StartupWatch:
    """`check()` once per launcher poll: dumps the stacks of a worker silent for `stall_s` during its
    start-up (printing where it is) and returns (worker, message) for one still silent after twice
    that; None otherwise. `logs` is the launch's grpo.run.progress.WorkerLogs."""

    def __init__(self, logs, procs: dict, stall_s: float, clock=time.monotonic):
        self.logs, self.procs, self.stall_s, self.clock = logs, procs, stall_s, clock
        self.places: dict[str, str] = {}  # worker -> where its stacks showed it

    def check(self) -> tuple[str, str] | None:
        if self.stall_s <= 0:
            return None
        for name, proc in self.procs.items():
            if self.logs.ready[name] or proc.poll() is not None:
                continue
            silent = self.clock() - self.logs.last_output[name]
            if silent >= self.stall_s and name not in self.places:
                self.places[name] = self._dump(name, proc.pid)
                print(f"warning: the {name} has written nothing for {silent:.0f} s during its start-up "
                      f"(launch.stall_s={self.stall_s:g}); it is in {self.places[name]}. Its Python stacks are in "
                      f"{self.logs.logs[name]}", flush=True)
            elif silent >= 2 * self.stall_s and name in self.places:
                return name, (f"the {name} made no progress for {silent:.0f} s during its start-up (launch.stall_s="
                              f"{self.stall_s:g}: stacks at {self.stall_s:g} s, stop at twice that); it was in "
                              f"{self.places[name]}. Its stacks are in {self.logs.logs[name]}")
        return None

    def _dump(self, name: str, pid: int) -> str:
        """Ask the worker's processes for their stacks; where the first one's main thread is."""
        path, start = self.logs.logs[name], self.logs.offsets[name]
        workers = worker_processes(pid)
        if not workers:
            return "its imports (it cannot be asked for its stacks before they are done)"
        for p in workers:
            try:
                p.send_signal(signal.SIGUSR1)
            except Exception:  # gone meanwhile
                continue
        deadline = time.monotonic() + DUMP_WAIT_S
        dump = ""
        while time.monotonic() < deadline:
            time.sleep(0.2)
            with open(path, "rb") as f:
                f.seek(start)
                dump = f.read().decode(errors="replace")
            if FRAME_RE.search(dump) and dump.endswith("\n"):
                break
        self.logs.skip_to_end(name)  # the dump is not output of the worker's own: the silence goes on
        return where(dump)
