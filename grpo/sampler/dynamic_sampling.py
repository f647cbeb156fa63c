"""DAPO's dynamic sampling, as pure functions: keep the groups whose rewards differ.

A group whose G completions all score the same (of those scored: a sample no reward could be
asked about is left out) gets zero advantage: it costs a generation and a forward/backward and
moves nothing. With `sampling.dynamic_sampling` the sampler drops such groups and generates more prompts,
in rounds of `prompts_per_step`, until it has
`prompts_per_step` informative groups or has generated `dynamic_sampling_max_rounds` rounds;
then it fills up with the first dropped groups (zero advantage: the batch keeps its size) and
logs that the cap was hit.

Data positions stay a function of the global step g alone (so resuming and N samplers stay
exact): step g owns the stream positions [g * B * R, (g + 1) * B * R) with R the round cap, and
round r reads the r-th B of them. Positions a step did not need are skipped, not served later.
"""

from __future__ import annotations

import torch

ROUND_SEED_STRIDE = 1_000_000_007  # round r of a step samples with the step's seed + r * this


def has_spread(totals: torch.Tensor, group_size: int, scored: torch.Tensor | None = None) -> list[bool]:
    """Per group (prompt-major totals [N]): do the rewards of its scored completions (bool [N], None:
    all) differ? A group with fewer than two scored has no baseline, so no gradient."""
    scored = torch.ones_like(totals, dtype=torch.bool) if scored is None else scored  # [N]
    return [bool(g[s].numel() > 1 and g[s].max() != g[s].min())
            for g, s in zip(totals.split(group_size), scored.split(group_size))]


def choose_groups(spread_by_round: list[list[bool]], wanted: int) -> tuple[list[tuple[int, int]], bool]:
    """The (round, group) pairs to train on, in generation order, and whether there were too few
    informative ones (then the first uninformative groups fill the batch up to `wanted`)."""
    order = [(r, j) for r, spreads in enumerate(spread_by_round) for j in range(len(spreads))]
    informative = [(r, j) for r, j in order if spread_by_round[r][j]][:wanted]
    short = len(informative) < wanted
    if short:
        fill = [(r, j) for r, j in order if not spread_by_round[r][j]][:wanted - len(informative)]
        informative = sorted(informative + fill)
    return informative, short


def rounds_per_step(dynamic: bool, max_rounds: int) -> int:
    """Stream positions a step owns, in units of prompts_per_step."""
    return max_rounds if dynamic else 1


def round_start(step: int, round_index: int, prompts_per_step: int, rounds: int) -> int:
    """The stream position of the first prompt of `round_index` of global step `step`."""
    return (step * rounds + round_index) * prompts_per_step


def round_seed(step_seed: int, round_index: int) -> int:
    return step_seed + round_index * ROUND_SEED_STRIDE
