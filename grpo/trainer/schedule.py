"""The learning rate as a pure function of the updates made so far.

The schedule counts training steps whose update was applied: a step skipped for a non-finite
loss or gradient does not advance it, so a run that skipped k steps decays as if they had not
happened. The count lives in the trainer's checkpointed state, so a resumed run continues the
curve exactly. Warm-up is linear from peak / warmup_steps; the decay runs from the end of the
warm-up to `total` updates and ends at `min_ratio * peak`.
"""

from __future__ import annotations

import math

from grpo.settings.choices import SCHEDULES


def learning_rate_at(updates: int, peak: float, schedule: str = "constant", warmup_steps: int = 0,
                     total: int = 1, min_ratio: float = 0.0) -> float:
    """The learning rate of the update that follows `updates` applied ones."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
    if updates < warmup_steps:
        return peak * (updates + 1) / warmup_steps
    if schedule == "constant":
        return peak
    progress = min(1.0, (updates - warmup_steps) / max(1, total - warmup_steps))
    remaining = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (min_ratio + (1.0 - min_ratio) * remaining)
