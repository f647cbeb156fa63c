"""DAPO's soft overlong punishment: a length penalty over the last `buffer` tokens before the limit.

With limit L = sampling.max_new_tokens and buffer B, a completion of n tokens gets 0 while
n <= L - B, then falls linearly to -factor at n = L (the longest a completion can be here, so
DAPO's "-1 past L" is the value at L). As in veRL's `overlong_buffer`: penalty = min(0,
-(n - (L - B)) / B * factor).
"""

from __future__ import annotations

NAME = "overlong_penalty"  # its column among the batch's rewards


def overlong_penalty(length: int, max_new_tokens: int, buffer: int, factor: float = 1.0) -> float:
    if buffer <= 0:
        return 0.0
    excess = length - (max_new_tokens - buffer)
    return min(0.0, -excess / buffer * factor)


def reward_columns(names, weights, buffer: int) -> tuple[list[str], list[float]]:
    """A batch's reward columns and their weights: the configured rewards (rewards.names and
    rewards.weights), then this penalty with weight 1 when it is on (rewards.overlong_buffer > 0)."""
    return [*names, *([NAME] if buffer > 0 else [])], [*map(float, weights), *([1.0] if buffer > 0 else [])]
