"""The trainer's check that a batch's advantages follow from its rewards, before it trains on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpo.objective.advantages import advantages_problem
from grpo.objective.kl_reward import AFTER_WORST, batch_reward_columns, kl_penalties
from grpo.objective.kl_reward import NAME as KL_PENALTY
from grpo.rewards.limits import REWARD_LIMIT
from grpo.rewards.overlong import NAME as OVERLONG
from grpo.rewards.overlong import overlong_penalty
from grpo.wire.batch import RolloutBatch
from grpo.wire.behaviour import BehaviourMismatch

if TYPE_CHECKING:
    from grpo.settings import Config


def check_advantages(batch: RolloutBatch, cfg: Config) -> None:
    """Raise unless the batch's advantages follow from its rewards: its reward columns are this run's
    (rewards.names, then the overlong penalty when it is on, recomputed here from the completions'
    lengths, then with training.kl_in=reward the KL penalty, recomputed from the batch's log-probs), its
    totals those columns weighted by rewards.weights (the penalties with weight 1, added after a failed
    sample takes the batch's worst, its total then at most its group's honest ones: grpo/sampler/batches.py), and its
    advantages those totals' under training.advantage (grpo.objective.advantages.advantages_problem). The trainer
    trains on nothing else."""
    where = f"sampler {batch.sampler} step {batch.step}"
    rewards = cfg.rewards
    names, weights = batch_reward_columns(cfg)
    if batch.reward_names != names:
        raise BehaviourMismatch(f"{where} was scored with the rewards {batch.reward_names}, this run's are {names}; "
                                "nothing was trained with it. Start the sampler with the same rewards.names and "
                                "rewards.overlong_buffer (and training.kl_in).")
    training = cfg.training
    problem = overlong_problem(batch, cfg) if rewards.overlong_buffer > 0 else ""
    problem = problem or (kl_problem(batch, cfg) if training.kl_in == "reward" else "")
    problem = problem or advantages_problem(
        batch.advantages, batch.totals, batch.scored, batch.worst, batch.rewards,
        torch.tensor(weights, dtype=torch.float64), torch.tensor([name in AFTER_WORST for name in names]),
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
    found, i = first_off(batch, OVERLONG, expected, 1e-6)
    if i is None:
        return ""
    return (f"sample {i}'s overlong penalty {float(found[i]):.9g} is not its length's "
            f"({len(batch.completion_ids[i])} tokens: {float(expected[i]):.9g})")


def kl_problem(batch: RolloutBatch, cfg: Config) -> str:
    """Where the batch's KL penalty column is not -beta x its completions' summed KL between the log-probs it
    carries ("" nowhere)."""
    if batch.old_logps is None or batch.ref_logps is None:
        return "it carries no old or reference log-probs to recompute its KL penalty from"
    training = cfg.training
    expected = kl_penalties(batch.old_logps, batch.ref_logps, batch.model_mask, training.beta,
                            training.kl_estimator).double()  # [N]
    found, i = first_off(batch, KL_PENALTY, expected, 1e-5)
    if i is None:
        return ""
    return (f"sample {i}'s KL penalty {float(found[i]):.9g} is not -training.beta x its summed KL "
            f"({float(expected[i]):.9g})")


def first_off(batch: RolloutBatch, column: str, expected: torch.Tensor, rtol: float) -> tuple[torch.Tensor, int | None]:
    """The batch's reward `column` [N] (float64) and the first sample where it is not `expected` [N] within
    `rtol` of max(|expected|, 1) (None: nowhere; NaN is off)."""
    found = batch.rewards[:, batch.reward_names.index(column)].double()  # [N]
    off = ~((found - expected).abs() <= rtol * expected.abs().clamp(min=1.0))  # [N]
    return found, int(off.nonzero()[0]) if off.any() else None
