"""Environment calls of different episodes at once: several pools of one environment (each a child
process of its own, grpo/environments/pool.py, or a client of a served environment's sessions,
grpo/environments/remote.py), each taking one call at a time.

An episode always goes to the same lane (its index in the step, modulo the lanes; lane 0 for all of a
caller that makes its calls one at a time anyway), which holds its environment; a call waits only
for its own lane. Lanes after the first are started when first used, so a step of fewer episodes
than env.concurrency starts no more children than it has episodes. The calls run on the lanes' own
threads (`executor`), which live as long as the lanes: a child process started from one of them
(a lane's first, or a replacement after a hang) is tied to that thread's life.
A rebuild's counts (restarts, rebuilt episodes, replayed steps) are read around the call inside its
lane's lock, so they are the episode's own however many calls run at once.
"""

from __future__ import annotations

import logging
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

log = logging.getLogger(__name__)


def rebuild_counts(pool) -> tuple[int, int, int]:
    """A pool's restarts of its child (none for an OpenEnv server's sessions), rebuilt episodes and replayed
    steps, over its life."""
    return tuple(getattr(pool, name, 0) for name in ("restarts", "rebuilds", "replayed_steps"))


def lane_of(key: str, count: int) -> int:
    """The lane of episode `key` ("run/episode": the episode's index modulo `count`; else a hash of the key)."""
    tail = key.rsplit("/", 1)[-1]
    return (int(tail) if tail.isdigit() else zlib.crc32(key.encode())) % count


class Lanes:
    """`count` pools made by `make(first)` (first: the one made at start, which says how the environments
    run), each used by one call at a time."""

    def __init__(self, make: Callable[[bool], object], count: int):
        if count < 1:
            raise ValueError(f"environment lanes must be at least 1; got {count}")
        self._make = make
        self._pools: list = [make(True)] + [None] * (count - 1)  # a bad environment fails the start, once
        self._locks = [threading.Lock() for _ in range(count)]
        self._lanes: dict[str, int] = {}  # each live episode's lane, from its first call until it is forgotten
        self._executor: ThreadPoolExecutor | None = None

    @classmethod
    def of(cls, pool) -> "Lanes":
        """One lane holding `pool` (calls one at a time)."""
        return cls(lambda first: pool, 1)

    @property
    def count(self) -> int:
        return len(self._pools)

    @property
    def first(self):
        """The pool made at start."""
        return self._pools[0]

    @property
    def executor(self) -> ThreadPoolExecutor:
        """Threads for the calls, one per lane, for the lanes' whole life."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.count, thread_name_prefix="environment")
        return self._executor

    def call(self, key: str, method: str, *args, counted: Callable[[tuple[int, int, int]], None] | None = None,
             in_turn: bool = False):
        """`pool.method(key, *args)` on episode `key`'s lane (lane 0 with `in_turn`, for a caller whose calls
        come one at a time: no other lane is started for it); `counted(what rebuilding cost during the
        call)` (rebuild_counts' difference), also where the call raises."""
        lane = self._lanes.setdefault(key, 0 if in_turn else lane_of(key, self.count))
        with self._locks[lane]:
            if self._pools[lane] is None:
                self._pools[lane] = self._make(False)
            pool = self._pools[lane]
            before = rebuild_counts(pool)
            try:
                return getattr(pool, method)(key, *args)
            finally:
                if counted is not None:
                    counted(tuple(a - b for a, b in zip(rebuild_counts(pool), before)))

    def forget(self, keys: list[str]) -> None:
        """Drop finished episodes' environments, each lane's at once."""
        lanes = {key: self._lanes.pop(key) for key in keys if key in self._lanes}
        for lane, pool in enumerate(self._pools):
            mine = [key for key in keys if lanes.get(key) == lane]
            if pool is not None and mine:
                with self._locks[lane]:
                    pool.forget(mine)

    def _total(self, name: str) -> int:
        return sum(getattr(pool, name, 0) for pool in self._pools if pool is not None)

    @property
    def restarts(self) -> int:
        return self._total("restarts")

    @property
    def rebuilds(self) -> int:
        return self._total("rebuilds")

    @property
    def replayed_steps(self) -> int:
        return self._total("replayed_steps")

    def close(self) -> None:
        """The threads (their calls done or cancelled), then every pool, each closed whatever the others did."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
        errors = []
        for pool in self._pools:
            if pool is not None:
                try:
                    pool.close()
                except Exception as e:  # the others still close
                    errors.append(e)
        if errors:
            raise errors[0]
