"""The sampler's wait for weights, its metrics and its resumable state."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from grpo.batch import RolloutBatch
from grpo.files import write_atomically

log = logging.getLogger(__name__)
OLD_LOGPS_SOURCES = ("recompute", "generation")  # sampling.old_logps (grpo/sampler_step.policy_logprobs)


class StalenessTimeout(TimeoutError):
    """The trainer did not publish the weights the next step needs in time."""


def wait_for_version(watcher, needed: int, timeout_s: float, poll_s: float = 0.2, on_poll=None) -> None:
    """Poll the weights folder, loading new versions, until `watcher.version >= needed`;
    `on_poll()` runs at each poll (the sampler re-sends spooled batches to a restarted trainer)."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while True:
        if on_poll is not None:
            on_poll()
        watcher.poll()
        if watcher.version >= needed:
            return
        if not announced:
            log.info("waiting for weights v%d (have v%d)", needed, watcher.version)
            announced = True
        if time.monotonic() > deadline:
            raise StalenessTimeout(
                f"no weights v{needed} in {watcher.root} after {timeout_s:g} s (have v{watcher.version}); "
                "is training_worker.py running and publishing? (sampling.wait_timeout_s)")
        time.sleep(poll_s)


def sampler_metrics(batch: RolloutBatch, scores, timings: dict[str, float]) -> dict[str, float]:
    """TRL's names where they exist. `scores`: the batch's rewards.RewardScores (a reward's mean
    and std leave out the samples it does not apply to)."""
    total_rewards, failures = scores.total, scores.failures
    lengths = torch.tensor([len(c) for c in batch.completion_ids], dtype=torch.float32)
    groups = total_rewards.split(batch.group_sizes)
    group_std = torch.stack([g.std() if len(g) > 1 else g.new_tensor(0.0) for g in groups])
    metrics = {
        "reward": total_rewards.mean().item(),
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": (group_std == 0).float().mean().item(),
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


class SamplerState:
    """The next step and the data cursor, saved together after each send (atomically)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def of_sampler(cls, run_dir: Path, sampler: int) -> "SamplerState":
        return cls(Path(run_dir) / ("sampler_state.json" if sampler == 0 else f"sampler{sampler}_state.json"))

    def load(self) -> dict | None:
        if not self.path.is_file():
            return None
        return json.loads(self.path.read_text())

    def save(self, next_step: int, cursor: dict) -> None:
        write_atomically(self.path, json.dumps({"next_step": next_step, "cursor": cursor}))
