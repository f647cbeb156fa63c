"""The rule rewards by name: the built-ins, and a user's function by import path. This is what the
jail that runs rule rewards imports (rewards/sandbox.py: jailed_reward): nothing here loads torch or a service.

A user's function takes the completion and its dataset row, `fn(completion: str, row: dict) -> float
| None`; the row holds every column of the dataset row plus `reference_answer` (REFERENCE). A function
marked with `@batched` takes the whole batch, `fn(completions, rows) -> list[float | None]`.
"""

from __future__ import annotations

from typing import Callable

from grpo.common.imports import import_object, is_import_path
from grpo.rewards.code_tests import unit_tests, unit_tests_partial
from grpo.rewards.gsm8k_answer import gsm8k_answer, gsm8k_answer_lenient
from grpo.rewards.procedural import reasoning_gym_score
from grpo.rewards.think_format import answer_format, think_answer_format, think_answer_format_partial

REFERENCE = "reference_answer"  # the row key that holds the parsed reference answer
PROMPT_TURNS = "prompt_turns"  # the row key that holds the prompt's chat turns (system, few-shot turns, question)
ENV_REWARD = "env_reward"  # the environment's own reward: it fails where the environment failed
ON_FAILURE = ("worst", "fallback")  # rewards.on_failure: what a sample a reward failed on trains with

REWARD_FUNCTIONS: dict[str, Callable[[str, str], float]] = {  # built-ins: (completion, reference answer)
    "gsm8k_answer": gsm8k_answer,
    "gsm8k_answer_lenient": gsm8k_answer_lenient,
    "think_answer_format": think_answer_format,
    "think_answer_format_partial": think_answer_format_partial,
    "answer_format": answer_format,
}
ROW_FUNCTIONS: dict[str, Callable[[str, dict], float | None]] = {  # built-ins that read the whole row
    "reasoning_gym": reasoning_gym_score,  # a reasoning-gym task's own scorer
    "unit_tests": unit_tests,  # the completion's code against the row's tests: 1 when all pass
    "unit_tests_partial": unit_tests_partial,  # the share of the row's tests that pass
    ENV_REWARD: lambda completion, row: row.get(ENV_REWARD),  # the environment's own (grpo/environments)
}
SERVICES = "services: reward_model:<folder or Hub id>, an http(s):// URL, judge"


def batched(fn):
    """Mark a reward that scores a whole batch: fn(completions, rows) -> list of float | None."""
    fn.batched = True
    return fn


def is_batched(fn) -> bool:
    return getattr(fn, "batched", False) is True


def rule_reward(name: str):
    """The rule reward `name` names, in the row form fn(completion, row) (or its batch form, marked
    `batched`); ValueError listing the valid names."""
    if is_import_path(name):
        return import_object(name, "rewards.names")
    if name in ROW_FUNCTIONS:
        return ROW_FUNCTIONS[name]
    try:
        builtin = REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown reward '{name}'; valid names: "
                         f"{', '.join(sorted({*REWARD_FUNCTIONS, *ROW_FUNCTIONS}))}, "
                         f"or an import path 'package.module:function'; {SERVICES}") from None
    return lambda completion, row: builtin(completion, row[REFERENCE])
