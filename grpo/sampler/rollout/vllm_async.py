"""The vLLM engine's event loop and its counts: vLLM's async engine (`AsyncLLM`) lives on one asyncio
loop in a thread of its own, and the sampler's synchronous calls run coroutines there and wait for them.

One task per sequence (a completion, or an episode's messages one after another): vLLM's scheduler
refills a finished sequence's slot from the waiting ones, and an episode whose message ended hands it
to its environment on a thread of the environment lanes (grpo/environments/lanes.py) while the others
go on decoding. Importable without vLLM.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from typing import Any, Awaitable, Callable

# how long an interrupted call waits for its tasks to wind down: an environment call already running
# ends first (within env.timeout_s), vLLM aborts its requests at once
CANCEL_WAIT_S = 60.0


class EngineLoop:
    """An asyncio loop in a daemon thread; `run` waits for a coroutine there from any other thread."""

    def __init__(self, name: str = "vllm-engine-loop"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coroutine: Awaitable) -> Any:
        """The coroutine's result (or its error), run on the loop. Interrupted here (Ctrl-C), the
        coroutine is cancelled there and waited for: no request or environment call outlives the call
        that made it."""
        started, finished = threading.Event(), threading.Event()

        async def tracked():
            started.set()
            try:
                return await coroutine
            finally:
                finished.set()
        future = asyncio.run_coroutine_threadsafe(tracked(), self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            if started.is_set():  # cancelled before its first step, it never runs
                finished.wait(CANCEL_WAIT_S)
            raise

    def close(self) -> None:
        """The loop's tasks cancelled and finished (vLLM's output handler among them), then the loop stopped."""
        async def drain():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        self.run(drain())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


class StepCounts:
    """What the step's calls recorded for its metrics, taken once per step (`take`, as the HF engine's
    decode-row counts are)."""

    def __init__(self):
        self.metrics: dict[str, float] = {}

    def add(self, metrics: dict[str, float]) -> None:
        """A call's metrics: times add up over the step's calls (dynamic sampling's rounds), others are the last's."""
        for key, value in metrics.items():
            self.metrics[key] = self.metrics.get(key, 0.0) + value if key.startswith("timing/") else value

    def take(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics


class EnvironmentCalls:
    """Environment calls made from the loop on the lanes' threads, and what they cost the step: episodes
    waiting on their environment (averaged over the time the step generated) and the time vLLM had no
    sequence to decode while some waited. A cancelled episode waits for its call to end: none outlives
    a failed step."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.in_flight: set[Future] = set()
        self.requests = 0  # sequences in vLLM now
        self.waiting_s = 0.0  # summed over the calls
        self.idle_s = 0.0
        self.started = self._since = clock()

    async def call(self, executor, fn: Callable, *args) -> Any:
        future = executor.submit(fn, *args)
        self._tick()
        self.in_flight.add(future)
        t = self.clock()
        done = asyncio.wrap_future(future)
        try:
            return await asyncio.shield(done)
        except asyncio.CancelledError:
            future.cancel()  # not started: it never runs; started: it ends before its episode does
            await asyncio.wait([done])
            raise
        finally:
            self._tick()
            self.in_flight.discard(future)
            self.waiting_s += self.clock() - t

    def request(self, delta: int) -> None:
        """A sequence entered (1) or left (-1) vLLM."""
        self._tick()
        self.requests += delta

    def _tick(self) -> None:
        now = self.clock()
        if self.requests == 0 and self.in_flight:
            self.idle_s += now - self._since
        self._since = now

    def metrics(self) -> dict[str, float]:
        elapsed = max(self.clock() - self.started, 1e-9)
        return {"env/waiting_mean": self.waiting_s / elapsed, "timing/env_idle_s": self.idle_s}
