"""Reward functions by name or import path, and scoring a batch of completions; a sample a reward
fails on scores the batch's worst, one it could not be asked about is left out of the advantages
(or, with rewards.on_failure=fallback, either is given rewards.fallback).

A reward is named in `rewards.names` either by its built-in name (REWARD_FUNCTIONS) or by an
import path `package.module:function` (or `path/to/file.py:function`). A user's function takes
the completion and its dataset row, `fn(completion: str, row: dict) -> float | None`; the row
holds every column of the dataset row plus `reference_answer` (the answer the data loader
parsed). None means the reward does not apply to that row: it adds nothing to the total and is
left out of that reward's mean. A function marked with `@batched` takes the whole batch instead,
`fn(completions: list[str], rows: list[dict]) -> list[float | None]` (TRL's form, one call;
a call that raises or times out is made again on halves of the batch, so that one bad sample
costs only itself).
The built-ins keep their pure `(completion, answer)` form.

A reward model (`reward_model:<folder or Hub id>`), an HTTP endpoint (`http://...`) and an LLM
judge (`judge`) are services (rewards/services.py): they also get each sample's prompt as chat
turns, and run here in the sampler process, never in the sandbox child.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from grpo.common.child import failure_text
from grpo.rewards.builtins import (  # noqa: F401 (the registry's names, as before)
    ENV_REWARD,
    ON_FAILURE,
    PROMPT_TURNS,
    REFERENCE,
    REWARD_FUNCTIONS,
    ROW_FUNCTIONS,
    batched,
    is_batched,
    rule_reward,
)
from grpo.rewards.http_json import BreakerOpen, ServiceError, Unreachable
from grpo.rewards.limits import REWARD_LIMIT
from grpo.rewards.services import ServiceSettings, is_service, is_service_name, service_reward

log = logging.getLogger(__name__)

def get_reward(name: str, services: ServiceSettings | None = None):
    """The reward in the row form: fn(completion, row) (or its batch form, marked `batched`; or a
    service, marked `service`, loaded with the settings `services`)."""
    if is_service_name(name):  # before import paths: a URL and reward_model:<folder> hold a colon too
        return service_reward(name, services)
    return rule_reward(name)


@dataclass
class RewardScores:
    per_function: torch.Tensor  # float32 [N, R], before weighting; 0 where the reward does not apply or failed
    #                             (with a fallback: the fallback where it failed)
    applies: torch.Tensor  # bool [N, R]: False where the reward returned None
    total: torch.Tensor  # float32 [N], weighted sum of the rewards that apply (a failed one: its fallback, or nothing)
    failures: dict[str, int]  # reward name -> samples it failed on, or could not be asked about
    errors: dict[str, str] = field(default_factory=dict)  # reward name -> its first failure: what, and where
    failed: torch.Tensor | None = None  # bool [N, R]: where the reward failed or could not be asked (None: nowhere)
    scored: torch.Tensor | None = None  # bool [N]: the samples whose total counts in the advantages (None: all);
    #                                     without a fallback, not those a weighted reward could not be asked about
    worst: torch.Tensor | None = None  # bool [N]: without a fallback, the samples a weighted reward failed on
    #                                    (it raised on them, the judge gave them no valid verdict): they score
    #                                    the batch's worst total (grpo/objective/advantages.py), never better

    def __post_init__(self):
        n, r = self.per_function.shape
        self.failed = torch.zeros(n, r, dtype=torch.bool) if self.failed is None else self.failed
        self.scored = torch.ones(n, dtype=torch.bool) if self.scored is None else self.scored
        self.worst = torch.zeros(n, dtype=torch.bool) if self.worst is None else self.worst


def _checked(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"non-finite reward {value}")
    if abs(value) > REWARD_LIMIT:
        raise ValueError(f"reward {value} is beyond {REWARD_LIMIT:g} (its group's float32 statistics would overflow)")
    return value


class _Failed:
    """A sample's place where its reward failed on it (it scores the batch's worst, or the fallback),
    or could not be asked about it (it is left out, or given the fallback)."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


FAILED = _Failed("FAILED")  # the reward ran on the sample and gave no valid value: the sample's doing, as far as
#                             anyone can tell (a function that raised or timed out on it, a judge's reply without
#                             a valid verdict, an environment that failed on its messages)
UNSCORED = _Failed("UNSCORED")  # the reward could not be asked: a service down, a session lost; not the sample's doing
FAILURES = (FAILED, UNSCORED)


class WrongCount(ValueError):
    """A batched function returned another number of values than completions: its contract is broken."""


def score_one_function(name: str, fn, call, completions, rows, fallback: float | None, prompts=None,
                       errors: list[str] | None = None) -> tuple[list, int]:
    """(values with None kept, failures). A sample the function raises on, times out on or returns
    a bad value for gets `fallback` (None: FAILED, for the caller to leave out); the failures are
    logged in one line, and each one's description (the error, and where in the user's code it was
    raised) added to `errors` when given. `prompts` (each sample's chat turns) go to a service
    reward alone, which runs here whatever `call` is."""
    errors = [] if errors is None else errors
    values = reward_values(name, fn, call, completions, rows, prompts, errors)
    failures = report_failures(name, values, errors, fallback)
    return [fallback if v in FAILURES and fallback is not None else v for v in values], failures


def reward_values(name: str, fn, call, completions, rows, prompts, errors: list[str]) -> list:
    """Each sample's value: a float, None (does not apply), FAILED or UNSCORED (its description added
    to `errors`)."""
    if is_service(fn):
        return _score_service(name, fn, list(completions), list(rows), prompts, errors)
    if is_batched(fn):
        return _score_batch(name, fn, call, list(completions), list(rows), errors)
    if call is not None and hasattr(call, "map"):  # the sandbox: the samples spread over its wardens
        answers = call.map(name, list(completions), list(rows))
    else:
        answers = [_answer(call, fn, name, completion, row) for completion, row in zip(completions, rows, strict=True)]
    values = []
    for answer in answers:
        try:
            if isinstance(answer, Exception):  # a reward bug must not end a run of hours
                values.append(FAILED)
                errors.append(failure_text(answer))
            else:
                values.append(_checked(answer))
        except Exception as e:  # not a finite number
            values.append(FAILED)
            errors.append(failure_text(e))
    return values


def _answer(call, fn, name: str, completion: str, row: dict):
    """The reward's value for one sample, or the exception it raised."""
    try:
        return call(name, completion, row) if call is not None else fn(completion, row)
    except Exception as e:
        return e


def report_failures(name: str, values: list, errors: list[str], fallback: float | None) -> int:
    """How many values are FAILED or UNSCORED, logged in one line with the first failure."""
    failures = sum(v in FAILURES for v in values)
    if failures:
        then = "the batch's worst where it failed on a sample, left out where it could not be asked" \
            if fallback is None else f"using fallback {fallback}"
        log.warning("reward %s failed on %d of %d samples (%s); %s", name, failures, len(values), errors[0], then)
    return failures


def with_environment_failures(values: list, environment_failures: Sequence[tuple[str, bool] | None],
                              errors: list[str]) -> list:
    """env_reward's values with FAILED where the sample's environment failed on its messages,
    UNSCORED where it could not be asked (it did not open, or a rebuild another episode caused
    replayed otherwise): such an episode has no reward of the environment's to give, not a reward of 0.
    Each entry: (the failure, whether the environment could not be asked) or None where it answered."""
    errors += [f"the environment failed: {failure[0]}" for failure in environment_failures if failure is not None]
    return [v if failure is None else UNSCORED if failure[1] else FAILED
            for v, failure in zip(values, environment_failures, strict=True)]


def _score_service(name: str, fn, completions: list, rows: list, prompts, errors: list) -> list:
    """A service's values: UNSCORED where it could not be asked (no answer after its retries for the
    whole batch, or its breaker open); FAILED where it refused the request (an HTTP 4xx), gave a
    sample no valid value (a judge's reply without a valid verdict), or gave no answer for a sample
    while it answered others of the batch: a completion that makes the judge time out or break
    must not earn a pass, so what the sample carried is at fault as far as anyone can tell."""
    if prompts is None or len(prompts) != len(completions):
        raise ValueError(f"reward {name!r} needs each sample's prompt: score_completions(..., prompts=...)")
    try:
        values = list(fn(completions, rows, list(prompts)))
        if len(values) != len(completions):
            raise WrongCount(f"returned {len(values)} values for {len(completions)} completions")
    except Exception as e:  # a dead service or a model that fails costs this batch's scores, not the run
        errors.append(failure_text(e))
        refused = isinstance(e, ServiceError) and not isinstance(e, Unreachable)  # an HTTP 4xx: the request's doing
        return [FAILED if refused else UNSCORED] * len(completions)
    answered = any(not isinstance(v, Exception) for v in values)  # the service worked for some samples
    checked = []
    for value in values:
        try:
            if isinstance(value, Exception):
                raise value
            checked.append(_checked(value))
        except Unreachable as e:
            errors.append(failure_text(e))
            checked.append(FAILED if answered and not isinstance(e, BreakerOpen) else UNSCORED)
        except Exception as e:
            errors.append(failure_text(e))
            checked.append(FAILED)
    return checked


def _batch_values(name: str, fn, call, completions: list, rows: list) -> list:
    values = list(call(name, completions, rows) if call is not None else fn(completions, rows))
    if len(values) != len(completions):
        raise WrongCount(f"returned {len(values)} values for {len(completions)} completions")
    return [_checked(v) for v in values]


def _score_batch(name: str, fn, call, completions: list, rows: list, errors: list, split: bool = True) -> list:
    """A batched function's values (FAILED where it failed). A call that raises or times out is
    made again on each half of the batch, so one bad sample costs about 2 log2(n) calls and only
    itself; when the first half fails whole, the fault is not one sample's and the second half is
    not split (a function that always hangs costs about 2.5x its batch's time limit). A wrong
    number of values breaks the batch form's contract: the whole batch fails."""
    try:
        return _batch_values(name, fn, call, completions, rows)
    except WrongCount as e:
        errors.append(failure_text(e))
        return [FAILED] * len(completions)
    except Exception as e:
        errors.append(failure_text(e))
    if len(completions) == 1 or not split:
        return [FAILED] * len(completions)
    half = len(completions) // 2
    left = _score_batch(name, fn, call, completions[:half], rows[:half], errors)
    systematic = half > 1 and all(v is FAILED for v in left)
    return left + _score_batch(name, fn, call, completions[half:], rows[half:], errors, split=not systematic)


def _overflowing(scores: torch.Tensor, applies: torch.Tensor, weight: torch.Tensor,
                 failed: torch.Tensor) -> torch.Tensor:
    """bool [N, R]: the weighted rewards of each sample whose total (in float64) is beyond REWARD_LIMIT
    (1e15 with weight 2): each is a failure of those rewards on that sample, never an overflow."""
    terms = scores.double() * applies * weight  # [N, R]
    outside = terms.sum(1).abs() > REWARD_LIMIT  # [N]
    return outside[:, None] & applies & (weight != 0)[None, :] & ~failed & (terms != 0)


def score_completions(completions: Sequence[str], rows: Sequence[dict], names: Sequence[str],
                      weights: Sequence[float], fallback: float | None, call: Callable | None = None,
                      prompts: Sequence | None = None, services: ServiceSettings | None = None,
                      environment_failures: Sequence[tuple[str, bool] | None] | None = None,
                      also: Sequence[str] = ()) -> RewardScores:
    """Score every completion with every reward, never a crash. Where a reward fails on a sample
    (a function that raises, returns a non-finite value or times out on it; a service's invalid
    value; an environment that failed on the episode's messages), the sample scores `fallback`, or,
    with `fallback` None, the batch's worst total (`worst`, grpo.objective.advantages.worst_of_batch:
    no failure ever scores above an honest answer). Where a reward could not be asked (a service
    down, an environment that did not open), the sample gets `fallback`, or with `fallback` None it
    is left out (`scored` False: no advantage from a score nobody gave it). Both are counted (the first
    failure kept in `errors`) and marked in `failed`. A reward of weight 0 (logged only) decides neither.

    `call(name, completion, row)` (or `call(name, completions, rows)` for a batched reward) runs
    the function elsewhere (rewards.sandbox.RewardSandbox, which also times it out). `prompts`
    (each sample's chat turns, data.prompts.Prompt.turns) and `services` (their settings) are for
    the service rewards (rewards/services.py), which run here. `environment_failures`: in
    multi-turn episodes, each sample's environment failure as (what, whether it could not be
    asked), None where it answered; env_reward fails there. `also`: rewards asked of the same samples
    next (the reported checks), which the sandbox may score in the same calls (RewardSandbox.prefetch).
    """
    if call is not None and hasattr(call, "prefetch"):
        call.prefetch([*names, *also], list(completions), list(rows))
    n = len(completions)
    scores = torch.zeros(n, len(names), dtype=torch.float32)
    applies = torch.ones(n, len(names), dtype=torch.bool)
    failed = torch.zeros(n, len(names), dtype=torch.bool)
    unscored = torch.zeros(n, len(names), dtype=torch.bool)
    failures, errors = {}, {}
    for j, name in enumerate(names):
        found: list[str] = []
        values = reward_values(name, get_reward(name, services), call, completions, rows, prompts, found)
        if name == ENV_REWARD and environment_failures is not None:
            values = with_environment_failures(values, environment_failures, found)
        failures[name] = report_failures(name, values, found, fallback)
        if found:
            errors[name] = found[0]
        for i, value in enumerate(values):
            if value in FAILURES:
                failed[i, j], unscored[i, j] = True, value is UNSCORED
                scores[i, j] = 0.0 if fallback is None else fallback
            elif value is None:
                applies[i, j] = False
            else:
                scores[i, j] = value
    weight = torch.tensor(list(weights), dtype=torch.float64)  # [R]
    overflow = _overflowing(scores, applies, weight, failed)  # [N, R]: in a total beyond REWARD_LIMIT
    for j, name in enumerate(names):
        if overflow[:, j].any():
            failed[:, j] |= overflow[:, j]
            scores[overflow[:, j], j] = 0.0 if fallback is None else fallback
            failures[name] += int(overflow[:, j].sum())
            errors.setdefault(name, f"its weighted value puts the sample's total beyond {REWARD_LIMIT:g}")
    total = ((scores.double() * applies) @ weight).float()  # [N]
    if fallback is not None:
        return RewardScores(scores, applies, total, failures, errors, failed)
    weighted = weight != 0  # [R]: a reward only logged decides nothing
    worst = (failed & ~unscored & weighted).any(1)  # [N]
    scored = ~(unscored & weighted).any(1) | worst  # [N]: a failure on the sample outweighs one nobody was asked
    return RewardScores(scores, applies, total, failures, errors, failed, scored, worst)
