"""The config's cross-field rules: every error of a config at once, each naming its keys and
what to do. `grpo.config.load_config` runs `validate` on every config it builds (a
`grpo.config.Config`; not imported here, which would make the two modules import each other)."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.settings.tree import ConfigError, bound_problems, get_key

if TYPE_CHECKING:
    from grpo.config import Config

# Choices that no module of ours implements (they pick a process, DeepSpeed's backend, a log level):
# the config owns these lists. Every other choice list belongs to the module that implements it.
REFERENCE_SOURCES = ("sampler", "trainer")  # training.reference_on: which process computes them
BACKENDS = ("auto", "nccl", "gloo")  # deepspeed.backend; auto: nccl on GPUs, gloo on the CPU
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def option_lists() -> dict[str, tuple]:
    """The valid values of each choice key, from the module that implements the choice (imported
    late: they need torch). Both workers validate, so none of these is a worker's own module."""
    from common.model_files import DTYPES
    from data.problems import ANSWER_FORMATS
    from grpo.environments.pool import NETWORK_MODES
    from grpo.model.logprobs import OLD_LOGPS_SOURCES
    from grpo.objective import ADVANTAGE_SCALES, AGGREGATIONS, IS_MODES, KL_ESTIMATORS
    from grpo.run.tracking import TRACKERS, WANDB_MODES
    from grpo.sampler.rollout import ENGINES
    from grpo.trainer.schedule import SCHEDULES
    from grpo.weights import CHANNELS
    from rewards.registry import ON_FAILURE

    return {
        "model.dtype": tuple(DTYPES),
        "data.answer_format": ANSWER_FORMATS,
        "sampling.dtype": ("auto", *DTYPES),
        "sampling.engine": tuple(ENGINES),
        "sampling.old_logps": OLD_LOGPS_SOURCES,
        "sampling.in_flight_kv": ("recompute", "keep"),
        "training.reference_on": REFERENCE_SOURCES,
        "training.kl_estimator": KL_ESTIMATORS,
        "training.importance_sampling": IS_MODES,
        "training.aggregation": AGGREGATIONS,
        "training.lr_schedule": SCHEDULES,
        "training.advantage_scale": ADVANTAGE_SCALES,
        "deepspeed.backend": BACKENDS,
        "logging.level": LOG_LEVELS,
        "logging.backend": TRACKERS,
        "logging.wandb_mode": WANDB_MODES,
        "env.network": NETWORK_MODES,
        "rewards.on_failure": ON_FAILURE,
        "weights.channel": tuple(CHANNELS),
    }


def is_loopback_address(address: str) -> bool:
    """True for ipc://, inproc:// and tcp:// addresses on 127.0.0.0/8, ::1 or localhost."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    host = address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def validate(cfg: Config, problems: list[str] = ()):
    """All cross-field rules in one place, every error reported at once (after `problems`, those
    found while reading the file and overrides); fills the defaults that depend on other settings
    (the clip range follows training.use_gspo: the objective's defaults, recorded in the run's config)."""
    from grpo.objective import clip_range

    t = cfg.training
    t.clip_low, t.clip_high = clip_range(t.use_gspo, t.clip_low, t.clip_high)
    if cfg.env.tools and not cfg.env.name:  # tools alone: the tool environment runs them
        cfg.env.name = "tools"
    # every field's own range (declared on it: grpo/settings), then the choices, then what spans fields
    errors = [*problems, *bound_problems(cfg), *_choice_errors(cfg)] + _value_errors(cfg) + _reward_errors(cfg) \
        + _env_errors(cfg) + _transport_errors(cfg) + _run_errors(cfg)
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return cfg


def _choice_errors(cfg: Config) -> list[str]:
    return [f"{key} must be one of {', '.join(options)}; got {get_key(cfg, key)!r}"
            for key, options in option_lists().items() if get_key(cfg, key) not in options]


def _value_errors(cfg: Config) -> list[str]:
    publish_every, lora = cfg.weights.publish_every, cfg.lora.enabled
    return (_sampling_errors(cfg.sampling, publish_every, lora) + _data_errors(cfg.data)
            + _training_errors(cfg.training, lora, publish_every) + _model_errors(cfg))


def _sampling_errors(s, publish_every: int, lora_enabled: bool) -> list[str]:
    errors = []
    if not 0 <= s.worker_index < s.num_workers:
        errors.append(f"sampling.worker_index must be in 0 .. sampling.num_workers - 1; got "
                      f"{s.worker_index} and {s.num_workers}")
    if s.in_flight_updates and (not s.continuous_batching or s.old_logps != "generation"):
        errors.append("sampling.in_flight_updates needs sampling.continuous_batching=true and "
                      "sampling.old_logps=generation (a recompute after generation would score every token with "
                      f"the newest weights); got continuous_batching={s.continuous_batching}, old_logps={s.old_logps}")
    if s.in_flight_updates and s.engine == "vllm" and (not lora_enabled or s.in_flight_kv != "recompute"):
        errors.append("sampling.in_flight_updates on vLLM needs lora.enabled=true (its requests move to each new "
                      "adapter; full weights load between steps) and sampling.in_flight_kv=recompute (a moved "
                      f"request's prefix is prefilled again); got lora.enabled={lora_enabled}, "
                      f"in_flight_kv={s.in_flight_kv}")
    if 0 <= s.max_staleness < publish_every - 1:  # step g needs a version >= g - max_staleness
        errors.append(f"sampling.max_staleness={s.max_staleness} cannot hold with weights.publish_every="
                      f"{publish_every}: versions are published every {publish_every} steps, so a step may be "
                      f"{publish_every - 1} versions behind; set sampling.max_staleness >= {publish_every - 1} or "
                      "publish more often")
    return errors


def _data_errors(d) -> list[str]:
    from data.procedural import (  # late: reasoning-gym is imported only for its tasks
        TaskError,
        check_task,
        is_procedural,
    )

    errors = []
    if d.few_shot > 0 and d.answer_format != "gsm8k" and not is_procedural(d.path):
        errors.append(f"data.few_shot={d.few_shot} shows solved problems (GSM8K's worked solutions, or a "
                      "reasoning-gym task's answers): it needs data.answer_format=gsm8k or "
                      "data.path=reasoning-gym:<task>; "
                      "set data.few_shot=0 for your own data")
    if is_procedural(d.path):
        try:
            check_task(d.path, d.task_args)
        except TaskError as e:
            errors.append(str(e))
    elif d.task_args:
        errors.append(f"data.task_args are the settings of a reasoning-gym task; data.path={d.path!r} is none "
                      "(use data.path=reasoning-gym:<task>)")
    return errors


def _training_errors(t, lora_enabled: bool, publish_every: int) -> list[str]:
    errors = []
    if t.reference_on == "trainer" and not lora_enabled:
        errors.append("training.reference_on=trainer needs lora.enabled (the reference is the model with the adapter "
                      "off; a full fine-tune would need a second copy of the model in every rank)")
    if 0 <= t.max_token_age < publish_every - 1:  # some steps' newest tokens would be older than that
        errors.append(f"training.max_token_age={t.max_token_age} with weights.publish_every={publish_every} would "
                      f"leave every token of some steps out of the loss (versions are published every "
                      f"{publish_every} steps); set it >= {publish_every - 1} or publish more often")
    if t.importance_sampling != "none" and t.num_iterations != 1:
        errors.append(f"training.importance_sampling={t.importance_sampling} needs training.num_iterations=1 (the "
                      "proximal log-probs are the trainer's first forward of the step; keeping them for later passes "
                      f"is not built); got {t.num_iterations}")
    return errors


def _model_errors(cfg: Config) -> list[str]:
    errors = []
    if cfg.lora.enabled and not cfg.lora.target_modules:
        errors.append("lora.target_modules is empty; name the modules to adapt or set lora.enabled=false")
    if cfg.model.dtype == "float16" and not cfg.lora.enabled:
        errors.append("model.dtype=float16 full fine-tuning is unstable without loss scaling; use bfloat16")
    if cfg.model.chat_template:
        from common.sources import ModelError
        from grpo.model.loading import TEMPLATES, read_chat_template

        try:
            read_chat_template(cfg.model.chat_template)
            # a file: recorded whole, as the run's config will be read elsewhere
            if cfg.model.chat_template not in TEMPLATES:
                cfg.model.chat_template = str(Path(cfg.model.chat_template).resolve())
        except ModelError as e:
            errors.append(str(e))
    return errors


def _reward_errors(cfg: Config) -> list[str]:
    errors = []
    r = cfg.rewards
    if not r.names:
        errors.append("rewards.names is empty; list at least one reward function")
    if len(r.weights) != len(r.names):
        errors.append(f"rewards.weights has {len(r.weights)} entries but rewards.names has {len(r.names)}; "
                      "give one weight per reward function")
    from rewards.registry import get_reward  # late import: rewards does not depend on config
    from rewards.services import is_service_name

    if "env_reward" in [*r.names, r.accuracy_reward, r.format_reward] and not cfg.env.name:
        errors.append("env_reward is the reward an environment gives its episodes, and env.name is empty: set env.name "
                      "(e.g. calculator; see docs/environments.md) or use another reward")
    named = [("rewards.names", name) for name in r.names]
    for key, name in [*named, ("rewards.accuracy_reward", r.accuracy_reward),
                      ("rewards.format_reward", r.format_reward)]:
        if is_service_name(name):
            errors += _service_errors(cfg, key, name)
            continue
        try:
            get_reward(name)  # imports a user's module now, not at the first step
        except ValueError as e:
            message = str(e).removeprefix("rewards.names: ")
            errors.append(f"{key}: {message}")
    errors += _service_setting_errors(r)
    if not 0 <= r.overlong_buffer < cfg.sampling.max_new_tokens or r.overlong_penalty < 0:
        errors.append(f"rewards.overlong_buffer must be in [0, sampling.max_new_tokens) and rewards.overlong_penalty "
                      f">= 0; got {r.overlong_buffer} and {r.overlong_penalty}")
    return errors


def _service_errors(cfg: Config, key: str, name: str) -> list[str]:
    """A reward model, HTTP reward or judge: checked now (a reward model's config.json is read), not called."""
    from rewards.services import ServiceSettings, service_problems

    if key != "rewards.names":
        return [f"{key}={name} is a service reward; the reported rates are decided by a rule function (a built-in "
                f"or your own 'module:function' that gives >= 1 when the completion passes): name one in {key}"]
    return service_problems(name, ServiceSettings.of(cfg))


def _service_setting_errors(r) -> list[str]:
    import torch

    errors = []
    try:
        torch.device(r.reward_model_device if r.reward_model_device != "auto" else "cpu")
    except RuntimeError:
        errors.append(f"rewards.reward_model_device must be auto, cpu, cuda or cuda:N; got {r.reward_model_device!r}")
    return errors


def _env_errors(cfg: Config) -> list[str]:
    e = cfg.env
    import re

    errors = []

    errors += [f"env.pass_env: {name!r} is not an environment variable's name (letters, digits and _, not "
               "starting with a digit)" for name in e.pass_env
               if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name))]
    errors += _tool_errors(e)
    if e.name:
        from grpo.environments import args_problems, environment_args, environment_factory

        try:
            # imports it now: a bad name fails at start, in both processes
            environment_factory(e.name, environment_args(e))
            errors += args_problems(e.name, e.args)  # a mistyped env.args key, named with the keys it takes
        except (ValueError, ImportError) as error:
            errors.append(str(error))
    # an episode cut at sampling.max_new_tokens is scored on purpose, never a free 0 above losing: its
    # env_reward is env.truncated_reward, or (the default) it scores the batch's worst (grpo/sampler/batches.py)
    if e.truncated_reward is not None:
        import math

        if not math.isfinite(e.truncated_reward):
            errors.append(f"env.truncated_reward must be a finite number; got {e.truncated_reward}")
        if "env_reward" not in cfg.rewards.names:
            errors.append(f"env.truncated_reward={e.truncated_reward:g} is the env_reward of an episode cut at "
                          f"sampling.max_new_tokens, and rewards.names ({', '.join(cfg.rewards.names)}) does not "
                          "hold env_reward: add env_reward to rewards.names (its weight to rewards.weights), or "
                          "unset env.truncated_reward")
    return errors


def _tool_errors(e) -> list[str]:
    """env.tools and env.tool_parser: each tool imported and its schema built now."""
    from grpo.environments.tool_calls import PARSERS

    errors = []
    if e.tool_parser not in PARSERS:
        errors.append(f"env.tool_parser must be one of {', '.join(PARSERS)}; got {e.tool_parser!r}")
    if e.name == "tools" and not e.tools:
        errors.append("env.name=tools needs env.tools: the functions the model may call ('package.module:function')")
    elif e.tools and e.name != "tools":
        errors.append(f"env.tools is set, and env.name is {e.name!r}: tools run in the tool environment; leave "
                      "env.name empty (or 'tools'), or clear env.tools")
    elif e.tools:
        from grpo.environments.tools import SETTINGS, tool_schemas

        unknown = sorted(set(e.args) - set(SETTINGS))
        if unknown:
            errors.append(f"env.args: {', '.join(unknown)} unknown for the tool environment; "
                          f"valid: {', '.join(SETTINGS)}")
        max_calls = e.args.get("max_calls", 0)  # absent: the environment's default
        if not (isinstance(max_calls, int) and max_calls >= 0):
            errors.append(f"env.args.max_calls must be an integer >= 0; got {max_calls!r}")

        try:
            tool_schemas(list(e.tools))
        except (ValueError, ImportError) as error:
            errors.append(str(error))
    return errors


def _transport_errors(cfg: Config) -> list[str]:
    from grpo.wire.transport import transport_name

    tr = cfg.transport
    try:
        transport_name(tr.address)
    except ValueError as e:
        return [str(e)]
    if not is_loopback_address(tr.address) and not (tr.secret or os.environ.get("GRPO_TRANSPORT_SECRET")) \
            and not tr.allow_insecure:
        return [f"transport.address {tr.address} is not loopback: set transport.secret (or "
                "GRPO_TRANSPORT_SECRET) to sign messages, or transport.allow_insecure=true"]
    return []


def _run_errors(cfg: Config) -> list[str]:
    """How a run starts and where its trainer ranks find work."""
    from common.files import is_checkpoint_folder

    errors = []
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never") and not is_checkpoint_folder(resume):
        errors.append(f"checkpoint.resume must be auto, never or a checkpoint folder (one holding DeepSpeed's "
                      f"'latest' file, e.g. runs/<name>/checkpoints); got {resume!r}")
    ranks, groups = cfg.launch.trainer_ranks, cfg.sampling.prompts_per_step
    if ranks > groups:
        errors.append(f"launch.trainer_ranks={ranks} is more than sampling.prompts_per_step={groups}: each rank "
                      f"trains whole groups, so {ranks - groups} rank(s) would have nothing to do; raise "
                      f"sampling.prompts_per_step to >= {ranks} or lower launch.trainer_ranks")
    return errors
