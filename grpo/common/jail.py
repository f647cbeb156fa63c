"""Untrusted code runs here: each call in a jail of its own that holds nothing of the run.

    owner (the sampler's rewards, an environments' child) ──JSON frames over two pipes──► warden
    warden (grpo/common/jail_warden.py): a Python started by exec (it holds nothing of the run: no
            dataset, no model, no secret, no other process's memory), the named functions imported
            once; per call it forks:
        call: its own session, folder and cgroup (grpo/common/jail_budget.py), user/mount/PID/IPC/network
              namespaces, Landlock file rules, seccomp, no capabilities, rlimits (grpo/common/jail_rules.py);
              a call allowed one port reaches it through a relay (grpo/common/jail_relay.py);
              runs fn(*arguments) and writes back one JSON answer; then its whole tree is ended

The owner reads back the function's JSON value (a tool's result, a reward) and nothing else: a
reward or a tool cannot set what the owner does with it (an episode's `done`, another sample's
score), and what one call changes (a module it patches, a file in its folder) is gone with it. A
call that raises, runs past its time, or goes past a budget fails alone (ChildFailed: the model
reads an error, the sample's reward fails); a warden that died is started again. Frames are JSON,
never pickle.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field

from grpo.common.child import SET_ENVIRONMENT, ChildFailed, ChildRefused, _stat, end_session, passed_environment
from grpo.common.jail_budget import sweep_cgroups

HEADER = struct.Struct(">I")
MAX_ANSWER_BYTES = 16 * 2**20  # a call's answer past this fails the call (a tool's text is cut far below it)
# how long past a call's own limit the owner waits for a live warden before replacing it: a dead one is
# seen at once (its pipe closes); a built-in's caches (`prepare`) are built before the call's clock starts
WARDEN_GRACE_S = 60.0
START_TIMEOUT_S = 60.0
JAILED = "GRPO_JAILED"  # "1" in a jailed call's environment: code that must run only here checks it


@dataclass(frozen=True)
class JailLimits:
    """A call's budgets: memory of its whole tree (MB; 0: none), processes of its tree, CPU seconds
    of each process, the largest file it may write (MB), whether it may use the network, the
    folders it may write besides its own temporary one, the files it may read besides the system's
    and the project's, and the one TCP port it may connect to where it has no network (0: none): in a
    network of its own, 127.0.0.1:<port> relayed to the host's (grpo/common/jail_relay.py), and a Landlock
    rule for that port alone (where namespaces are refused, that rule alone: ports, not addresses)."""

    memory_mb: int = 2048
    max_processes: int = 64
    cpu_s: int = 600
    file_mb: int = 256
    network: bool = False
    writable: tuple[str, ...] = field(default_factory=tuple)
    readable: tuple[str, ...] = field(default_factory=tuple)
    connect_port: int = 0
    namespaces: bool = True  # False: none even where the kernel allows them (the fallback, as where it refuses)


def write_frame(fd: int, value) -> None:
    data = json.dumps(value).encode()
    view = memoryview(HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def read_exactly(fd: int, size: int) -> bytes:
    """`size` bytes from `fd`; EOFError when it closes first."""
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 2**20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, limit: int = MAX_ANSWER_BYTES):
    (size,) = HEADER.unpack(read_exactly(fd, HEADER.size))
    if size > limit:
        raise ValueError(f"a message of {size} bytes, past the limit of {limit}")
    return json.loads(read_exactly(fd, size))


# ----------------------------------------------------------------------------- the owner's side

class Jail:
    """The owner's side: a warden started by exec, serving `call(target, arguments)`. `resolver`:
    the import path of `resolve(target) -> function` (the owner's: rewards/sandbox.py:jailed_reward,
    grpo/environments/tools.py:jailed_tool), run in the warden; `targets`: what it resolves at start
    (the rest on first use); `pass_env`: variables the calls see besides the allow-list of grpo/common/child.py."""

    def __init__(self, name: str, resolver: str, targets: list[str] = (), limits: JailLimits = JailLimits(),
                 pass_env=()):
        self.name, self.resolver, self.targets, self.limits = name, resolver, list(targets), limits
        self.pass_env = pass_env
        self.restarts, self.closed = 0, False
        self._ending = threading.RLock()  # restart and close, from any thread; a failed start closes within
        self._process, self._requests, self._answers, self.folder = None, -1, -1, ""
        self._start()

    def _start(self) -> None:
        requests_read, self._requests = os.pipe()
        self._answers, answers_write = os.pipe()
        self.folder = tempfile.mkdtemp(prefix=f"grpo-jail-{self.name}-")  # its calls' folders, removed with it
        # the owner's import path, in its order; the working folder never before it (Python >= 3.11)
        environment = {**passed_environment(os.environ, self.pass_env), **SET_ENVIRONMENT,
                       "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONSAFEPATH": "1"}
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "grpo.common.jail_warden", str(requests_read), str(answers_write),
                 str(os.getpid())],
                pass_fds=(requests_read, answers_write), env=environment, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(requests_read)
            os.close(answers_write)
        write_frame(self._requests, {"resolver": self.resolver, "targets": self.targets, "folder": self.folder,
                                     "limits": asdict(self.limits)})
        answer = self._answer(START_TIMEOUT_S)
        if answer is None or answer[0] != "ready":
            self.close()
            why = "it did not start" if answer is None else answer[1]
            raise ChildRefused(f"the {self.name} jail could not start: {why}")
        self.info = answer[1]

    def _answer(self, timeout_s: float):
        """The warden's next frame, None when none came within `timeout_s` or it died."""
        if self._answers < 0 or not select.select([self._answers], [], [], timeout_s)[0]:
            return None
        try:  # the warden re-encodes a call's answer as ASCII JSON: up to 6 bytes a character
            return read_frame(self._answers, limit=6 * MAX_ANSWER_BYTES + 2**20)
        except (EOFError, OSError, ValueError, RecursionError):
            return None

    def call(self, target: str, arguments: list, timeout_s: float, timeout_message: str):
        """The function `target` names, called with `arguments` in a jail of its own: its JSON value;
        ChildFailed where it raised (with where), ran past `timeout_s` (`timeout_message`), went past
        a budget or died."""
        if self.closed:
            raise ChildFailed(f"the {self.name} jail is closed")
        process = self._process  # read once: a close() from another thread sets it to None
        if process is None or process.poll() is not None:
            self.restart()
        try:
            write_frame(self._requests, [target, arguments, timeout_s])
        except OSError:
            self.restart()
            raise ChildFailed(f"the {self.name} jail could not take the call") from None
        answer = self._answer(timeout_s + WARDEN_GRACE_S)
        if answer is None:
            self.restart()
            raise ChildFailed(f"the {self.name} jail did not answer")
        status, value, *where = answer
        if status == "timeout":
            raise ChildFailed(timeout_message)
        if status != "ok":
            raise ChildFailed(value, *where[:1])
        return value

    def end_call(self) -> None:
        """The running call ended from another thread: its first process killed (the warden then ends every
        process of the call and answers that it died, so `call` raises ChildFailed); the warden stays."""
        process = self._process
        if process is None:
            return
        try:
            with open(f"/proc/{process.pid}/task/{process.pid}/children") as f:
                children = [int(pid) for pid in f.read().split()]
        except OSError:
            return
        for pid in children:  # through a pidfd, checked to be the warden's still: never a reused number's
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                stat = _stat(pid)  # read after the pidfd was taken: the process it names
                if stat is not None and stat[0] == process.pid:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)

    def restart(self) -> None:
        with self._ending:  # a close() from another thread comes before or after, never between
            if self.closed:  # closed while a call waited: it stays closed
                raise ChildFailed(f"the {self.name} jail is closed")
            self._end()
            self.restarts += 1
            self._start()

    @property
    def alive(self) -> bool:
        process = self._process
        return not self.closed and process is not None and process.poll() is None

    def close(self) -> None:
        """The warden ended, with every process of its calls, for good: a later call fails. Once."""
        with self._ending:
            self.closed = True
            self._end()

    def _end(self) -> None:
        """The warden ended (it ends its running call and itself when its pipe closes), and with it
        every process of its calls; its folder and any cgroup of its calls removed. Called under
        `_ending` (restart, close)."""
        for fd in (self._requests, self._answers):
            if fd >= 0:
                os.close(fd)
        self._requests = self._answers = -1
        if self._process is not None:
            try:
                self._process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                pass
            end_session(self._process.pid)  # a warden killed from outside leaves its calls to its pdeath signal
            self._process.wait()
            sweep_cgroups(self._process.pid)
            self._process = None
        shutil.rmtree(self.folder, ignore_errors=True)


def jail_description(info: dict) -> str:
    """A jail's `info` for the log: "namespaces, own /proc, own network, no capabilities, Landlock ABI 7, budgets by
    cgroup v1" (or why it did not start: {"refused": why})."""
    if "refused" in info:
        return f"none: it could not start ({info['refused']}), so every call fails"
    parts = ["namespaces" if info.get("namespaces") else "no namespaces (refused here)"]
    parts += ["own /proc"] if info.get("own_proc") else []
    parts += ["own network"] if info.get("own_network") else []
    parts += ["no capabilities"] if info.get("capabilities_dropped") else ["capabilities kept"]
    abi = info.get("landlock_abi", 0)
    parts += [f"Landlock ABI {abi}" if abi else "no Landlock (no file rules)"]
    budgets = info.get("budgets", "watched")
    parts += [f"budgets by {budgets}" if budgets != "watched" else "budgets watched (no cgroup could be made)"]
    return ", ".join(parts)
