"""Group-relative advantages (GRPO paper eq. 3, with the Dr. GRPO / batch-std variants)."""

from __future__ import annotations

from typing import Sequence

import torch

from grpo.objective import ADVANTAGE_SCALES as SCALES


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
                     eps: float = 1e-4) -> torch.Tensor:
    """A_i = (r_i - mean(group)) / (std + eps); prompt-major rewards float[N] -> float[N].

    scale: "group" divides by the group's std, "batch" by the whole batch's std (more robust
    when a group has tiny variance), "none" only centres (Dr. GRPO). std is unbiased. A group
    whose rewards are all equal (including a group of one) gets exactly 0.
    """
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}; got {scale!r}")
    rewards = rewards.to(torch.float32)  # [N]
    groups = torch.split(rewards, expand_group_sizes(group_sizes, rewards.numel()))
    batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_tensor(0.0)  # []
    out = []
    for g in groups:  # g: [G_i]
        if g.numel() == 1 or bool(g.max() == g.min()):
            out.append(torch.zeros_like(g))  # no signal; avoids 1e-17 noise from the mean
            continue
        centred = g - g.mean()  # [G_i]
        if scale == "group":
            centred = centred / (g.std() + eps)
        elif scale == "batch":
            centred = centred / (batch_std + eps)
        out.append(centred)
    return torch.cat(out)  # [N]
