"""The KL to the reference in the reward (training.kl_in=reward), as veRL's `use_kl_in_reward` puts it
for GRPO: each completion's score less beta x its summed per-token KL estimate (k1), before the group's
advantages are taken; the loss then has no KL term. It travels as one more reward column,
`kl_penalty` (weight 1, after the rewards and the overlong penalty), which the trainer recomputes from
the batch's log-probs before it trains on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpo.objective import kl_per_token
from grpo.rewards.overlong import NAME as OVERLONG
from grpo.rewards.overlong import reward_columns

if TYPE_CHECKING:
    from grpo.settings import Config

NAME = "kl_penalty"  # its column among the batch's rewards
# columns a failed sample keeps its own value of (not the worst; its total stays below its group's honest ones)
AFTER_WORST = (OVERLONG, NAME)


def batch_reward_columns(cfg: Config) -> tuple[list[str], list[float]]:
    """A batch's reward columns and weights: rewards.names, the overlong penalty when it is on, then the
    KL penalty with training.kl_in=reward."""
    names, weights = reward_columns(cfg.rewards.names, cfg.rewards.weights, cfg.rewards.overlong_buffer)
    if cfg.training.kl_in == "reward":
        return [*names, NAME], [*weights, 1.0]
    return names, weights


def kl_penalties(behaviour_logps: list[torch.Tensor], ref_logps: list[torch.Tensor],
                 model_masks: list[torch.Tensor] | None, beta: float, estimator: str) -> torch.Tensor:
    """float32 [N]: -beta x the sum over each completion's model tokens of the KL estimate between the
    policy that sampled it and the reference (grpo.objective.kl_per_token, d = log pi_ref - log pi)."""
    sums = []
    for j, (logps, ref) in enumerate(zip(behaviour_logps, ref_logps)):
        kl = kl_per_token(ref.double(), logps.double(), estimator)  # [C_j]
        keep = model_masks[j].bool() if model_masks is not None else torch.ones_like(kl, dtype=torch.bool)
        sums.append(kl[keep].sum())
    return (-beta * torch.stack(sums)).float() if sums else torch.zeros(0)
