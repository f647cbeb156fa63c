"""The trainer's check that a batch's advantages follow from its rewards, before it trains on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpo.objective.advantages import advantages_problem
from grpo.rewards.overlong import NAME as OVERLONG
from grpo.rewards.overlong import overlong_penalty, reward_columns
from grpo.rewards.registry import REWARD_LIMIT
from grpo.wire.batch import RolloutBatch
from grpo.wire.behaviour import BehaviourMismatch

if TYPE_CHECKING:
    from grpo.settings import Config


def check_advantages(batch: RolloutBatch, cfg: Config) -> None:
    """Raise unless the batch's advantages follow from its rewards: its reward columns are this run's
    (rewards.names, then the overlong penalty when it is on, recomputed here from the completions'
    lengths), its totals those columns weighted by rewards.weights (the penalty with weight 1, added
    after a failed sample takes the batch's worst: grpo/sampler/batches.py), and its advantages those
    totals' under training.advantage (grpo.objective.advantages.advantages_problem). The trainer
    trains on nothing else."""
    where = f"sampler {batch.sampler} step {batch.step}"
    rewards = cfg.rewards
    names, weights = reward_columns(rewards.names, rewards.weights, rewards.overlong_buffer)
    if batch.reward_names != names:
        raise BehaviourMismatch(f"{where} was scored with the rewards {batch.reward_names}, this run's are {names}; "
                                "nothing was trained with it. Start the sampler with the same rewards.names and "
                                "rewards.overlong_buffer.")
    problem = overlong_problem(batch, cfg) if rewards.overlong_buffer > 0 else ""
    training = cfg.training
    problem = problem or advantages_problem(
        batch.advantages, batch.totals, batch.scored, batch.worst, batch.rewards,
        torch.tensor(weights, dtype=torch.float64), torch.tensor([name == OVERLONG for name in names]),
        batch.group_sizes, training.advantage_scale, REWARD_LIMIT, training.advantage)
    if problem:
        estimator = training.advantage if training.advantage != "grpo" else \
            f"grpo, training.advantage_scale={training.advantage_scale}"
        raise BehaviourMismatch(f"{where}'s advantages do not follow from its rewards under this run's "
                                f"rewards.weights and training.advantage={estimator}: {problem}. "
                                "Nothing was trained with it.")


def overlong_problem(batch: RolloutBatch, cfg: Config) -> str:
    """Where the batch's overlong column is not the penalty of its completions' lengths ("" nowhere)."""
    rewards = cfg.rewards
    expected = torch.tensor([overlong_penalty(len(c), cfg.sampling.max_new_tokens, rewards.overlong_buffer,
                                              rewards.overlong_penalty) for c in batch.completion_ids])  # [N]
    found = batch.rewards[:, -1].double()  # [N]
    off = ~((found - expected).abs() <= 1e-6 * expected.abs().clamp(min=1.0))  # [N]
    if not off.any():
        return ""
    i = int(off.nonzero()[0])
    return (f"sample {i}'s overlong penalty {float(found[i]):.9g} is not its length's "
            f"({len(batch.completion_ids[i])} tokens: {float(expected[i]):.9g})")
