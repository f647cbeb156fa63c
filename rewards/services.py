"""Rewards that are services rather than functions: a reward model (`reward_model:<folder or Hub
id>`, rewards/reward_model.py), an HTTP endpoint (`http://...`, rewards/remote.py) and an LLM judge
(`judge`, rewards/judge.py).

A service reward is called once per batch as `fn(completions, rows, prompts)` (prompts: each
sample's chat turns) and returns one float, None (does not apply) or ServiceError (that sample
failed) per completion. It is marked `service = True` and runs in the sampler process itself,
not in the rewards sandbox child (rewards/sandbox.py): a model on the GPU or an open connection
does not belong in a forked child that is killed on a timeout, and each has its own time limit
(the judge and the endpoint: rewards.remote_timeout_s, retries and a circuit breaker,
rewards/http_json.py; a model does not hang).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass
from typing import Any, Callable

from grpo.rewards.judge import Judge, pattern_problem
from grpo.rewards.remote import RemoteReward, is_url, url_problem
from grpo.rewards.reward_model import PREFIX as REWARD_MODEL

JUDGE = "judge"


@dataclass(frozen=True)
class ServiceSettings:
    """What the service rewards need from the config, built once per process (`of`) and passed. The
    judge's settings are the config's rewards.judge section as it is (url, model, prompt, pattern,
    api_key_env, max_tokens, temperature, concurrency, range: grpo/settings documents each); a
    section is not hashable, so neither is this (the loaded services are cached by their values)."""

    device: str  # of the reward model
    dtype: str
    batch_size: int
    timeout_s: float  # of each HTTP request
    retries: int
    cache_dir: str | None
    trust_remote_code: bool
    judge: Any

    @classmethod
    def of(cls, cfg) -> "ServiceSettings":
        """From a grpo.config.Config: the reward model on rewards.reward_model_device ("auto": the
        sampler's device) in model.dtype."""
        rewards = cfg.rewards
        device = cfg.sampling.device if rewards.reward_model_device == "auto" else rewards.reward_model_device
        return cls(device, cfg.model.dtype, rewards.reward_model_batch_size, rewards.remote_timeout_s,
                   rewards.remote_retries, cfg.model.cache_dir, cfg.model.trust_remote_code, rewards.judge)


@dataclass(frozen=True)
class Service:
    """One kind of service reward: which names are it, how it loads (once per process for the same
    settings), what is wrong with a name and its settings (found at start, each naming its config key),
    and what it needs at the sampler's start besides loading (an API key)."""

    matches: Callable[[str], bool]
    load: Callable[[str, ServiceSettings], Any]
    problems: Callable[[str, ServiceSettings], list[str]]
    ready: Callable[[str, ServiceSettings], None] = lambda name, settings: None


def _load_reward_model(name: str, s: ServiceSettings):
    from grpo.rewards.reward_model import load_reward_model

    return load_reward_model(name.removeprefix(REWARD_MODEL), s.device, s.dtype, s.batch_size, s.cache_dir,
                             s.trust_remote_code)


def _reward_model_problems(name: str, s: ServiceSettings) -> list[str]:
    from grpo.rewards.reward_model import RewardModelError, check_classifier

    try:
        check_classifier(name.removeprefix(REWARD_MODEL), s.cache_dir, s.trust_remote_code)
    except RewardModelError as e:
        return [f"rewards.names: {e}"]
    return []


def _judge_key_ready(name: str, s: ServiceSettings) -> None:
    key = s.judge.api_key_env
    if key and key not in os.environ:
        raise ServiceStartError(f"rewards.judge.api_key_env names {key}, which is not set in the sampler's "
                                "environment: export it before starting")


_LOADED: dict[str, Any] = {}  # loaded once per process for the same settings (a judge keeps its breaker)


def _once(key: list, make: Callable[[], Any]):
    text = json.dumps(key, sort_keys=True)
    if text not in _LOADED:
        _LOADED[text] = make()
    return _LOADED[text]


# a judge keeps a copy of its settings: a config changed later in this process does not change it
SERVICES = {
    "reward_model": Service(lambda name: name.startswith(REWARD_MODEL), _load_reward_model, _reward_model_problems),
    "judge": Service(lambda name: name == JUDGE,
                     lambda name, s: _once([name, vars(s.judge), s.timeout_s, s.retries],
                                           lambda: Judge(copy.deepcopy(s.judge), s.timeout_s, s.retries)),
                     lambda name, s: judge_problems(s.judge), _judge_key_ready),
    "http": Service(is_url, lambda name, s: _once([name, None, s.timeout_s, s.retries],
                                                  lambda: RemoteReward(name, s.timeout_s, s.retries)),
                    lambda name, s: [f"rewards.names: {p}" for p in [url_problem(name)] if p]),
}


def service_of(name: str) -> Service | None:
    """The kind of service reward `name` is (SERVICES), None for a function."""
    return next((service for service in SERVICES.values() if service.matches(name)), None)


def is_service_name(name: str) -> bool:
    return service_of(name) is not None


def is_service(fn) -> bool:
    return getattr(fn, "service", False) is True


def service_reward(name: str, settings: ServiceSettings | None):
    """The service reward `name` names (loaded once per process for the same settings)."""
    if settings is None:
        raise ValueError(f"reward {name!r} is a service (reward model, HTTP endpoint or judge): score it with "
                         "score_completions(..., prompts=..., services=ServiceSettings.of(cfg))")
    return service_of(name).load(name, settings)


class ServiceStartError(ValueError):
    """A service reward the sampler cannot start with (a judge's API key not in its environment)."""


def start_services(names: list[str], settings: ServiceSettings) -> None:
    """The service rewards of rewards.names made ready in the sampler, at its start, not at its first
    step: a reward model loaded, a judge's API key found in the environment (only the sampler needs
    it: the trainer, an export or an evaluation of the run load the same config without it).
    ServiceStartError or RewardModelError naming what is missing."""
    for name in filter(is_service_name, names):
        service_of(name).ready(name, settings)
        service_reward(name, settings)


def service_problems(name: str, settings: ServiceSettings) -> list[str]:
    """What is wrong with a service reward's name (in rewards.names) and settings, each problem
    naming its config key; found at start without loading a model or calling anything (a reward
    model's config.json is read)."""
    return service_of(name).problems(name, settings)


def judge_problems(j) -> list[str]:
    if not j.url:
        return ["rewards.names holds 'judge', which needs rewards.judge.url, an OpenAI-compatible endpoint (e.g. "
                "rewards.judge.url=http://127.0.0.1:8000/v1, which serves /v1/chat/completions), "
                "and rewards.judge.model"]
    problems = [f"rewards.judge.url: {p}" for p in [url_problem(j.url)] if p]
    if j.url.rstrip("/").endswith("/chat/completions"):
        problems.append(f"rewards.judge.url={j.url} names the endpoint; give its base, e.g. "
                        f"{j.url.rstrip('/').removesuffix('/chat/completions')} (/chat/completions is added)")
    if not j.model:
        problems.append("rewards.judge.model is empty: name the model the endpoint serves (its /v1/models lists them)")
    if "{completion}" not in j.prompt:
        problems.append("rewards.judge.prompt has no {completion}: the judge would not see what it judges")
    problems += [p for p in [pattern_problem(j.pattern)] if p]
    if j.max_tokens < 1 or j.concurrency < 1:
        problems.append(f"rewards.judge.max_tokens and rewards.judge.concurrency must be >= 1; got {j.max_tokens} "
                        f"and {j.concurrency}")
    if len(j.range) != 2 or not j.range[0] < j.range[1]:
        problems.append(f"rewards.judge.range must be [low, high] with low < high (the verdicts the judge may give, "
                        f"e.g. [0, 10]); got {list(j.range)}")
    return problems
