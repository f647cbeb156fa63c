"""The sampler's metrics of a batch: rewards, their spread, completion lengths, timings."""

from __future__ import annotations

import torch

from grpo.wire.batch import RolloutBatch


def sampler_metrics(batch: RolloutBatch, scores, timings: dict[str, float]) -> dict[str, float]:
    """TRL's names where they exist. `scores`: the batch's rewards.RewardScores (a reward's mean
    and std leave out the samples it does not apply to). frac_reward_zero_std: of the trained groups,
    the share whose rewards are all equal (as sampling/zero_spread_fraction counts the generated ones)."""
    total_rewards, failures = scores.total, scores.failures
    lengths = torch.tensor([len(c) for c in batch.completion_ids], dtype=torch.float32)
    groups = total_rewards.split(batch.group_sizes)
    group_std = torch.stack([g.std() if len(g) > 1 else g.new_tensor(0.0) for g in groups])
    metrics = {
        "reward": total_rewards.mean().item(),
        "reward_std": group_std.mean().item(),
        # compared exactly: a float32 std of equal rewards need not be 0 (of 3 x -0.45: 3.7e-8)
        "frac_reward_zero_std": sum(bool(g.max() == g.min()) for g in groups) / len(groups),
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
        column = batch.rewards[:, j][scores.applies[:, j]]
        if len(column):  # no mean where it applied to no sample
            metrics[f"rewards/{name}/mean"] = column.mean().item()
        metrics[f"rewards/{name}/std"] = column.std().item() if len(column) > 1 else 0.0
        metrics[f"rewards/{name}/failures"] = float(failures.get(name, 0))
        metrics[f"rewards/{name}/applies"] = len(column) / max(len(batch.rewards), 1)
    metrics.update(timings)
    return metrics
