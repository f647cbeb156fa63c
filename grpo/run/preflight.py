"""What the launcher checks before it starts anything, and --dry-run reports: each thing that would
stop a run later is found now and said in one line with its fix (grpo/config has refused a bad
config already). Each check returns its problems; the launcher decides what is an error. One check,
`named_code_problems`, every process runs: what the config names is imported and built."""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

import torch

from grpo.common.sources import ModelError
from grpo.data.mixture import evaluation_source, source_configs
from grpo.data.procedural import TaskError, check_task, is_procedural
from grpo.settings.tree import get_key

if TYPE_CHECKING:
    from grpo.settings import Config, SamplingConfig

CUDA_KEYS = ("sampling.device", "rewards.reward_model_device")


def source_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the model and the data: the model can be had, the data source exists,
    and its first rows parse with the configured columns and answer format."""
    from grpo.common.sources import SourceError, check_model_source
    from grpo.data.problems import check_rows, check_source

    problems, warnings = [], []
    evaluated, training = evaluation_source(cfg.data), source_configs(cfg.data)
    read = [(source, source.split) for source in training]
    read += [(evaluated, cfg.eval.split)] if cfg.eval.every or cfg.data.eval_path else []
    teacher = [lambda: check_model_source(cfg.distill.teacher)] if cfg.distill.teacher else []
    for check in [lambda: check_model_source(cfg.model.name_or_path), *teacher,
                  *[lambda s=s, split=split: check_source(s.path, split, s.task_args) for s, split in read]]:
        try:
            check()
        except SourceError as e:
            problems.append(str(e))
    if not problems:
        for source, split in read:
            try:
                warning = check_rows(source, split)
            except SourceError as e:
                problems.append(str(e))
                continue
            if warning:
                warnings.append(warning)
    return problems, warnings


def vllm_problem(sampling: SamplingConfig, sampler_python: str) -> str | None:
    """sampling.engine=vllm with no vLLM to run it: neither sampling.vllm.python nor this Python has it."""
    if sampling.engine != "vllm" or sampler_python != sys.executable:
        return None  # the vLLM environment exists (make install-vllm checked that vllm imports there)
    if importlib.util.find_spec("vllm") is not None:
        return None
    return (f"sampling.engine=vllm needs vLLM, and neither sampling.vllm.python={sampling.vllm.python} exists nor "
            f"does {sys.executable} have it: run `make install-vllm` (the CUDA build where nvidia-smi sees a GPU, "
            "the CPU build elsewhere), or set sampling.engine=hf")


def device_problems(cfg: Config, gpus: int) -> list[str]:
    """Settings that need a CUDA GPU, on a machine (or plan) with none."""
    if gpus > 0:
        return []
    wanted = [f"{key}={get_key(cfg, key)}" for key in CUDA_KEYS if str(get_key(cfg, key)).startswith("cuda")]
    if cfg.deepspeed.backend == "nccl":
        wanted.append("deepspeed.backend=nccl")
    return [f"{setting} needs a CUDA GPU and this machine has none (torch sees no GPU): set it to auto, or run on a "
            "machine with a GPU" for setting in wanted]


def planning_note(gpus_planned: int, gpus_here: int) -> str | None:
    """--gpus N plans for another machine: say so when this one could not run that plan."""
    if gpus_planned == gpus_here or gpus_planned == 0:
        return None
    here = "no GPU" if gpus_here == 0 else f"{gpus_here} GPU{'s' * (gpus_here != 1)}"
    return (f"this plan is for {gpus_planned} GPU{'s' * (gpus_planned != 1)} (--gpus {gpus_planned}); this machine "
            f"has {here}, and a start here is planned for what it has")


def named_code_problems(cfg: Config) -> list[str]:
    """What is wrong with what the config names (its rewards, environment, tools, template, task),
    each imported and built now: the launcher, --dry-run, both workers and an evaluation load their
    config with it (`parse_cli(..., checks=[named_code_problems])`), so that a mistake stops at the
    start, reported with the config's other problems, never at the first step."""
    return [*_data_problems(cfg.data), *_model_problems(cfg.model.chat_template), *_reward_problems(cfg),
            *_environment_problems(cfg.env), *_objective_problems(cfg.training), *_agent_problems(cfg.agent)]


def _agent_problems(agent) -> list[str]:
    """agent.entrypoint imported now: a function of (row, base_url, api_key); agent.command and agent.verifiers:
    their jail possible here."""
    from grpo.common.imports import ImportPathError, import_object, is_import_path

    if agent.command or agent.verifiers:
        from grpo.common.kernel_filters import landlock_abi

        which = "agent.command" if agent.command else "agent.verifiers"
        abi = landlock_abi()  # the jail's one port: a Landlock rule on TCP ports
        return [] if abi >= 4 else [f"{which} runs in a jail whose network is one TCP port, which needs the "
                                    f"kernel's Landlock ABI 4 (Linux 6.7); this kernel has {abi or 'none'}: use "
                                    "agent.entrypoint, which runs in the sampler"]
    if not agent.entrypoint or not is_import_path(agent.entrypoint):
        return []
    try:
        import_object(agent.entrypoint, "agent.entrypoint")
    except ImportPathError as e:
        return [str(e)]
    return []


def _objective_problems(training) -> list[str]:
    """A user's advantage estimator or policy loss (training.advantage, training.loss), imported now."""
    from grpo.common.imports import ImportPathError, import_object, is_import_path

    problems = []
    for key in ("advantage", "loss"):
        if is_import_path(getattr(training, key)):
            try:
                import_object(getattr(training, key), f"training.{key}")
            except ImportPathError as e:
                problems.append(str(e))
    return problems


def _data_problems(data) -> list[str]:
    problems = []
    for source in filter(lambda source: is_procedural(source.path), source_configs(data)):
        try:
            check_task(source.path, source.task_args)  # imports reasoning-gym and builds the task
        except TaskError as e:
            problems.append(str(e))
    return problems


def _model_problems(chat_template: str | None) -> list[str]:
    from grpo.model.loading import read_chat_template

    if not chat_template:
        return []
    try:
        read_chat_template(chat_template)
    except ModelError as e:
        return [str(e)]
    return []


def _reward_problems(cfg: Config) -> list[str]:
    """Each reward imported (a user's module now, not at the first step) or, a service, checked without
    calling it (a reward model's config.json is read)."""
    from grpo.rewards.registry import get_reward
    from grpo.rewards.services import ServiceSettings, is_service_name, service_problems

    rewards, problems = cfg.rewards, []
    for key, name in [*[("rewards.names", name) for name in rewards.names],
                      ("rewards.accuracy_reward", rewards.accuracy_reward),
                      ("rewards.format_reward", rewards.format_reward)]:
        if is_service_name(name):
            problems += service_problems(name, ServiceSettings.of(cfg)) if key == "rewards.names" else []
            continue
        try:
            get_reward(name)
        except ValueError as e:
            problems.append(f"{key}: {str(e).removeprefix('rewards.names: ')}")
    try:
        torch.device(rewards.reward_model_device if rewards.reward_model_device != "auto" else "cpu")
    except RuntimeError:
        problems.append(f"rewards.reward_model_device must be auto, cpu, cuda or cuda:N; got "
                        f"{rewards.reward_model_device!r}")
    return problems


def _environment_problems(env) -> list[str]:
    """The environment built (its module imported, its env.args checked) and each tool's schema made."""
    from grpo.environments import args_problems, environment_args, environment_factory

    problems = []
    if env.tools:
        from grpo.environments.tools import SETTINGS, tool_schemas

        unknown = sorted(set(env.args) - set(SETTINGS))
        if unknown:
            problems.append(f"env.args: {', '.join(unknown)} unknown for the tool environment; "
                            f"valid: {', '.join(SETTINGS)}")
        try:
            tool_schemas(list(env.tools))
        except (ValueError, ImportError) as error:
            problems.append(str(error))
    if env.name:
        try:
            environment_factory(env.name, environment_args(env))  # imports it now: a bad name fails at start
            problems += args_problems(env.name, env.args)  # a mistyped env.args key, named with the keys it takes
        except (ValueError, ImportError) as error:
            problems.append(str(error))
    return problems
