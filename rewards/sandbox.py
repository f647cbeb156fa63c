"""Reward functions in a child process, so that one that hangs on a sample can be stopped.

A thread cannot do it: a catastrophic regular expression runs inside `re` without releasing
the GIL, so the sampler itself would hang. The child is forked, so it has every function in
`REWARD_FUNCTIONS` and every imported user module as the parent had them (a test's too);
requests and answers cross the pipe as JSON, never pickle (a row must be JSON: the data loader
keeps only JSON values). On a timeout the child is killed and a fresh one forked for the next
call; a batched reward gets `rewards.timeout_s` per completion.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import signal

from rewards.registry import get_reward


PR_SET_PDEATHSIG = 1


class RewardFailed(RuntimeError):
    """The function raised in the child, or did not answer within the timeout."""


def _serve(conn, parent_end) -> None:
    parent_end.close()  # else this copy of the parent's end keeps the pipe open after the parent dies
    try:  # and a child busy in a hang dies with its parent too (Linux)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    while True:
        try:
            name, completion, row = json.loads(conn.recv_bytes())
        except EOFError:
            return  # the parent is gone
        try:
            value = get_reward(name)(completion, row)  # a list for a batched reward
            reply = ["ok", [_number(v) for v in value] if isinstance(completion, list) else _number(value)]
        except Exception as e:  # reported to the parent, which logs and counts it
            reply = ["error", f"{type(e).__name__}: {e}"]
        conn.send_bytes(json.dumps(reply).encode())


def _number(value) -> float | None:
    return None if value is None else float(value)


class RewardSandbox:
    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._context = multiprocessing.get_context("fork")
        self._start()

    def _start(self) -> None:
        self._conn, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child, self._conn), daemon=True, name="rewards")
        self._process.start()
        child.close()

    def _restart(self) -> None:
        self.close()
        self._start()

    def __call__(self, name: str, completion: str | list[str], row: dict | list[dict]):
        """One sample's reward, or a batched reward's list (completion and row are then lists)."""
        if not self._process.is_alive():  # killed from outside, or crashed in C
            self._restart()
        self._conn.send_bytes(json.dumps([name, completion, row]).encode())
        limit = self.timeout_s * (len(completion) if isinstance(completion, list) else 1)
        if not self._conn.poll(limit):
            self._restart()
            raise RewardFailed(f"no answer within rewards.timeout_s={self.timeout_s:g} s"
                               + (" per completion" if isinstance(completion, list) else ""))
        try:
            status, value = json.loads(self._conn.recv_bytes())
        except EOFError:
            self._restart()
            raise RewardFailed("the reward process died") from None
        if status != "ok":
            raise RewardFailed(value)
        return value

    def close(self) -> None:
        self._conn.close()
        self._process.kill()
        self._process.join()
