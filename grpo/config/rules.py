"""The config's cross-field rules: every error of a config at once, each naming its keys and
what to do. `grpo.config.load_config` runs `validate` on every config it builds (a
`grpo.config.Config`; not imported here, which would make the two modules import each other).
Each field's own range and choices are declared on it (grpo/settings) and checked by
`field_problems`; what needs the modules that implement a setting, or a user's code (rewards,
environments, tools, templates, reasoning-gym tasks), is checked by `grpo.run.preflight`, which
the launcher and both workers run. This module imports nothing of the trainer above the settings."""

from __future__ import annotations

import ipaddress
import math
import os
import re
import shlex
import shutil
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from grpo.common.files import is_checkpoint_folder
from grpo.common.verifiers_bridge import PREFIX as VERIFIERS_PREFIX
from grpo.common.verifiers_bridge import VerifiersError, is_verifiers, readable_for, verifiers_python
from grpo.data.code_tasks import is_code_tasks
from grpo.data.images import has_images
from grpo.data.mixture import source_configs
from grpo.data.mixture import source_problems as mixture_entry_problems
from grpo.data.procedural import is_procedural
from grpo.data.shapes import is_shapes
from grpo.settings import ALL_LINEAR, SHIPPED_CHAT_TEMPLATES, TRANSPORT_SCHEMES, clip_range
from grpo.settings.choices import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, name_or_import_path_problem
from grpo.settings.engines import ENGINE_TRAITS
from grpo.settings.tree import ConfigError, field_problems

if TYPE_CHECKING:
    from grpo.config import Config


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


def validate(cfg: Config, problems: list[str] = (), checks: Sequence[Callable[[Config], list[str]]] = ()):
    """All cross-field rules in one place, every error reported at once (after `problems`, those
    found while reading the file and overrides, and with those of `checks`: the caller's, e.g.
    grpo.run.preflight.named_code_problems); fills the defaults that depend on other settings
    (the clip range follows training.use_gspo: the objective's defaults, recorded in the run's config)."""
    training = cfg.training
    training.clip_low, training.clip_high = clip_range(training.use_gspo, training.clip_low, training.clip_high,
                                                       training.loss)
    if cfg.env.tools and not cfg.env.name:  # tools alone: the tool environment runs them
        cfg.env.name = "tools"
    # every field's own range (declared on it: grpo/settings), then the choices, then what spans fields
    errors = [*problems, *field_problems(cfg)] + _value_errors(cfg) + _reward_errors(cfg) + _env_errors(cfg) \
        + _image_errors(cfg) \
        + _transport_errors(cfg.transport) + _run_errors(cfg) + [problem for check in checks for problem in check(cfg)]
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))
    return cfg


def _value_errors(cfg: Config) -> list[str]:
    publish_every, lora = cfg.weights.publish_every, cfg.lora.enabled
    return (_sampling_errors(cfg.sampling, publish_every, lora) + _data_errors(cfg.data)
            + _training_errors(cfg.training, lora, publish_every) + _model_errors(cfg) + _distill_errors(cfg))


def _distill_errors(cfg: Config) -> list[str]:
    distill, errors = cfg.distill, []
    if distill.teacher and not distill.with_rewards and cfg.sampling.dynamic_sampling:
        errors.append("sampling.dynamic_sampling drops the groups whose rewards are all equal, but with "
                      "distill.teacher and distill.with_rewards=false the rewards do not enter the advantages "
                      "(every group has the teacher's signal); turn one of them off")
    if distill.teacher and not distill.with_rewards and cfg.training.kl_in == "reward" and cfg.training.beta > 0:
        errors.append("training.kl_in=reward puts the KL in the rewards' advantage, which distill.with_rewards=false "
                      "leaves out: the run would have no KL term; set training.kl_in=loss or distill.with_rewards=true")
    if distill.served_name and distill.teacher_url is None:
        errors.append("distill.served_name names the teacher on its server: it needs distill.teacher_url")
    if distill.teacher_url is not None:
        if not distill.teacher:
            errors.append("distill.teacher_url needs distill.teacher: the model the server serves (its tokenizer "
                          "is checked against the model's; the requests name it unless distill.served_name is set)")
        if not distill.teacher_url.startswith(("http://", "https://")) or not _has_valid_port(distill.teacher_url):
            errors.append(f"distill.teacher_url must be an http:// or https:// URL, e.g. http://host:8000/v1; got "
                          f"{distill.teacher_url!r}")
        if cfg.sampling.temperature != 1.0:
            errors.append("distill.teacher_url: the server's prompt log-probs are the teacher's at temperature 1, "
                          "and the student samples at sampling.temperature="
                          f"{cfg.sampling.temperature:g}; set sampling.temperature=1.0, or load the teacher in the "
                          "sampler (distill.teacher without teacher_url), where it is scored at the sampling "
                          "temperature")
    return errors


def _has_valid_port(url: str) -> bool:
    try:
        urllib.parse.urlsplit(url).port  # ValueError for a port that is not a number in 0 .. 65535
    except ValueError:
        return False
    return True


def _sampling_errors(sampling, publish_every: int, lora_enabled: bool) -> list[str]:
    errors = []
    if not 0 <= sampling.worker_index < sampling.num_workers:
        errors.append(f"sampling.worker_index must be in 0 .. sampling.num_workers - 1; got "
                      f"{sampling.worker_index} and {sampling.num_workers}")
    if sampling.in_flight_updates and (not sampling.continuous_batching or sampling.old_logps != "generation"):
        errors.append("sampling.in_flight_updates needs sampling.continuous_batching=true and "
                      "sampling.old_logps=generation (a recompute after generation would score every token with "
                      f"the newest weights); got continuous_batching={sampling.continuous_batching}, "
                      f"old_logps={sampling.old_logps}")
    engine = ENGINE_TRAITS[sampling.engine]
    if sampling.in_flight_updates and ((engine.in_flight_needs_lora and not lora_enabled)
                                       or sampling.in_flight_kv not in engine.in_flight_kv):
        errors.append(f"sampling.in_flight_updates on {sampling.engine} needs "
                      + ("lora.enabled=true (its requests move to each new adapter; full weights load between "
                         "steps) and " if engine.in_flight_needs_lora else "")
                      + f"sampling.in_flight_kv in {list(engine.in_flight_kv)} (a moved request's prefix is prefilled "
                      f"again); got lora.enabled={lora_enabled}, in_flight_kv={sampling.in_flight_kv}")
    if sampling.compile_decode and sampling.engine != "hf":
        errors.append(f"sampling.compile_decode is the HF engine's; {sampling.engine} compiles its own decode steps "
                      "(CUDA graphs on a GPU): leave it false")
    if any(not stop for stop in sampling.stop):
        errors.append("sampling.stop holds an empty string, which every text holds: each completion would end "
                      "after its first token; remove it")
    if sampling.stop and sampling.in_flight_updates and not engine.stop_with_in_flight:
        errors.append(f"sampling.stop with sampling.in_flight_updates on {sampling.engine}: a request moved to a new "
                      "adapter is made again from its tokens, and the text it had already matched is not seen again; "
                      "use one of them")
    if 0 <= sampling.max_staleness < publish_every - 1:  # step g needs a version >= g - max_staleness
        errors.append(f"sampling.max_staleness={sampling.max_staleness} cannot hold with weights.publish_every="
                      f"{publish_every}: versions are published every {publish_every} steps, so a step may be "
                      f"{publish_every - 1} versions behind; set sampling.max_staleness >= {publish_every - 1} or "
                      "publish more often")
    return errors


def _image_errors(cfg: Config) -> list[str]:
    """What prompts with images do not run with yet: vLLM, episodes, tools, agent sessions and a distillation teacher
    (text alone)."""
    entries = [e for e in cfg.data.sources if isinstance(e, dict)]  # a malformed entry is _data_errors' to name
    if not (has_images(cfg.data) or any(is_shapes(e.get("path")) for e in entries)):
        return ["model.train_vision trains a vision-language model's vision encoder, and this run's prompts hold no "
                "images (data.image_column, data.path: shapes)"] if cfg.model.train_vision else []
    errors = []
    if cfg.sampling.engine == "vllm":
        errors.append("prompts with images (data.image_column, data.path=shapes) run on sampling.engine=hf; vLLM "
                      "takes text prompts here")
    if cfg.env.name or cfg.agent.harness:
        errors.append("prompts with images run as single completions; episodes, tools and agent sessions "
                      "(env.name, env.tools, agent.*) take text prompts")
    if cfg.distill.teacher:
        errors.append("prompts with images and distill.teacher: the teacher scores text prompts here")
    if cfg.model.attn_implementation == "flex_attention":
        errors.append("prompts with images and model.attn_implementation=flex_attention: transformers' Qwen2-VL and "
                      "Qwen2.5-VL do not take FlexAttention; use sdpa")
    return errors


def _data_errors(data) -> list[str]:
    errors = [problem for entry in data.sources for problem in mixture_entry_problems(entry)]
    if errors:
        return errors
    for source in source_configs(data):  # data itself, or each of data.sources with its own keys
        named = f"data.sources: {source.path}: " if data.sources else ""
        if source.few_shot > 0 and is_verifiers(source.path):
            errors.append(f"{named}data.few_shot={source.few_shot} shows solved problems before each question, and a "
                          "verifiers environment's prompt is its own (its few-shot turns are in it): set "
                          "data.few_shot=0")
        elif source.few_shot > 0 and source.answer_format != "gsm8k" and not is_procedural(source.path):
            errors.append(f"{named}data.few_shot={source.few_shot} shows solved problems (GSM8K's worked solutions, "
                          "or a reasoning-gym task's answers): it needs data.answer_format=gsm8k or "
                          "data.path=reasoning-gym:<task>; set data.few_shot=0 for your own data")
        if source.task_args and not (is_procedural(source.path) or is_code_tasks(source.path)
                                     or is_shapes(source.path) or is_verifiers(source.path)):
            errors.append(f"{named}data.task_args are the settings of a reasoning-gym task, of code-tasks, of "
                          f"shapes or of a verifiers environment; data.path={source.path!r} is none of them (use "
                          "data.path=reasoning-gym:<task>, code-tasks, shapes or verifiers:<env>)")
    return errors


def _training_errors(training, lora_enabled: bool, publish_every: int) -> list[str]:
    errors = []
    if training.reference_on == "trainer" and not lora_enabled:
        errors.append("training.reference_on=trainer needs lora.enabled (the reference is the model with the adapter "
                      "off; a full fine-tune would need a second copy of the model in every rank)")
    if 0 <= training.max_token_age < publish_every - 1:  # some steps' newest tokens would be older than that
        errors.append(f"training.max_token_age={training.max_token_age} with weights.publish_every={publish_every} "
                      f"would leave every token of some steps out of the loss (versions are published every "
                      f"{publish_every} steps); set it >= {publish_every - 1} or publish more often")
    if training.kl_in == "reward" and training.beta == 0:
        errors.append("training.kl_in=reward with training.beta=0 puts no KL in the reward; set training.beta > 0 "
                      "(veRL's kl_ctrl.kl_coef, OpenRLHF's init_kl_coef) or leave training.kl_in=loss")
    if training.kl_in == "reward" and training.kl_estimator != "k1":
        errors.append(f"training.kl_in=reward needs training.kl_estimator=k1 (got {training.kl_estimator}): as a "
                      "reward only k1's expectation has the KL's gradient; k2 and k3 would push the policy off the "
                      "reference's support (veRL's kl_penalty=kl and OpenRLHF's k1 in the reward are k1)")
    if training.kl_in == "reward" and lora_enabled and training.reference_on == "trainer":
        errors.append("training.kl_in=reward needs training.reference_on=sampler: the sampler subtracts each "
                      "completion's KL from its score, so it computes the reference log-probs")
    if training.importance_sampling != "none" and training.num_iterations != 1:
        errors.append(f"training.importance_sampling={training.importance_sampling} needs training.num_iterations=1 "
                      "(the proximal log-probs are the trainer's first forward of the step; keeping them for later "
                      f"passes is not built); got {training.num_iterations}")
    for key, names in (("advantage", ADVANTAGE_ESTIMATORS), ("loss", POLICY_LOSSES)):
        # an import path is imported at the start (grpo.run.preflight)
        errors += filter(None, [name_or_import_path_problem(f"training.{key}", getattr(training, key), names)])
    if training.advantage_scale != "group" and training.advantage != "grpo":
        errors.append(f"training.advantage_scale={training.advantage_scale} scales grpo's advantages; training."
                      f"advantage={training.advantage} scales its own: leave training.advantage_scale at group")
    return errors


def _model_errors(cfg: Config) -> list[str]:
    errors = []
    lora = cfg.lora
    if lora.enabled and not lora.target_modules:
        errors.append("lora.target_modules is empty; name the modules to adapt or set lora.enabled=false")
    targets = lora.target_modules
    if (isinstance(targets, str) and targets != ALL_LINEAR) or (isinstance(targets, list) and ALL_LINEAR in targets
                                                                 and len(targets) > 1):
        errors.append(f"lora.target_modules must be a list of module names or {ALL_LINEAR} alone; got {targets!r}")
    if lora.enabled and lora.use_dora and cfg.deepspeed.zero_stage == 3:
        errors.append("lora.use_dora with deepspeed.zero_stage=3: DoRA reads each base weight outside its layer's "
                      "forward, where ZeRO-3 holds only a shard of it; use zero_stage 2 or lower, or plain LoRA")
    serves_extras = ENGINE_TRAITS[cfg.sampling.engine].adapter_extras
    if lora.enabled and not serves_extras and (lora.use_dora or lora.modules_to_save):
        errors.append(f"sampling.engine={cfg.sampling.engine} cannot serve an adapter with " + " and ".join(
            [*(["lora.use_dora=true"] if lora.use_dora else []),
             *([f"lora.modules_to_save={list(lora.modules_to_save)}"] if lora.modules_to_save else [])])
            + " (vLLM loads plain LoRA adapters only); use sampling.engine=hf, or train without them")
    if cfg.model.dtype == "float16" and not cfg.lora.enabled:
        errors.append("model.dtype=float16 full fine-tuning is unstable without loss scaling; use bfloat16")
    template = cfg.model.chat_template
    if template and template not in SHIPPED_CHAT_TEMPLATES and Path(template).is_file():
        cfg.model.chat_template = str(Path(template).resolve())  # recorded whole: the run's config is read elsewhere
    return errors


CODE_REWARDS = ("unit_tests", "unit_tests_partial")  # built-ins that run the model's code


def _reward_errors(cfg: Config) -> list[str]:
    """The rewards' settings together; each reward is imported (or its service checked) in grpo.run.preflight."""
    from grpo.rewards.services import is_service_name  # late: the rewards' modules load torch

    errors, rewards = [], cfg.rewards
    if not rewards.names:
        errors.append("rewards.names is empty; list at least one reward function")
    if len(rewards.weights) != len(rewards.names):
        errors.append(f"rewards.weights has {len(rewards.weights)} entries but rewards.names has "
                      f"{len(rewards.names)}; give one weight per reward function")
    if ("env_reward" in [*rewards.names, rewards.accuracy_reward, rewards.format_reward] and not cfg.env.name
            and not cfg.agent.harness):
        errors.append("env_reward is the reward an environment (or your agent loop) gives its episodes, and "
                      "env.name, agent.entrypoint and agent.command are empty: set one (see docs/environments.md) or "
                      "use another reward")
    for key in ("accuracy_reward", "format_reward"):
        name = getattr(rewards, key)
        if is_service_name(name):
            errors.append(f"rewards.{key}={name} is a service reward; the reported rates are decided by a rule "
                          "function (a built-in or your own 'module:function' that gives >= 1 when the completion "
                          f"passes): name one in rewards.{key}")
    runs_code = list(dict.fromkeys(n for n in [*rewards.names, rewards.accuracy_reward, rewards.format_reward]
                                   if n in CODE_REWARDS))
    if runs_code and rewards.timeout_s <= 0:
        errors.append(f"the rewards name {', '.join(runs_code)}, which runs the model's code: it runs only in the "
                      "rewards' jail, and rewards.timeout_s=0 scores in the sampler; set rewards.timeout_s > 0")
    if not 0 <= rewards.overlong_buffer < cfg.sampling.max_new_tokens or rewards.overlong_penalty < 0:
        errors.append(f"rewards.overlong_buffer must be in [0, sampling.max_new_tokens) and rewards.overlong_penalty "
                      f">= 0; got {rewards.overlong_buffer} and {rewards.overlong_penalty}")
    return errors


def _env_errors(cfg: Config) -> list[str]:
    env = cfg.env
    errors = [f"env.pass_env: {name!r} is not an environment variable's name (letters, digits and _, not "
              "starting with a digit)" for name in env.pass_env
              if not (isinstance(name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name))]
    if env.name and cfg.sampling.stop:
        errors.append(f"sampling.stop ends a completion, and env.name={env.name} makes episodes, whose turns end at "
                      "the chat template's turn end (the environment answers then): unset sampling.stop")
    if env.name == "tools" and not env.tools:
        errors.append("env.name=tools needs env.tools: the functions the model may call ('package.module:function')")
    elif env.tools and env.name != "tools":
        errors.append(f"env.tools is set, and env.name is {env.name!r}: tools run in the tool environment; leave "
                      "env.name empty (or 'tools'), or clear env.tools")
    elif env.tools:
        max_calls = env.args.get("max_calls", 0)  # absent: the environment's default
        if not (isinstance(max_calls, int) and max_calls >= 0):
            errors.append(f"env.args.max_calls must be an integer >= 0; got {max_calls!r}")
    # an episode cut at sampling.max_new_tokens is scored on purpose, never a free 0 above losing: its
    # env_reward is env.truncated_reward, or (the default) it scores the batch's worst (grpo/sampler/batches.py)
    if env.truncated_reward is not None:
        if not math.isfinite(env.truncated_reward):
            errors.append(f"env.truncated_reward must be a finite number; got {env.truncated_reward}")
        if "env_reward" not in cfg.rewards.names:
            errors.append(f"env.truncated_reward={env.truncated_reward:g} is the env_reward of an episode cut at "
                          f"sampling.max_new_tokens, and rewards.names ({', '.join(cfg.rewards.names)}) does not "
                          "hold env_reward: add env_reward to rewards.names (its weight to rewards.weights), or "
                          "unset env.truncated_reward")
    return errors + _agent_errors(cfg)


def _agent_errors(cfg: Config) -> list[str]:
    """Your own agent loop: its sessions are the episodes, so nothing else may make them."""
    agent, errors = cfg.agent, []
    if not agent.harness:
        return errors
    named = [f"agent.{k}" for k in ("entrypoint", "command", "verifiers") if getattr(agent, k)]
    if len(named) > 1:
        errors.append(f"{' and '.join(named)} are {'both' if len(named) == 2 else 'all'} set: your agent is a "
                      "function, a program or a verifiers environment; set one")
    if agent.verifiers:
        errors += _verifiers_errors(cfg)
    elif agent.command:
        errors += command_errors(agent.command) + readable_errors(agent.readable, run_paths(cfg))
    elif ":" not in agent.entrypoint:
        errors.append(f"agent.entrypoint must be 'package.module:function' or 'path/to/file.py:function'; got "
                      f"{agent.entrypoint!r}")
    if cfg.env.name:
        which = next(f"agent.{k}" for k in ("verifiers", "command", "entrypoint") if getattr(agent, k))
        errors.append(f"{which} runs your own agent loop, and env.name={cfg.env.name} runs episodes of an "
                      "environment: set one of them")
    if cfg.data.prefill:
        errors.append("data.prefill starts each model turn with fixed text, and your agent's turns start where "
                      "your loop's messages leave them: unset data.prefill")
    if cfg.sampling.stop:
        errors.append("sampling.stop ends a completion, and an agent's turns end at the chat template's turn end: "
                      "unset sampling.stop")
    if 0 < agent.max_sessions < cfg.sampling.group_size:
        errors.append(f"agent.max_sessions={agent.max_sessions} is under sampling.group_size="
                      f"{cfg.sampling.group_size}: a group's sessions open together (they share its prompt); set it "
                      f">= {cfg.sampling.group_size}, or 0 for no limit")
    return errors


def _verifiers_errors(cfg: Config) -> list[str]:
    """agent.verifiers: its rows are its environment's (their prompts are what its rollouts send first)."""
    env, errors = cfg.agent.verifiers, []
    if cfg.data.path != f"{VERIFIERS_PREFIX}{env}" or cfg.data.sources:
        errors.append(f"agent.verifiers={env} runs that environment's rollouts on its own dataset's rows: set "
                      f"data.path={VERIFIERS_PREFIX}{env} (data.task_args are its load_environment arguments)")
    if env.endswith(".py") and not os.path.isfile(os.path.expanduser(env)):
        return errors + [f"agent.verifiers: {env!r} is not a file (give an installed environment's id, or its .py "
                         "file)"]
    try:
        verifiers_python()
    except VerifiersError as e:
        return errors + [f"agent.verifiers: {e}"]
    protected = run_paths(cfg)
    return (errors + readable_errors(cfg.agent.readable, protected)
            + readable_errors(readable_for(env), protected, f"agent.verifiers={env}: its jail reads",
                              "move the environment to a folder of its own", ", which"))


def command_errors(command: str) -> list[str]:
    """agent.command as a command line: words (shell quoting, no shell run), the first one a program found."""
    try:
        words = shlex.split(command)
    except ValueError as e:
        return [f"agent.command is not a command line ({e}): {command!r}"]
    if not words:
        return ["agent.command is blank: give the program to run and its arguments, e.g. 'python my_agent.py'"]
    if words[0] not in ("python", "python3") and not shutil.which(words[0]):
        return [f"agent.command runs {words[0]!r}, which is no program on PATH nor an executable file"]
    return []


def run_paths(cfg: Config) -> dict[str, Path]:
    """What an agent program must not read, by what it is: the run folder, the published weights, a local
    dataset (its reference answers), a local model, the home folder (keys and tokens) and the model caches."""
    from grpo.common.model_files import cache_root  # late: it loads torch, and only agent.command asks

    paths = {"the run folder": cfg.run_dir, "the home folder": Path.home(),
             "the model cache": cache_root(cfg.model.cache_dir),
             "the Hugging Face cache": Path(os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface")}
    if os.path.isdir(os.path.expanduser(cfg.model.name_or_path)):
        paths["the model"] = Path(cfg.model.name_or_path)
    if cfg.weights.dir:
        paths["the published weights"] = Path(cfg.weights.dir)
    if os.path.exists(cfg.data.path):
        paths["the dataset"] = Path(cfg.data.path)
    return {what: Path(path).expanduser().resolve() for what, path in paths.items()}


def readable_errors(readable: list[str], protected: dict[str, Path], named: str = "agent.readable:",
                    fix: str = "name the files or folders it needs", joiner: str = "") -> list[str]:
    """agent.readable: paths that are there, none of them in a protected one (run_paths) or holding one; the home
    folder's own files excepted from "in": a folder of your agent's under it is fine, the home folder is not."""
    errors = []
    for path in readable:
        if not os.path.exists(path):
            errors.append(f"{named} {path!r} is not there")
            continue
        resolved = Path(path).resolve()
        for what, held in protected.items():
            inside = resolved.is_relative_to(held) and what != "the home folder"
            if inside or held.is_relative_to(resolved):
                errors.append(f"{named} {path!r}{joiner} {'is in' if inside else 'holds'} {what} ({held}): the "
                              f"agent must not read it; {fix}")
                break
    return errors


def _transport_errors(transport) -> list[str]:
    scheme = transport.address.split("://", 1)[0] if "://" in transport.address else ""
    if scheme not in TRANSPORT_SCHEMES:
        return [f"transport.address must start with one of {', '.join(f'{s}://' for s in TRANSPORT_SCHEMES)} "
                f"(a transport for each); got {transport.address!r}"]
    signed = transport.secret or os.environ.get("GRPO_TRANSPORT_SECRET")
    if not is_loopback_address(transport.address) and not signed and not transport.allow_insecure:
        return [f"transport.address {transport.address} is not loopback: set transport.secret (or "
                "GRPO_TRANSPORT_SECRET) to sign messages, or transport.allow_insecure=true"]
    return []


def _run_errors(cfg: Config) -> list[str]:
    """How a run starts and where its trainer ranks find work."""
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
