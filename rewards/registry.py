"""Reward functions by name, and scoring a batch of completions with a fallback on errors."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from rewards.gsm8k_answer import gsm8k_answer, gsm8k_answer_lenient
from rewards.think_format import think_answer_format, think_answer_format_partial

log = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]

REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "gsm8k_answer": gsm8k_answer,
    "gsm8k_answer_lenient": gsm8k_answer_lenient,
    "think_answer_format": think_answer_format,
    "think_answer_format_partial": think_answer_format_partial,
}


def get_reward(name: str) -> RewardFn:
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown reward '{name}'; valid names: {', '.join(sorted(REWARD_FUNCTIONS))}") from None


@dataclass
class RewardScores:
    per_function: torch.Tensor  # float32 [N, R], before weighting
    total: torch.Tensor  # float32 [N], weighted sum
    failures: dict[str, int]  # reward name -> samples that fell back


def score_completions(completions: Sequence[str], answers: Sequence[str], names: Sequence[str],
                      weights: Sequence[float], fallback: float,
                      call: Callable[[str, str, str], float] | None = None) -> RewardScores:
    """Score every completion with every reward. A function that raises or returns a
    non-finite value gives `fallback` for that sample and is counted, never a crash.

    `call(name, completion, answer)` runs a function elsewhere (rewards.sandbox.RewardSandbox,
    which also times it out); by default it runs here.
    """
    fns = [get_reward(n) for n in names]
    if call is not None:
        fns = [lambda c, a, name=name: call(name, c, a) for name in names]
    scores = torch.empty(len(completions), len(fns), dtype=torch.float32)
    failures = {n: 0 for n in names}
    for i, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
        for j, (name, fn) in enumerate(zip(names, fns)):
            try:
                value = float(fn(completion, answer))
                if not math.isfinite(value):
                    raise ValueError(f"non-finite reward {value}")
            except Exception as e:  # a reward bug must not end a run of hours
                log.warning("reward %s failed on sample %d (%s: %s); using fallback %s",
                            name, i, type(e).__name__, e, fallback)
                failures[name] += 1
                value = fallback
            scores[i, j] = value
    total = scores @ torch.tensor(list(weights), dtype=torch.float32)
    return RewardScores(scores, total, failures)
