"""RolloutBatch: the sampler's output, in memory and on the wire (DESIGN section 3).

Ragged and unpadded. Prompt-major: completion j of prompt i sits at sum(group_sizes[:i]) + j,
whatever chunking the generator used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

SCHEMA = "grpo.rollout/1"


@dataclass
class RolloutBatch:
    step: int  # sampler step, monotonic; the trainer de-duplicates by it
    policy_version: int  # weights version that generated the batch
    prompt_ids: list[torch.Tensor]  # B x int64 [P_i], no padding
    completion_ids: list[torch.Tensor]  # N = sum(group_sizes) x int64 [C_j], cut after the first EOS (kept)
    group_sizes: list[int]  # [B], G per prompt
    old_logps: list[torch.Tensor] | None  # N x float32 [C_j]: the generating policy, at the sampling temperature
    ref_logps: list[torch.Tensor] | None  # N x float32 [C_j]: the reference policy; None when beta = 0
    rewards: torch.Tensor  # float32 [N, R], per reward function, before weighting
    reward_names: list[str]  # [R]
    advantages: torch.Tensor  # float32 [N], group-relative
    truncated: torch.Tensor  # bool [N], hit max_new_tokens without EOS
    num_tokens: int  # completion tokens in the loss, over the whole batch (global denominator)
    num_sequences: int  # completions in the loss, over the whole batch (global denominator)
    meta: dict = field(default_factory=dict)  # JSON-safe: sample ids, timings, sampler metrics
    schema: str = SCHEMA

    def group_slices(self) -> list[slice]:
        """The completions of each prompt."""
        out, start = [], 0
        for g in self.group_sizes:
            out.append(slice(start, start + g))
            start += g
        return out
