"""A forked child that serves JSON requests over a pipe with a time limit per call: how code we
cannot trust to return runs (reward functions, environments).

A thread cannot do it: a catastrophic regular expression runs inside `re` without releasing the
GIL, so the caller itself would hang. The child is forked, so it has every function and imported
user module the parent had (a test's too). Requests and answers cross the pipe as JSON, never
pickle. A call that does not answer in time, or a child that died, gets the child killed and a
fresh one forked; the caller sees `ChildFailed`, which says where in the user's code an error was
raised (`raised_at`). The child dies with its parent (Linux).
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import signal
import stat
import sysconfig
import traceback
from pathlib import Path
from typing import Callable

PR_SET_PDEATHSIG = 1
START_TIMEOUT_S = 30.0
NO_ANSWER = object()  # what a handler returns for a request that wants no answer
ROOT = Path(__file__).resolve().parents[1]
OUR_CODE = tuple(f"{ROOT / package}{os.sep}" for package in ("grpo", "rewards", "data"))
LIBRARIES = tuple({f"{sysconfig.get_paths()[kind]}{os.sep}" for kind in ("stdlib", "platstdlib", "purelib", "platlib")})


def close_inherited_sockets(keep: int) -> None:
    """The sockets the parent had open at the fork (the sampler's connection to the trainer, an
    engine's, an OpenEnv server's): closed, so that no code run here writes to them."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd != keep and stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)
        except OSError:
            pass  # the listing's own descriptor, already gone


class ChildFailed(RuntimeError):
    """The request raised in the child, did not answer in time, or the child died; `where`: the
    place in the user's code it raised (raised_at), when it did."""

    def __init__(self, message: str, where: str | None = None):
        super().__init__(message)
        self.where = where


class ChildRefused(RuntimeError):
    """The child's setup refused to serve (e.g. it could not be isolated); the message says why."""


def raised_at(error: BaseException) -> str | None:
    """Where `error` was raised in the user's code, as 'file:line, in function': the last frame of
    its traceback outside our packages, preferring one outside the libraries too (the user's line
    that called json.loads, not json's). None when every frame is ours."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(OUR_CODE)]
    users = [f for f in frames if not f.filename.startswith(LIBRARIES + ("<",))]
    if not (users or frames):
        return None
    frame = (users or frames)[-1]
    path = Path(frame.filename)
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    return f"{shown}:{frame.lineno}, in {frame.name}"


def failure_text(error: BaseException) -> str:
    """What failed and, where known, where: "KeyError: 'solution' (my_rewards.py:7, in exact_match)"."""
    text = str(error) if isinstance(error, ChildFailed) else f"{type(error).__name__}: {error}"
    where = error.where if isinstance(error, ChildFailed) else raised_at(error)
    return f"{text} ({where})" if where else text


def _serve(conn, parent_end, setup: Callable) -> None:
    parent_end.close()  # else this copy of the parent's end keeps the pipe open after the parent dies
    try:  # a child busy in a hang dies with its parent too
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    try:
        handler, info = setup(conn.fileno())
    except Exception as e:  # ChildRefused, or a setup that broke: the parent is told, not left waiting
        conn.send_bytes(json.dumps(["refused", str(e) if isinstance(e, ChildRefused) else f"{type(e).__name__}: {e}"]).encode())
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


class Child:
    """The parent's side. `setup(pipe_fd) -> (handler, info)` runs in the child after the fork:
    `handler(request) -> answer` serves each request (an optional `handler.close()` runs when the
    pipe closes), `info` is reported back as `self.info`; setup raises ChildRefused to refuse."""

    def __init__(self, name: str, setup: Callable):
        self.name, self.setup, self.restarts = name, setup, 0
        self._context = multiprocessing.get_context("fork")
        self._start()

    def _start(self) -> None:
        self._conn, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child, self._conn, self.setup), daemon=True,
                                              name=self.name)
        self._process.start()
        child.close()
        if not self._conn.poll(START_TIMEOUT_S):
            self._stop(grace_s=0.0)
            raise ChildRefused(f"the {self.name} process did not start within {START_TIMEOUT_S:g} s")
        status, self.info = json.loads(self._conn.recv_bytes())
        if status != "ready":
            self._process.join()
            raise ChildRefused(self.info)

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
        self._conn.close()
        if grace_s:
            self._process.join(timeout=grace_s)
        self._process.kill()
        self._process.join()
