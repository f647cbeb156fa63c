"""Advantages from the rewards, over the samples that were scored (training.advantage): GRPO's group
mean and std (GRPO paper eq. 3, with the Dr. GRPO / batch-std variants), RLOO's leave-one-out mean,
REINFORCE++'s group mean with the batch's std, or a user's function. Under every one a sample no
reward could be asked about is left out of its group's statistics and gets advantage 0 (no gradient
from a score nobody gave it); one a reward failed on scores the batch's worst first
(`worst_of_batch`), so that failing never pays."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from grpo.settings.choices import ADVANTAGE_ESTIMATORS, name_or_import_path_problem
from grpo.settings.choices import ADVANTAGE_SCALES as SCALES


def expand_group_sizes(group_sizes: int | Sequence[int], total: int) -> list[int]:
    """`group_sizes` as an explicit list that sums to `total` (an int means equal groups)."""
    if isinstance(group_sizes, int):
        if group_sizes < 1 or total % group_sizes:
            raise ValueError(f"{total} rewards cannot be split into groups of {group_sizes}")
        return [group_sizes] * (total // group_sizes)
    sizes = [int(g) for g in group_sizes]
    if any(g < 1 for g in sizes) or sum(sizes) != total:
        raise ValueError(f"group sizes {sizes} must be >= 1 and sum to the number of rewards ({total})")
    return sizes


def group_advantages(rewards: torch.Tensor, group_sizes: int | Sequence[int], *, scale: str = "group",
                     eps: float = 1e-4, scored: torch.Tensor | None = None) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std + eps); prompt-major rewards float[N] -> float[N].

    scored: bool[N], the samples whose rewards count (None: all). The mean and std of a group, and
    the batch std, are over its scored samples only; an unscored sample gets exactly 0.
    scale: "group" divides by the group's std, "batch" by the whole batch's std (more robust
    when a group has tiny variance), "none" only centres (Dr. GRPO). std is unbiased. A group
    whose scored rewards are all equal (including one with a single scored sample, or none) gets
    exactly 0.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}; got {scale!r}")
    rewards, sizes, scored, group = _groups(rewards, group_sizes, scored)
    centred = rewards - _group_mean(rewards, scored, group, len(sizes))[group]  # [N]
    centred = torch.where(scored & _has_spread(rewards, scored, group, len(sizes))[group], centred, 0.0)  # [N]
    if scale == "group":
        return centred / (_group_std(centred, scored, group, len(sizes))[group] + eps)  # [N]
    if scale == "batch":
        return centred / (_std(rewards[scored]) + eps)  # [N]
    return centred  # [N]


def rloo_advantages(rewards: torch.Tensor, group_sizes: int | Sequence[int], *,
                    scored: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other scored rewards of its group
    = n / (n - 1) * (r_i - mean(group)) over the group's n scored samples; float[N] -> float[N].
    A group with fewer than two scored samples, or whose scored rewards are all equal, gets exactly 0."""
    rewards, sizes, scored, group = _groups(rewards, group_sizes, scored)
    count = torch.zeros(len(sizes)).index_add_(0, group, scored.float())  # [B]
    centred = rewards - _group_mean(rewards, scored, group, len(sizes))[group]  # [N]
    loo = centred * (count / (count - 1).clamp(min=1))[group]  # [N]
    return torch.where(scored & _has_spread(rewards, scored, group, len(sizes))[group], loo, 0.0)  # [N]


def reinforce_pp_advantages(rewards: torch.Tensor, group_sizes: int | Sequence[int], *, eps: float = 1e-4,
                            scored: torch.Tensor | None = None) -> torch.Tensor:
    """REINFORCE++ with the group baseline (Hu et al. 2025): each reward less its group's mean, then divided by
    the std of those centred values over the whole batch's scored samples (their batch mean is 0: each group's
    centred values sum to 0). float[N] -> float[N]; unscored samples and groups without spread get exactly 0."""
    centred = group_advantages(rewards, group_sizes, scale="none", scored=scored)  # [N]
    kept = _groups(rewards, group_sizes, scored)[2]  # [N]
    return centred / (_std(centred[kept]) + eps)  # [N]


def dr_grpo_advantages(rewards: torch.Tensor, group_sizes: int | Sequence[int], *,
                       scored: torch.Tensor | None = None) -> torch.Tensor:
    """Dr. GRPO (Liu et al. 2025): each reward less its group's mean, not divided by any std."""
    return group_advantages(rewards, group_sizes, scale="none", scored=scored)  # [N]


ESTIMATORS: dict[str, Callable] = {"rloo": rloo_advantages, "reinforce_pp": reinforce_pp_advantages,
                                   "dr_grpo": dr_grpo_advantages}  # and "grpo": group_advantages with its scale


def estimate_advantages(estimator: str, rewards: torch.Tensor, group_sizes: int | Sequence[int], *,
                        scale: str = "group", scored: torch.Tensor | None = None) -> torch.Tensor:
    """The advantages of training.advantage=`estimator` (grpo with training.advantage_scale=`scale`),
    float[N] -> float[N]. A user's estimator by import path is called as fn(rewards float32[N], group sizes
    list[int], scored bool[N]) and must return N finite numbers; its unscored samples get exactly 0."""
    if estimator == "grpo":
        return group_advantages(rewards, group_sizes, scale=scale, scored=scored)
    if estimator in ESTIMATORS:
        return ESTIMATORS[estimator](rewards, group_sizes, scored=scored)
    problem = name_or_import_path_problem("training.advantage", estimator, ADVANTAGE_ESTIMATORS)
    if problem:
        raise ValueError(problem)
    from grpo.common.imports import import_object

    rewards, sizes, kept, _ = _groups(rewards, group_sizes, scored)
    found = import_object(estimator, "training.advantage")(rewards.clone(), list(sizes), kept.clone())
    found = torch.as_tensor(found).detach().to("cpu", torch.float32).reshape(-1) if found is not None \
        else torch.empty(0)
    if found.numel() != rewards.numel() or not bool(torch.isfinite(found).all()):
        raise ValueError(f"training.advantage={estimator} returned {found.numel()} values "
                         f"({'all finite' if bool(torch.isfinite(found).all()) else 'not all finite'}) for "
                         f"{rewards.numel()} samples; it must return one finite advantage per sample")
    return torch.where(kept, found, 0.0)  # [N]


def _groups(rewards: torch.Tensor, group_sizes: int | Sequence[int], scored: torch.Tensor | None):
    """(rewards float32[N], the group sizes as a list, scored bool[N] (all when None), each sample's group int[N])."""
    rewards = rewards.to(torch.float32)  # [N]
    sizes = expand_group_sizes(group_sizes, rewards.numel())
    scored = torch.ones_like(rewards, dtype=torch.bool) if scored is None else scored.bool()  # [N]
    return rewards, sizes, scored, torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))


def _group_mean(rewards: torch.Tensor, scored: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """Mean of each group's scored rewards, [groups] (0 for a group with none)."""
    count = torch.zeros(groups).index_add_(0, group, scored.float())  # [B]
    total = torch.zeros(groups).index_add_(0, group, torch.where(scored, rewards, 0.0))  # [B]
    return total / count.clamp(min=1)  # [B]


def _group_std(centred: torch.Tensor, scored: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """Unbiased std of each group's scored rewards from their deviations `centred`, [groups]."""
    count = torch.zeros(groups).index_add_(0, group, scored.float())  # [B]
    squares = torch.zeros(groups).index_add_(0, group, torch.where(scored, centred, 0.0).square())  # [B]
    return (squares / (count - 1).clamp(min=1)).sqrt()  # [B]


def _has_spread(rewards: torch.Tensor, scored: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """Whether each group's scored rewards differ, [groups]: compared exactly, so that equal rewards
    give exactly 0 (their float32 mean can differ from each of them by 1e-8)."""
    highest = torch.full((groups,), -torch.inf).scatter_reduce(0, group, torch.where(scored, rewards, -torch.inf),
                                                               "amax")  # [B]
    lowest = torch.full((groups,), torch.inf).scatter_reduce(0, group, torch.where(scored, rewards, torch.inf),
                                                             "amin")  # [B]
    return highest > lowest  # [B]


def _std(values: torch.Tensor) -> torch.Tensor:
    """Unbiased std of `values` [M], 0 for fewer than two."""
    return values.std() if values.numel() > 1 else values.new_tensor(0.0)  # []


def worst_of_batch(rewards: torch.Tensor, scored: torch.Tensor,
                   worst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A failure never scores above an honest answer: each `worst` sample (a reward failed on it)
    takes the lowest reward of the batch's scored samples that nothing failed on, so that in a group
    of right answers it still scores below them whenever anything in the batch scored lower; in a
    batch with none such it is left out. (rewards float[N], scored bool[N], worst bool[N]) -> (rewards, scored)."""
    honest = scored & ~worst  # [N]
    if not honest.any():
        return rewards, scored & ~worst
    return torch.where(worst, rewards[honest].min(), rewards), scored | worst  # [N], [N]


def failures_below_honest(totals: torch.Tensor, scored: torch.Tensor, worst: torch.Tensor,
                          group_size: int) -> torch.Tensor:
    """After a penalty column is added (the overlong penalty, the KL penalty in the reward), a failed sample's total is
    at most the lowest honest total of its group: it keeps its own penalty, but an honest answer's larger one (a
    length-cut answer's overlong penalty) never lets a failure score above it. Its group's, not the batch's: one
    heavily penalised answer elsewhere must not push a group's failure far below its wrong answers, which would
    then gain. (totals float[N], scored bool[N], worst bool[N], N = groups x group_size) -> float[N]."""
    honest = (scored & ~worst).view(-1, group_size)  # [B, G]
    lowest = torch.where(honest, totals.view(-1, group_size), torch.inf).amin(1, keepdim=True)  # [B, 1]
    capped = torch.minimum(totals.view(-1, group_size), lowest).reshape(-1)  # [N]; inf: a group with no honest one
    return torch.where(scored & worst, capped, totals)  # [N]


def advantages_problem(advantages: torch.Tensor, totals: torch.Tensor, scored: torch.Tensor, worst: torch.Tensor,
                       rewards: torch.Tensor, weights: torch.Tensor, after_worst: torch.Tensor,
                       group_sizes: Sequence[int], scale: str, limit: float, estimator: str = "grpo") -> str:
    """Why a batch's advantages do not follow from its rewards ("" when they do), the way the sampler
    makes them: each total is its weighted rewards (float[N, R] @ weights float[R]), except that a
    failed (`worst`) sample's part before the `after_worst` columns (the penalties) is at most every
    honest one of its group (the batch's lowest honest one), and its total at most every honest total of
    its group, penalties included; the part before the penalties is within `limit` (what the sampler lets
    a total reach; a failed sample's total within it and the largest penalty); an unscored sample has
    advantage 0; and the advantages are `estimator`'s of the totals (grpo's under `scale`). Every
    comparison fails on NaN."""
    penalty = rewards.double()[:, after_worst] @ weights.double()[after_worst]  # [N]
    weighted = rewards.double()[:, ~after_worst] @ weights.double()[~after_worst]  # [N]
    base = totals.double() - penalty  # [N]: the total before the columns added after the worst
    # float32 totals: rounded relative to the largest of the values summed
    size = torch.stack([totals.double().abs(), weighted.abs(), penalty.abs()]).amax(0).clamp(min=1.0)  # [N]
    replaced = scored & worst  # [N]
    # a failed total capped at an honest total (failures_below_honest) is that total less its own penalty
    outside = ~torch.where(replaced, totals.double().abs() <= limit * (1 + 1e-6) + penalty.abs().max(),
                           base.abs() <= limit * (1 + 1e-6))  # [N]
    if outside.any():
        i = int(outside.nonzero()[0])
        return f"sample {i}'s total {float(totals[i]):.9g} is beyond the rewards' limit {limit:g}"
    wrong = ~replaced & ~((base - weighted).abs() <= 1e-5 * size)  # [N]
    if wrong.any():
        i = int(wrong.nonzero()[0])
        expected = float(weighted[i] + penalty[i])
        return f"sample {i}'s total {float(totals[i]):.9g} is not its weighted rewards {expected:.9g}"
    sizes = expand_group_sizes(group_sizes, totals.numel())
    group = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))  # [N]
    honest = scored & ~worst  # [N]

    def above_honest(values: torch.Tensor) -> torch.Tensor:  # [N] float64: a failed one above its group's honest ones
        lowest = torch.full((len(sizes),), torch.inf, dtype=torch.float64).scatter_reduce(
            0, group, torch.where(honest, values, torch.inf), "amin")  # [B]
        return replaced & ~(values <= lowest[group] + 1e-5 * size)  # [N]

    above = above_honest(base)
    if above.any():
        i = int(above.nonzero()[0])
        return f"sample {i} failed a reward but scores {float(base[i]):.9g}, above an honest answer of its group"
    above = above_honest(totals.double())
    if above.any():
        i = int(above.nonzero()[0])
        return (f"sample {i} failed a reward but its total {float(totals[i]):.9g}, penalties included, is above "
                f"an honest answer's of its group")
    unscored = ~scored & (advantages != 0)  # [N]
    if unscored.any():
        i = int(unscored.nonzero()[0])
        return f"sample {i} was not scored but has advantage {float(advantages[i]):.9g}"
    try:
        expected = estimate_advantages(estimator, totals, sizes, scale=scale, scored=scored)  # [N]
    except ValueError as e:  # a user's estimator that fails on this batch
        return str(e)
    # the same float32 code in both processes: exact zeros stay exact, the rest agree to float32 rounding of
    # the batch's largest advantage (an absolute floor would let small unnormalised advantages be forged)
    tolerance = 1e-5 * expected.abs() + 1e-6 * float(expected.abs().max()) if expected.numel() else 0.0  # [N]
    off = ~((advantages - expected).abs() <= tolerance) | ((expected == 0) & (advantages != 0))  # [N]
    if off.any():
        i = int(off.nonzero()[0])
        how = f"{scale}-scaled grpo" if estimator == "grpo" else estimator
        return (f"sample {i}'s advantage {float(advantages[i]):.9g} is not the {how} one of its totals "
                f"({float(expected[i]):.9g})")
    return ""
