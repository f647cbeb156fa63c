"""The episodes' environments in a child process: a step that hangs or raises costs that step,
never the run.

Like the reward sandbox (rewards/sandbox.py) the child is forked and talks JSON over a pipe, never
pickle. It is cut off from the network at start (a network namespace of its own where the kernel
allows unprivileged ones, else Python's sockets refuse) and holds one environment per live
episode. A step that raises becomes an error message to the model; one that does not answer
within `env.timeout_s` gets the child killed and a new one forked. The parent sends every step
with the episode's earlier messages, so a new child rebuilds an episode it does not hold by
replaying them: the other episodes of the turn go on where they were.
"""

from __future__ import annotations

import ctypes
import json
import logging
import multiprocessing
import os
import signal
import socket

from grpo.environments import Reply, environment_factory

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000


def deny_network() -> str:
    """Cut this (single-threaded) process off the network; how ("namespace" or "sockets")."""
    libc = ctypes.CDLL(None, use_errno=True)
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:  # only a loopback that is down: nothing is reachable
        try:  # the same user inside, so files are created as before (unmapped, creating one fails)
            for name, value in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(value)
        except OSError:
            pass
        return "namespace"

    def refuse(*args, **kwargs):
        raise OSError("environments have no network")
    socket.socket = refuse  # noqa: the fallback where namespaces are not allowed: Python code only
    socket.create_connection = refuse
    return "sockets"


def _serve(conn, parent_end, name: str, args: dict) -> None:
    parent_end.close()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a child busy in a hang dies with its parent
    except (OSError, AttributeError):
        pass
    deny_network()
    make = environment_factory(name, args)
    episodes: dict[str, object] = {}
    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return
        if request[0] == "forget":
            for key in request[1]:
                episodes.pop(key, None)
            continue
        _, key, row, history, message = request
        try:
            if key not in episodes:  # a new episode, or one this (new) child rebuilds
                episodes[key] = make(row)
                for earlier in history:
                    episodes[key].step(earlier)
            reply = episodes[key].step(message)
            if not isinstance(reply, Reply):
                raise TypeError(f"step returned a {type(reply).__name__}, not a grpo.environments.Reply")
            answer = ["ok", reply.to_json()]
        except Exception as e:  # the environment's fault: reported, the episode goes on
            episodes.pop(key, None)  # rebuilt from its history at its next step
            answer = ["error", f"{type(e).__name__}: {e}"]
        conn.send_bytes(json.dumps(answer).encode())


class EnvironmentPool:
    """Steps episodes' environments (env.name, env.args) in a child with a time limit per step."""

    def __init__(self, name: str, args: dict, timeout_s: float):
        environment_factory(name, args)  # a bad env.name fails here, in the sampler, in one line
        self.name, self.args, self.timeout_s = name, dict(args), timeout_s
        self.restarts = 0
        self._context = multiprocessing.get_context("fork")
        self._start()

    def _start(self) -> None:
        self._conn, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child, self._conn, self.name, self.args),
                                              daemon=True, name="environments")
        self._process.start()
        child.close()

    def _restart(self) -> None:
        self.close()
        self.restarts += 1
        self._start()

    def step(self, key: str, row: dict, history: list[str], message: str) -> tuple[Reply, str | None]:
        """The environment's reply to `message` in episode `key` (its earlier messages: `history`);
        on a failure, (an error message for the model, the failure)."""
        if not self._process.is_alive():
            self._restart()
        self._conn.send_bytes(json.dumps(["step", key, row, history, message]).encode())
        if not self._conn.poll(self.timeout_s):
            self._restart()
            failure = f"no reply within env.timeout_s={self.timeout_s:g} s"
        else:
            try:
                status, value = json.loads(self._conn.recv_bytes())
            except EOFError:
                self._restart()
                status, value = "error", "the environment process died"
            if status == "ok":
                return Reply.from_json(value), None
            failure = value
        return Reply(text=f"error: the environment failed: {failure}"), failure

    def forget(self, keys: list[str]) -> None:
        """Drop finished episodes' environments."""
        if keys and self._process.is_alive():
            self._conn.send_bytes(json.dumps(["forget", keys]).encode())

    def close(self) -> None:
        self._conn.close()
        self._process.kill()
        self._process.join()
