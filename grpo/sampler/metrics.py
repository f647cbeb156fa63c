"""The sampler's metrics of a batch: rewards, their spread, completion lengths, timings."""

from __future__ import annotations

import torch

from grpo.sampler.dynamic_sampling import has_spread
from grpo.wire.batch import RolloutBatch


def sampler_metrics(batch: RolloutBatch, scores, timings: dict[str, float]) -> dict[str, float]:
    """TRL's names where they exist. `scores`: the batch's rewards.RewardScores. A sample a reward
    failed on is left out of that reward's mean and std; `reward`, `reward_std` and
    `frac_reward_zero_std` describe the rewards that train (the scored samples, a failed one at the batch's
    worst; before training.kl_in=reward's KL penalty, which its own column's metrics describe).
    `reward` is absent when no sample was scored. frac_reward_zero_std: of the trained groups,
    the share without two differing scored rewards (as sampling/zero_spread_fraction counts the
    generated ones). rewards/left_out_fraction: the share of samples left out of the advantages;
    rewards/worst_fraction: the share that scored the batch's worst because a reward failed on them."""
    lengths = torch.tensor([len(c) for c in batch.completion_ids], dtype=torch.float32)
    metrics = {
        **total_metrics(scores.total, scores.scored, batch.group_sizes),
        "rewards/worst_fraction": (scores.worst & scores.scored).float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": batch.truncated.float().mean().item(),
        "completions/eos_rate": 1.0 - batch.truncated.float().mean().item(),
        "policy_version": float(batch.policy_version),
        "sampler/tokens_per_s": timings.get("sampling/generated_tokens", lengths.sum().item())  # all rounds'
                                / max(timings.get("timing/generate_s", 0.0), 1e-9),
    }
    for j, name in enumerate(batch.reward_names):
        metrics.update(reward_metrics(name, batch.rewards[:, j], scores.applies[:, j] & ~scores.failed[:, j],
                                      scores.failures.get(name, 0)))
    metrics.update(timings)
    return metrics


def total_metrics(total: torch.Tensor, scored: torch.Tensor, group_sizes: list[int]) -> dict[str, float]:
    """The weighted totals [N] of the scored samples (bool [N]): their mean, the mean of each group's std,
    the share of groups without spread, and the share of samples left out."""
    stds = [g[s].std() if int(s.sum()) > 1 else g.new_tensor(0.0)
            for g, s in zip(total.split(group_sizes), scored.split(group_sizes))]  # one per group
    spread = [has_spread(g, len(g), s)[0] for g, s in zip(total.split(group_sizes), scored.split(group_sizes))]
    metrics = {"reward_std": torch.stack(stds).mean().item(),
               # compared exactly: a float32 std of equal rewards need not be 0 (of 3 x -0.45: 3.7e-8)
               "frac_reward_zero_std": 1.0 - sum(spread) / len(spread),
               "rewards/left_out_fraction": 1.0 - scored.float().mean().item()}
    if scored.any():
        metrics["reward"] = total[scored].mean().item()
    return metrics


def reward_metrics(name: str, column: torch.Tensor, valued: torch.Tensor, failures: int) -> dict[str, float]:
    """One reward's values [N] where it gave one (bool [N]: it applied and did not fail): mean, std,
    failures, and the share it applied to."""
    values = column[valued]  # [M]
    metrics = {f"rewards/{name}/std": values.std().item() if len(values) > 1 else 0.0,
               f"rewards/{name}/failures": float(failures),
               f"rewards/{name}/applies": len(values) / max(len(column), 1)}
    if len(values):  # no mean where it gave no value
        metrics[f"rewards/{name}/mean"] = values.mean().item()
    return metrics
