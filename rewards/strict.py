"""The reported rates every run logs, whatever rewards it trains on: answer accuracy and exact format.

Which reward decides each is configured (`rewards.accuracy_reward`, `rewards.format_reward`;
GSM8K's strict pair by default); a sample counts when that reward gives >= 1 (gsm8k_answer's
+1, think_answer_format's +1.25, a reasoning-gym task's full score). A reward that does not apply
to a sample (None) does not count it; a sample the reward failed on (it raised, timed out) counts
as not passing: a completion that makes the check fail must not raise the rate. A rate is never
a crash.
"""

from __future__ import annotations

import logging
import math

from grpo.rewards.registry import PROMPT_TURNS, REFERENCE, get_reward, score_one_function

log = logging.getLogger(__name__)

PASS = 1.0  # a reward at or above this counts the sample as correct / well-formed
GSM8K_CHECKS = ("gsm8k_answer", "think_answer_format")  # (accuracy reward, format reward): the defaults


def passes(name: str, texts: list[str], rows: list[dict], call=None) -> list[bool]:
    """For each completion, whether reward `name` gives it >= PASS (rows: dataset rows with
    reference_answer). `call`: where the function runs (rewards.sandbox.RewardSandbox; None: here),
    as for the training rewards; a sample it fails on does not pass."""
    values, _ = score_one_function(name, get_reward(name), call, list(texts), list(rows), fallback=-math.inf)
    return [v is not None and v >= PASS for v in values]


def reward_rows(prompts: list) -> list[dict]:
    """The rows rewards get for these prompts (data.prompts.Prompt): the dataset row, the parsed
    reference answer and the chat turns the prompt was rendered from (what a service reward gets as
    `prompts`; TRL passes the same as `prompts`)."""
    return [{**p.problem.row, REFERENCE: p.problem.answer, PROMPT_TURNS: [dict(turn) for turn in p.turns]}
            for p in prompts]


def checks_of(rewards_cfg) -> tuple[str, str]:
    """(rewards.accuracy_reward, rewards.format_reward)."""
    return rewards_cfg.accuracy_reward, rewards_cfg.format_reward


def strict_rates(texts: list[str], rows: list[dict], checks: tuple[str, str] = GSM8K_CHECKS,
                 call=None) -> dict[str, float]:
    """The answer accuracy and exact-format rate of completions (rows as `reward_rows` makes them)."""
    n = max(len(texts), 1)
    return {"strict/answer_accuracy": sum(passes(checks[0], texts, rows, call)) / n,
            "strict/format_rate": sum(passes(checks[1], texts, rows, call)) / n}
