"""The staleness rule, in one place: global step g may be generated with weights v >= g - s
(s = sampling.max_staleness). The sampler waits for such a version, and the trainer refuses a
batch whose version is further behind the policy it is about to update (docs/architecture.md)."""

from __future__ import annotations


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
