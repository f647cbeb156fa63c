"""The asyncio tasks around the vLLM engine's requests (grpo/sampler/rollout/vllm_engine.py): the poller
that loads newly published weights while a sampled call decodes (`InFlightPoller`, in-flight updates)
and the seed of a request made again from its tokens so far (`resumed_seed`); tasks cancelled and waited
for (`cancelled`), and coroutines run at once that stop together (`all_of`). Importable without vLLM.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from grpo.sampler.rollout.sequences import hashed_seed

IN_FLIGHT_POLL_S = 0.1  # how often a sampled call looks for a new version (in-flight updates): a decode step or two


def resumed_seed(seed: int, position: int) -> int:
    """The seed of a sequence seeded `seed` made again from its first `position` tokens (in-flight updates)."""
    return hashed_seed(f"{seed}/resumed-at{position}")


class InFlightPoller:
    """While a sampled call decodes, `poll` (the watcher's: it loads a newly published version, True when it
    did) every IN_FLIGHT_POLL_S on a thread; `stop` waits for a poll under way and says how many loaded."""

    def __init__(self, poll: Callable[[], bool]):
        self.poll, self.loads = poll, 0
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self, on_error: Callable[[], object]) -> None:
        """Polls from now on; `on_error()` when a poll raises (`stop` raises its error)."""
        self._task = asyncio.ensure_future(self._run())
        self._task.add_done_callback(lambda task: task.cancelled() or task.exception() is None or on_error())

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), IN_FLIGHT_POLL_S)
                return
            except TimeoutError:
                pass
            self.loads += bool(await asyncio.to_thread(self.poll))  # loads run there: they call into this loop

    async def stop(self) -> int:
        self._stop.set()
        await asyncio.shield(self._task)  # a load under way ends first: none lands after its call
        return self.loads


async def cancelled(tasks: list) -> None:
    """The tasks cancelled and finished (a cancelled request is aborted in vLLM)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def all_of(coroutines: list) -> None:
    """Every coroutine run at once; the first to raise cancels the others (and waits for them) and raises."""
    tasks = [asyncio.ensure_future(make()) for make in coroutines]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        await cancelled(tasks)
        raise
