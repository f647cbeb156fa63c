"""The staleness rule, in one place: global step g may be generated with weights v >= g - s
(s = sampling.max_staleness). The sampler waits for such a version (`wait_for_version`), and the
trainer refuses a batch whose version is further behind the policy it is about to update
(docs/architecture.md)."""

from __future__ import annotations

import logging
import time

import torch

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


def token_staleness(trainer_version: int, token_versions: list[torch.Tensor]) -> dict[str, float]:
    """How old each model token's weights are when its batch is trained (`trainer_version` - the version that
    sampled it; environment tokens, version -1, have none): the mean and the largest over the batch's model
    tokens, and the share of completions whose model tokens span more than one version."""
    model = [v[v >= 0] for v in token_versions]
    ages = trainer_version - torch.cat(model).double()
    spanning = sum(len(v) > 0 and bool(v.min() != v.max()) for v in model)
    return {"staleness/token_mean": float(ages.mean()) if ages.numel() else 0.0,
            "staleness/token_max": float(ages.max()) if ages.numel() else 0.0,
            "staleness/multi_version_fraction": spanning / max(len(model), 1)}


class StalenessTimeout(TimeoutError):
    """The trainer did not publish the weights the next step needs in time."""


def wait_for_version(watcher, needed: int, timeout_s: float, poll_s: float = 0.2, on_poll=None,
                     prefer: int | None = None) -> None:
    """Poll the weights folder, loading new versions, until `watcher.version >= needed`;
    `on_poll()` runs at each poll (the sampler re-sends spooled batches to a restarted trainer).
    `prefer` (>= needed): a version to load rather than a newer LATEST (the next evaluation mark,
    so that eval.every=1 evaluates every version)."""
    if prefer is not None and watcher.version == prefer and watcher.version >= needed:
        return  # the mark, loaded while the step before decoded: served until it is evaluated
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
