"""The trainer's check that a batch's advantages follow from its rewards, before it trains on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpo.objective.advantages import advantages_problem
from grpo.wire.batch import RolloutBatch
from grpo.wire.behaviour import BehaviourMismatch
from rewards.overlong import NAME as OVERLONG

if TYPE_CHECKING:
    from grpo.settings import Config


def check_advantages(batch: RolloutBatch, cfg: Config) -> None:
    """Raise unless the batch's advantages follow from its rewards: its totals are its rewards weighted by
    this run's rewards.weights (the overlong penalty with weight 1, added after a failed sample takes the
    batch's worst: grpo/sampler/batches.py), and its advantages are those totals' under
    training.advantage_scale (grpo.objective.advantages.advantages_problem). The trainer trains on nothing else."""
    where = f"sampler {batch.sampler} step {batch.step}"
    if batch.totals is None or batch.scored is None or batch.worst is None:
        raise BehaviourMismatch(f"{where} carries no reward totals, so its advantages cannot be checked; "
                                "nothing was trained with it. Run the sampler of this trainer's version.")
    weights = {**dict(zip(cfg.rewards.names, cfg.rewards.weights)), OVERLONG: 1.0}
    unknown = [name for name in batch.reward_names if name not in weights]
    if unknown:
        raise BehaviourMismatch(f"{where} was scored with rewards this run does not have ({', '.join(unknown)}); "
                                f"this run's are {', '.join(cfg.rewards.names)}. Nothing was trained with it.")
    scale = cfg.training.advantage_scale
    problem = advantages_problem(
        batch.advantages, batch.totals, batch.scored, batch.worst, batch.rewards,
        torch.tensor([weights[name] for name in batch.reward_names], dtype=torch.float64),
        torch.tensor([name == OVERLONG for name in batch.reward_names], dtype=torch.bool), batch.group_sizes, scale)
    if problem:
        raise BehaviourMismatch(f"{where}'s advantages do not follow from its rewards under this run's "
                                f"rewards.weights and training.advantage_scale={scale}: {problem}. "
                                "Nothing was trained with it.")
