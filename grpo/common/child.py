"""A child process that serves JSON requests over a pipe with a time limit per call: how code we
cannot trust to return runs (environments).

A thread cannot do it: a catastrophic regular expression runs inside `re` without releasing the
GIL, so the caller itself would hang. The child is forked (it has every function and imported user
module the parent had), or with `clean` a new Python started by exec (grpo/common/child_boot.py: it holds
nothing of the parent's, and imports what it serves by name). Requests and answers cross the pipe as
JSON, never pickle. A call that does not answer in time, or a child that died, gets the child killed
and a fresh one started; the caller sees `ChildFailed`, which says where in the user's code an error was
raised (`raised_at`).

The child is a session of its own: a keeper process, which runs no served code, and under it the
server, which does, in a process group of its own. Every process the served code starts descends
from the keeper, even one that starts a session of its own (`start_new_session`, a pty) and whose
parent then exits: the keeper is a subreaper, and adopts it. A call that times out, a child that is
replaced or closed, a server that dies and a parent that dies (the keeper's parent-death signal)
each end the whole tree, SIGKILL to each of its processes (end_session): no process a tool started
outlives its child. The child sees only an allow-list of the parent's environment variables (PATH,
HOME, LANG, LC_*, the Python and library search paths, Hugging Face's cache and offline
switches, and the names the caller passes; not a proxy URL, which may hold a password), its own
temporary folder as TMPDIR (removed with it), PYTHONHASHSEED=0 (a Python a tool starts orders its
sets alike when an episode is rebuilt), and not the block of variables the parent was started with
(/proc/self/environ reads zeros).
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import multiprocessing
import os
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

from grpo.common.packages import CODE_PACKAGES, DATA_PACKAGE, package_folder

PR_SET_PDEATHSIG = 1
START_TIMEOUT_S = 60.0  # an environment importing OpenEnv starts in ~12 s on 2 quiet cores; in a full test run, 30+
NO_ANSWER = object()  # what a handler returns for a request that wants no answer
OUR_CODE = tuple(f"{package_folder(name)}{os.sep}" for name in (*CODE_PACKAGES, DATA_PACKAGE))
LIBRARIES = tuple({f"{sysconfig.get_paths()[kind]}{os.sep}" for kind in ("stdlib", "platstdlib", "purelib", "platlib")})
# what a child sees of the parent's environment (and every LC_* name); secrets such as API keys only by name
# (env.pass_env, rewards.pass_env)
PASSED_ENVIRONMENT = ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV",
                      "HF_HOME", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
SET_ENVIRONMENT = {"PYTHONHASHSEED": "0"}  # a Python started by a tool orders sets alike in a replay


def close_inherited_sockets(keep: int) -> None:
    """The sockets and pipes the parent had open at the fork (the sampler's connection to the
    trainer, an engine's, an OpenEnv server's, its pipes to a jail): closed, so that no code run here
    writes to them or reads what they carry. The standard streams stay."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            mode = os.fstat(fd).st_mode
            if fd != keep and fd > 2 and (stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode)):
                os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, already gone


def passed_environment(environ, names=()) -> dict[str, str]:
    """The variables of `environ` a child sees: PASSED_ENVIRONMENT, LC_* and `names`; no GPU unless
    CUDA_VISIBLE_DEVICES is among `names` (an empty CUDA_VISIBLE_DEVICES shows none)."""
    allowed = set(PASSED_ENVIRONMENT) | set(names)
    passed = {k: v for k, v in environ.items() if k in allowed or k.startswith("LC_")}
    return passed if "CUDA_VISIBLE_DEVICES" in names else {**passed, "CUDA_VISIBLE_DEVICES": ""}


def _replace_environment(environment: dict[str, str]) -> None:
    """os.environ, and the C library's environment a subprocess inherits (a library may have set
    variables there that os.environ does not show), becomes `environment`; the block this process
    was started with, which /proc/self/environ reads (a forked child has its parent's), is zeroed."""
    os.environ.clear()
    ctypes.CDLL(None).clearenv()
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # fields 3.. of proc(5): env_start and env_end are 50, 51
        start, end = int(fields[47]), int(fields[48])
        if 0 < start < end:
            ctypes.memset(start, 0, end - start)
    except (OSError, IndexError, ValueError):
        pass  # no /proc: nothing reads the block either
    os.environ.update(environment)
    tempfile.tempdir = None  # tempfile reads TMPDIR again


PR_SET_CHILD_SUBREAPER = 36  # the keeper adopts its descendants' orphans: none leaves its tree


class ChildFailed(RuntimeError):
    """The request raised in the child, did not answer in time, or the child died; `where`: the
    place in the user's code it raised (raised_at), when it did."""

    def __init__(self, message: str, where: str | None = None):
        super().__init__(message)
        self.where = where


class ChildRefused(RuntimeError):
    """The child's setup refused to serve (e.g. it could not be isolated); the message says why."""


def raised_at(error: BaseException, base: Path | None = None) -> str | None:
    """Where `error` was raised in the user's code, as 'file:line, in function': the last frame of
    its traceback outside our packages, preferring one outside the libraries too (the user's line
    that called json.loads, not json's). None when every frame is ours."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(OUR_CODE)]
    users = [f for f in frames if not f.filename.startswith(LIBRARIES + ("<",))]
    if not (users or frames):
        return None
    frame = (users or frames)[-1]
    path = Path(frame.filename)
    base = base or Path.cwd()  # paths are shown from here (a jailed call's working folder is its own: the owner's)
    shown = path.relative_to(base) if path.is_relative_to(base) else path
    return f"{shown}:{frame.lineno}, in {frame.name}"


def failure_text(error: BaseException) -> str:
    """What failed and, where known, where: "KeyError: 'solution' (my_rewards.py:7, in exact_match)"."""
    text = str(error) if isinstance(error, ChildFailed) else f"{type(error).__name__}: {error}"
    where = error.where if isinstance(error, ChildFailed) else raised_at(error)
    return f"{text} ({where})" if where else text


def _die_with_parent(sig: int) -> None:
    """`sig` to this process when the thread that forked it ends (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
    except (OSError, AttributeError):
        pass


def _end_session(*_) -> None:
    end_session(os.getpid())  # the keeper leads the session: every other process of it, then itself
    shutil.rmtree(os.environ["TMPDIR"], ignore_errors=True)  # the child's folder, also after a killed parent
    os._exit(0)


def _keep(server: int, parent: int) -> None:
    """The keeper: waits for the server; when it ends, or the parent dies (a parent-death SIGTERM,
    which the keeper, running no served code, always takes), it ends the whole session and removes
    the child's folder. Never returns."""
    signal.signal(signal.SIGTERM, _end_session)
    _die_with_parent(signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the signal was asked for
        _end_session()
    while True:  # the server, and the orphans it left that the keeper adopted (reaped: no zombies pile up)
        try:
            ended, _ = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if ended == server:
            break
    _end_session()


def _serve(conn, parent_end, setup: Callable, environment: dict[str, str], parent: int | None = None) -> None:
    """The child: `parent_end` None and `parent` the caller's pid where it was started by exec."""
    if parent_end is not None:
        parent_end.close()  # else this copy of the parent's end keeps the pipe open after the parent dies
    parent = os.getppid() if parent is None else parent
    os.setsid()  # a session of its own: the parent ends it, and everything in it (end_session)
    _replace_environment(environment)
    keeper = os.getpid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of the served code come here
    server = os.fork()
    if server:
        conn.close()  # the server's death must reach the parent as the pipe's end
        close_inherited_sockets(keep=-1)  # the sampler's connections are not held open by a copy here
        _keep(server, parent)
    _die_with_parent(signal.SIGKILL)  # a server busy in a hang dies with the keeper
    if os.getppid() != keeper:
        os._exit(0)
    os.setpgid(0, 0)  # a group of its own: kill(0) in the served code reaches it and its own, never the keeper
    try:
        _handle(conn, setup)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _handle(conn, setup: Callable) -> None:
    try:
        handler, info = setup(conn.fileno())
    except Exception as e:  # ChildRefused, or a setup that broke: the parent is told, not left waiting
        conn.send_bytes(json.dumps(["refused", str(e) if isinstance(e, ChildRefused)
                                    else f"{type(e).__name__}: {e}"]).encode())
        return
    conn.send_bytes(json.dumps(["ready", info]).encode())
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:  # the parent is gone, or closed the pipe
            getattr(handler, "close", lambda: None)()
            return
        try:
            answer = handler(request)
            if answer is NO_ANSWER:
                continue
            reply = ["ok", answer]
        except Exception as e:  # the served code's fault: reported, the child goes on
            reply = ["error", f"{type(e).__name__}: {e}", raised_at(e)]
        conn.send_bytes(json.dumps(reply).encode())


def session_members(session: int) -> list[int]:
    """The live processes of `session` (by /proc: its id is field 6 of a process's stat), and every
    descendant of its leader wherever it went (a process of it may start a session of its own; the
    leader, the keeper, adopts orphans as a subreaper), but this one."""
    stats = {int(name): st for name in os.listdir("/proc") if name.isdigit() and (st := _stat(int(name)))}
    own = os.getpid()
    return [pid for pid in stats if pid != own and _belongs(pid, session, stats)]


def _belongs(pid: int, session: int, stats: dict[int, tuple[int, int]]) -> bool:
    """Whether `pid` is in `session` or descends from a process that is (`stats`: pid -> (parent,
    session)). The leader counts by its session, not its number: one reused by another process
    after the keeper died leads no such session."""
    seen = set()
    while pid in stats and pid not in seen:
        parent, own_session = stats[pid]
        if own_session == session:
            return True
        seen.add(pid)
        pid = parent
    return False


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent, session) of live process `pid`; None when it is gone, or a zombie (which needs no signal)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state, parent, _, session = f.read().rsplit(")", 1)[1].split()[:4]
    except (OSError, ValueError):
        return None
    return None if state in "ZX" else (int(parent), int(session))


def end_session(session: int | None) -> None:
    """SIGKILL to every process of `session` (a child: its keeper, its server and all they started,
    whatever process group or session each is in), until none is left. Each is signalled through a
    pidfd taken before it is looked at again, so a number reused by another process is never
    signalled. The leader (the keeper) goes last: while it lives, the orphans of the others come to
    it, and stay found. Bounded: a process the kernel cannot kill (stuck in a device) is named in the log."""
    members: list[int] = []
    for attempt in range(END_ROUNDS):  # killed processes fork no more: a few rounds at most
        if attempt:
            time.sleep(0.01)  # a process SIGKILLed an instant ago may still be listed
        members = session_members(session) if session else []
        if not members:
            return
        others = [pid for pid in members if pid != session]
        for pid in others or members:
            try:
                fd = os.pidfd_open(pid)
            except OSError as e:  # gone; or a kernel before 5.3, without pidfds
                if e.errno == errno.ENOSYS and pid in session_members(session):
                    _kill(pid)
                continue
            try:
                stat = _stat(pid)
                if stat is not None and (stat[1] == session or stat[0] in members or stat[0] == session):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass  # gone meanwhile
            finally:
                os.close(fd)
    logging.getLogger(__name__).warning("processes %s of a child did not end after %d rounds of SIGKILL", members,
                                        END_ROUNDS)


END_ROUNDS = 1000  # of 10 ms: a process that outlives 10 s of SIGKILL is stuck in the kernel


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass  # gone


class _Started:
    """A started Python (subprocess.Popen) as the rest of Child uses a multiprocessing.Process."""

    def __init__(self, popen: subprocess.Popen):
        self.popen, self.pid = popen, popen.pid

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.popen.kill()  # nothing once reaped: its number is never another process's


class Child:
    """The parent's side. `setup(pipe_fd) -> (handler, info)` runs in the child after the fork:
    `handler(request) -> answer` serves each request (an optional `handler.close()` runs when the
    pipe closes), `info` is reported back as `self.info`; setup raises ChildRefused to refuse.
    `pass_env`: environment variables the child sees besides PATH, HOME, LANG, LC_* and TMPDIR.
    `clean`: the child is a new Python started by exec (`python -m grpo.common.child_boot`), which holds
    nothing of the caller's (no data, no model, no variable outside the allow-list); `setup` is then
    ("module:function", [JSON arguments]), called there as function(*arguments, pipe_fd)."""

    def __init__(self, name: str, setup, pass_env=(), clean: bool = False):
        self.name, self.setup, self.restarts, self.pass_env, self.clean = name, setup, 0, tuple(pass_env), clean
        self._context = multiprocessing.get_context("fork")
        self._session = None
        self._start()

    def _start(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix=f"grpo-{self.name}-")  # its TMPDIR, removed with it
        environment = {**passed_environment(os.environ, self.pass_env), **SET_ENVIRONMENT, "TMPDIR": self.tmp}
        self._conn, child = self._context.Pipe()
        try:
            self._process = _Started(self._exec(child, environment)) if self.clean else self._fork(child, environment)
        except OSError as e:  # no process could be made (out of memory or processes)
            self._conn.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise ChildRefused(f"the {self.name} process could not start: {e}") from None
        finally:
            child.close()
        self._session = self._process.pid  # the keeper leads the session
        if not self._conn.poll(START_TIMEOUT_S):
            self._stop(grace_s=0.0)
            raise ChildRefused(f"the {self.name} process did not start within {START_TIMEOUT_S:g} s")
        try:
            status, self.info = json.loads(self._conn.recv_bytes())
        except EOFError:
            self._stop(grace_s=0.0)
            raise ChildRefused(f"the {self.name} process died as it started") from None
        if status != "ready":
            self._stop(grace_s=0.0)
            raise ChildRefused(self.info)

    def _fork(self, child, environment: dict[str, str]):
        process = self._context.Process(target=_serve, args=(child, self._conn, self.setup, environment),
                                        daemon=True, name=self.name)
        process.start()
        return process

    def _exec(self, child, environment: dict[str, str]) -> subprocess.Popen:
        """A new Python serving `setup` on the pipe `child`: it is told what to serve over the pipe (the
        variables it gets may hold keys: never on its command line)."""
        function, arguments = self.setup
        # the caller's import path, in its order; the working folder never before it (Python >= 3.11)
        paths = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONSAFEPATH": "1"}
        process = subprocess.Popen([sys.executable, "-m", "grpo.common.child_boot", str(child.fileno()),
                                    str(os.getpid())], pass_fds=(child.fileno(),), env={**environment, **paths},
                                   stdin=subprocess.DEVNULL)
        self._conn.send_bytes(json.dumps({"setup": function, "arguments": arguments, "environment": environment,
                                          "name": self.name}).encode())
        return process

    def alive(self) -> bool:
        return self._process.is_alive()

    def restart(self) -> None:
        self._stop(grace_s=0.0)  # hung or dead: nothing to wait for
        self.restarts += 1
        self._start()

    def call(self, request, timeout_s: float, timeout_message: str):
        """The answer to `request` within `timeout_s`; ChildFailed otherwise (the child replaced
        where it hung or died; ChildRefused where the replacement cannot start)."""
        try:
            self._conn.send_bytes(json.dumps(request).encode())
        except OSError as e:  # a pipe to a child that just died
            self.restart()
            raise ChildFailed(f"the {self.name} process could not take the call ({e})") from None
        if not self._conn.poll(timeout_s):
            self.restart()
            raise ChildFailed(timeout_message)
        try:
            status, answer, *where = json.loads(self._conn.recv_bytes())
        except EOFError:
            self.restart()
            raise ChildFailed(f"the {self.name} process died") from None
        if status != "ok":
            raise ChildFailed(answer, *where)
        return answer

    def tell(self, request) -> None:
        """A request that wants no answer; lost with a child that is gone."""
        if self._process.is_alive():
            try:
                self._conn.send_bytes(json.dumps(request).encode())
            except OSError:
                pass

    def close(self, grace_s: float = 0.0) -> None:
        """Close the pipe (the child's handler closes what it holds, given `grace_s`), then end it."""
        self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
        """Its whole session ended (every process the served code started), its folder removed."""
        self._conn.close()
        if grace_s:
            self._process.join(timeout=grace_s)
        end_session(self._session)
        self._session = None  # once: the number may lead another session after the keeper is reaped
        self._process.kill()
        self._process.join()
        shutil.rmtree(self.tmp, ignore_errors=True)
