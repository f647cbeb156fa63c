"""The staleness rule, in one place: global step g may be generated with weights v >= g - s
(s = sampling.max_staleness). The sampler waits for such a version (`wait_for_version`), and the
trainer refuses a batch whose version is further behind the policy it is about to update
(docs/architecture.md)."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


def oldest_version(step: int, max_staleness: int) -> int:
    """The oldest weights version global step `step` may be generated with (below 0: any)."""
    return step - max_staleness


def required_version(step: int, max_staleness: int, publish_every: int) -> int:
    """The version the sampler waits for before step `step`: `oldest_version` rounded up to one
    that will be published (every `publish_every` steps). Version v is the policy after v optimizer
    steps; it is published before step `step` is trained as long as max_staleness >=
    publish_every - 1 (the config refuses less)."""
    needed = max(0, oldest_version(step, max_staleness))
    return -(-needed // publish_every) * publish_every


def too_stale(batch_version: int, trainer_version: int, max_staleness: int) -> bool:
    """Whether a batch made with `batch_version` is too old for the trainer at `trainer_version`."""
    return batch_version < oldest_version(trainer_version, max_staleness)


class StalenessTimeout(TimeoutError):
    """The trainer did not publish the weights the next step needs in time."""


def wait_for_version(watcher, needed: int, timeout_s: float, poll_s: float = 0.2, on_poll=None,
                     prefer: int | None = None) -> None:
    """Poll the weights folder, loading new versions, until `watcher.version >= needed`;
    `on_poll()` runs at each poll (the sampler re-sends spooled batches to a restarted trainer).
    `prefer` (>= needed): a version to load rather than a newer LATEST (the next evaluation mark,
    so that eval.every=1 evaluates every version)."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        if on_poll is not None:
            on_poll()
        watcher.poll(prefer)
        if watcher.version >= needed:
            return
        if not announced:
            log.info("waiting for weights v%d (have v%d)", needed, watcher.version)
            announced = True
        if time.monotonic() > deadline:
            raise StalenessTimeout(
                f"no weights v{needed} in {watcher.root} after {timeout_s:g} s (have v{watcher.version}); "
                "is training_worker.py running and publishing? (sampling.wait_timeout_s)")
        time.sleep(poll_s)
