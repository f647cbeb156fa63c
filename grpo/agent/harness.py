"""Your agent loop, started once per session: agent.entrypoint's function called with (row, base_url, api_key).

Each harness runs on a thread of its own (an async function in an event loop of its own there), so one that
blocks, or stops its loop, holds up no other. What it returns is the session's reward: a finite number, or None
(the reward then comes from POST /reward, or from rewards.names on its last message). A harness past its
session's time is cancelled where it can be (an async one: its task is cancelled; agent.command's process is
killed: grpo/agent/command.py); a sync one cannot be stopped from outside its thread: its session is closed (every
later call it makes is refused) and the thread is left to return.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import threading
from concurrent.futures import Future


class HarnessError(Exception):
    """The harness raised, or returned what is not a reward."""


class Harness(Future):
    """One harness's run: a Future of its reward; `cancel()` also cancels an async harness's task."""

    def __init__(self):
        super().__init__()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._stop = None  # what ends a harness that runs elsewhere (agent.command's process)

    def cancel(self) -> bool:
        if self._stop is not None:
            self._stop()
        loop, task = self._loop, self._task
        if loop is not None and task is not None:
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # its loop closed meanwhile: it returned
                pass
        return super().cancel()


class Harnesses:
    def __init__(self, fn):
        self.fn = fn

    def start(self, row: dict, base_url: str, api_key: str) -> Harness:
        """The harness of one session, started on a thread of its own with a copy of the row of its own (a harness
        that changes it changes no other's, nor the rewards'): its reward's Future (a float, or None; HarnessError
        when it raised or returned something else)."""
        harness = Harness()
        harness.set_running_or_notify_cancel()
        row = copy.deepcopy(row)
        if hasattr(self.fn, "stop"):
            harness._stop = lambda: self.fn.stop(api_key)

        def call():
            try:
                value = self.fn(row, base_url, api_key)
                if inspect.isawaitable(value):  # an async function (or a sync one that hands back a coroutine)
                    value = self._awaited(harness, value)
                result = reward_of(value)
            except BaseException as e:  # SystemExit and KeyboardInterrupt too: handed to the session, never lost
                if not harness.done():
                    harness.set_exception(e if isinstance(e, HarnessError) else _raised(e))
                return
            if not harness.done():
                harness.set_result(result)

        threading.Thread(target=call, name="agent-harness", daemon=True).start()
        return harness

    @staticmethod
    def _awaited(harness: Harness, awaitable):
        loop = asyncio.new_event_loop()
        try:
            harness._task = loop.create_task(_awaited(awaitable))
            harness._loop = loop
            if harness.cancelled():
                harness._task.cancel()
            return loop.run_until_complete(harness._task)
        finally:
            harness._loop = None
            loop.close()


async def _awaited(value):
    return await value


def _raised(e: BaseException) -> HarnessError:
    if isinstance(e, asyncio.CancelledError):
        return HarnessError("the agent was cancelled at agent.session_timeout_s")
    return HarnessError(f"the agent raised {type(e).__name__}: {e}")


def reward_of(value) -> float | None:
    """A harness's return value as its session's reward: None, or a finite number (not a bool, whose meaning as a
    reward would be a guess)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise HarnessError(f"the agent returned {value!r}: return a finite number (its reward) or None")
    return float(value)
