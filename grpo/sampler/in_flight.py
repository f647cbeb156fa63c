"""New weights while a step decodes (sampling.in_flight_updates): what the engine calls between two decode steps
(HF) or every 0.1 s (vLLM) to load a newly published version.

On an engine that samples with the scoring model itself (HF), the new version is verified (a sha256 of every
file) and read on a thread of its own while the rows go on decoding; the decode loop only copies it in, at the
first poll after it is ready. vLLM's copies are staged where they are polled, as between steps."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

from grpo.weights.folder import Prepared

if TYPE_CHECKING:
    from grpo.sampler.batches import SamplerModels
    from grpo.settings import SamplingConfig

log = logging.getLogger(__name__)

LATEST_READ_S = 0.05  # LATEST is read at most this often: a decode step is ~10 ms on a GPU, and each read is a
# metadata round trip on a shared filesystem


def in_flight_poll(sampling: SamplingConfig, policy: SamplerModels, watcher,
                   evaluator=None) -> Callable[[], bool] | None:
    """The engine's poll (True when it loaded a version): single completions, and episodes or agent sessions on an
    engine whose episode loop records each token's version (the HF engine's), without dynamic sampling; None
    otherwise (new weights load between steps). With an `evaluator`, its next eval.every mark is loaded on the
    way (not jumped over) and held until the step ends, where it is evaluated."""
    if not sampling.in_flight_updates:
        return None
    # vLLM runs episodes in a loop of its own, which does not move a conversation to a new adapter
    episodes_between = policy.episodes is not None and hasattr(policy.engine, "run_episodes")
    if episodes_between or sampling.dynamic_sampling:
        log.info("sampling.in_flight_updates: new weights load between steps with %s",
                 f"episodes on {sampling.engine}" if episodes_between else "dynamic sampling")
        return None
    return InFlightLoads(watcher, evaluator, background=policy.engine.generates_with_scoring_model)


def settle_in_flight(engine) -> None:
    """Between steps: a version still being read in flight is waited for and served (or dropped), so that the
    step's own wait for weights never reads the same version a second time beside it."""
    settle = getattr(getattr(engine, "poll_weights", None), "settle", None)
    if settle is not None:
        settle()


class InFlightLoads:
    """Called between decode steps: True when a new version was loaded (is served from the next step on)."""

    def __init__(self, watcher, evaluator=None, background: bool = True):
        self.watcher, self.evaluator, self.background = watcher, evaluator, background
        self.next_read = 0.0
        self.pending: threading.Thread | None = None  # preparing a version, for the version served when it began
        self.prepared: Prepared | object | None = None
        self.base = None  # the watcher's commits when the preparation began: another load since makes it stale
        self.nothing_at = None  # a LATEST whose preparation gave nothing to serve (refused): tried between steps

    def __call__(self) -> bool:
        if self.pending is not None:
            return self._take_prepared()
        now = time.monotonic()
        if now < self.next_read:
            return False
        self.next_read = now + LATEST_READ_S
        latest = self.watcher.latest()
        if latest is None or latest <= self.watcher.version or latest == self.nothing_at:  # a step back (a trainer
            return False  # restarted) loads between steps
        mark = self.evaluator.next_mark if self.evaluator is not None else None
        if mark is not None and self.watcher.version >= mark:  # the mark is served: evaluated once the step ends
            return False
        if not self.background:
            result = self.watcher.poll(prefer=mark)
            return result is not None and result.loaded
        self.base, self.prepared, self.nothing_at = self.watcher.commits, None, None
        self.pending = threading.Thread(target=self._prepare, args=(mark, latest), name="weights-in-flight",
                                        daemon=True)
        self.pending.start()
        return False

    def settle(self) -> None:
        if self.pending is not None:
            self.pending.join()
            self._take_prepared()

    def _prepare(self, mark: int | None, latest: int) -> None:
        try:
            self.prepared = self.watcher.prepare(prefer=mark)
        except BaseException as e:  # raised on the decode thread, where a synchronous load would have
            self.prepared = e
        if not isinstance(self.prepared, (Prepared, BaseException)):
            self.nothing_at = latest

    def _take_prepared(self) -> bool:
        if self.pending.is_alive():
            return False
        self.pending, prepared = None, self.prepared
        self.prepared = None
        if isinstance(prepared, BaseException):
            raise prepared
        if not isinstance(prepared, Prepared):  # nothing new, or refused (logged, counted)
            return False
        if self.watcher.commits != self.base or prepared.version <= self.watcher.version:  # loaded between steps
            prepared.discard()  # meanwhile, or LATEST moved back as it was read: not in flight
            return False
        return self.watcher.commit(prepared).loaded
