"""Reward functions by name or import path, and scoring a batch of completions with a fallback.

A reward is named in `rewards.names` either by its built-in name (REWARD_FUNCTIONS) or by an
import path `package.module:function` (or `path/to/file.py:function`). A user's function takes
the completion and its dataset row, `fn(completion: str, row: dict) -> float | None`; the row
holds every column of the dataset row plus `reference_answer` (the answer the data loader
parsed). None means the reward does not apply to that row: it adds nothing to the total and is
left out of that reward's mean. A function marked with `@batched` takes the whole batch instead,
`fn(completions: list[str], rows: list[dict]) -> list[float | None]` (TRL's form, one call;
a call that fails is made again per sample, so one bad sample does not cost the batch).
The built-ins keep their pure `(completion, answer)` form.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from rewards.gsm8k_answer import gsm8k_answer, gsm8k_answer_lenient
from rewards.procedural import reasoning_gym_score
from rewards.think_format import answer_format, think_answer_format, think_answer_format_partial

log = logging.getLogger(__name__)

REFERENCE = "reference_answer"  # the row key that holds the parsed reference answer

REWARD_FUNCTIONS: dict[str, Callable[[str, str], float]] = {  # built-ins: (completion, reference answer)
    "gsm8k_answer": gsm8k_answer,
    "gsm8k_answer_lenient": gsm8k_answer_lenient,
    "think_answer_format": think_answer_format,
    "think_answer_format_partial": think_answer_format_partial,
    "answer_format": answer_format,
}
ROW_FUNCTIONS: dict[str, Callable[[str, dict], float | None]] = {  # built-ins that read the whole row
    "reasoning_gym": reasoning_gym_score,  # a reasoning-gym task's own scorer
    "env_reward": lambda completion, row: row.get("env_reward"),  # the environment's own (grpo/environments)
}


class RewardImportError(ValueError):
    """A `module:function` reward that cannot be imported; the message names the path."""


def batched(fn):
    """Mark a reward that scores a whole batch: fn(completions, rows) -> list of float | None."""
    fn.batched = True
    return fn


def is_batched(fn) -> bool:
    return getattr(fn, "batched", False) is True


def is_import_path(name: str) -> bool:
    return ":" in name


def _module_of(path: str):
    if path.endswith(".py"):  # a file: imported under its own name, once
        file = Path(path).expanduser().resolve()
        name = f"grpo_user_rewards.{file.stem}_{zlib.crc32(str(file).encode()):08x}"
        if name not in sys.modules:
            spec = importlib.util.spec_from_file_location(name, file)
            if spec is None or not file.is_file():
                raise FileNotFoundError(f"no file {file}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            sys.modules[name] = module
        return sys.modules[name]
    return importlib.import_module(path)


def import_object(name: str, key: str):
    """The callable an import path names (for the config key `key`); RewardImportError (naming the
    key, the path and why) otherwise."""
    module_path, _, attribute = name.rpartition(":")
    try:
        function = getattr(_module_of(module_path), attribute)
    except Exception as e:  # ImportError, SyntaxError in the module, AttributeError, ...
        raise RewardImportError(f"{key}: cannot import {name!r} ({type(e).__name__}: {e}); give "
                                "'package.module:name' importable from the project folder or PYTHONPATH, "
                                "or 'path/to/file.py:name'") from None
    if not callable(function):
        raise RewardImportError(f"{key}: {name!r} is a {type(function).__name__}, not a function or class")
    return function


def import_reward(name: str):
    """The reward function an import path names."""
    return import_object(name, "rewards.names")


def get_reward(name: str):
    """The reward in the row form: fn(completion, row) (or its batch form, marked `batched`)."""
    if is_import_path(name):
        return import_reward(name)
    if name in ROW_FUNCTIONS:
        return ROW_FUNCTIONS[name]
    try:
        builtin = REWARD_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown reward '{name}'; valid names: {', '.join(sorted({*REWARD_FUNCTIONS, *ROW_FUNCTIONS}))}, "
                         "or an import path 'package.module:function'") from None
    return lambda completion, row: builtin(completion, row[REFERENCE])


@dataclass
class RewardScores:
    per_function: torch.Tensor  # float32 [N, R], before weighting; 0 where the reward does not apply
    applies: torch.Tensor  # bool [N, R]: False where the reward returned None
    total: torch.Tensor  # float32 [N], weighted sum of the rewards that apply
    failures: dict[str, int]  # reward name -> samples that fell back


def _checked(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"non-finite reward {value}")
    return value


def _score_one_function(name: str, fn, call, completions, rows, fallback: float) -> tuple[list, int]:
    """(values with None kept, failures). A batch form that raises or times out is called again on
    each sample alone, so only the samples it fails on fall back; one that returns the wrong count
    breaks its contract: the whole batch falls back."""
    if is_batched(fn):
        try:
            values = call(name, completions, rows) if call is not None else fn(list(completions), list(rows))
        except Exception as e:  # a reward bug must not end a run of hours
            log.warning("reward %s failed on a batch of %d (%s: %s); scoring each sample alone", name,
                        len(completions), type(e).__name__, e)
        else:
            if len(values) != len(completions):
                log.warning("reward %s returned %d values for %d completions; using fallback %s", name, len(values),
                            len(completions), fallback)
                return [fallback] * len(completions), len(completions)
            try:
                return [_checked(v) for v in values], 0
            except ValueError as e:
                log.warning("reward %s: %s in its batch; scoring each sample alone", name, e)
    values, failures = [], 0
    for i, (completion, row) in enumerate(zip(completions, rows, strict=True)):
        try:
            values.append(_checked(_one(name, fn, call, completion, row)))
        except Exception as e:
            log.warning("reward %s failed on sample %d (%s: %s); using fallback %s",
                        name, i, type(e).__name__, e, fallback)
            values.append(fallback)
            failures += 1
    return values, failures


def _one(name: str, fn, call, completion: str, row: dict):
    """One sample's reward, through the batch form of a batched function."""
    if not is_batched(fn):
        return call(name, completion, row) if call is not None else fn(completion, row)
    values = call(name, [completion], [row]) if call is not None else fn([completion], [row])
    if len(values) != 1:
        raise ValueError(f"returned {len(values)} values for 1 completion")
    return values[0]


def score_completions(completions: Sequence[str], rows: Sequence[dict], names: Sequence[str],
                      weights: Sequence[float], fallback: float, call: Callable | None = None) -> RewardScores:
    """Score every completion with every reward. A function that raises, returns a non-finite
    value or times out gives `fallback` for that sample and is counted, never a crash.

    `call(name, completion, row)` (or `call(name, completions, rows)` for a batched reward) runs
    the function elsewhere (rewards.sandbox.RewardSandbox, which also times it out).
    """
    scores = torch.zeros(len(completions), len(names), dtype=torch.float32)
    applies = torch.ones(len(completions), len(names), dtype=torch.bool)
    failures = {}
    for j, name in enumerate(names):
        values, failures[name] = _score_one_function(name, get_reward(name), call, completions, rows, fallback)
        for i, value in enumerate(values):
            if value is None:
                applies[i, j] = False
            else:
                scores[i, j] = value
    total = (scores * applies) @ torch.tensor(list(weights), dtype=torch.float32)
    return RewardScores(scores, applies, total, failures)
