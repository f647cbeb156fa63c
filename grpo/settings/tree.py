"""A typed tree of dataclasses read from YAML and dotted `key=value` overrides: the machinery
behind grpo/config/__init__.py, independent of which settings the tree holds.

Each leaf is a dataclass field made with `setting(default, help)`; its type annotation is what a
value is checked and coerced against, and its help is its documentation (`markdown_table`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file, override or combination of settings that cannot run."""


def setting(default, help: str, **kw):
    """A config field with its documentation; list/dict defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _TYPE_HINTS:
        _TYPE_HINTS[cls] = typing.get_type_hints(cls)
    return _TYPE_HINTS[cls]


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check `value` against the annotation `tp`; return it converted (int -> float, str from the CLI)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0], from_cli)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {_type_name(args[0])}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, args[0], from_cli) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `3e-6` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if from_cli and isinstance(value, (int, float, bool)):
            return str(value)  # `run.name=123` means the string "123"
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the config tree, in declaration order."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def get_key(node: Any, key: str) -> Any:
    """The value of a dotted key, e.g. get_key(cfg, "sampling.temperature")."""
    for part in key.split("."):
        node = getattr(node, part)
    return node


# Names users bring from TRL's GRPOConfig, OpenRLHF and veRL, and the key of ours that does the job
# (a leaf name we share, e.g. `beta` under another section, is found without this list).
FOREIGN_NAMES = {
    "lr": "training.learning_rate", "actor_learning_rate": "training.learning_rate",
    "num_generations": "sampling.group_size", "n_samples_per_prompt": "sampling.group_size", "n": "sampling.group_size",
    "max_completion_length": "sampling.max_new_tokens", "generate_max_len": "sampling.max_new_tokens",
    "response_length": "sampling.max_new_tokens", "max_response_length": "sampling.max_new_tokens",
    "max_tokens": "sampling.max_new_tokens",
    "max_prompt_length": "data.max_prompt_tokens", "prompt_max_len": "data.max_prompt_tokens",
    "per_device_train_batch_size": "sampling.prompts_per_step (prompts, each with sampling.group_size completions)",
    "train_batch_size": "sampling.prompts_per_step", "rollout_batch_size": "sampling.prompts_per_step",
    "gradient_accumulation_steps": "training.max_tokens_per_micro_batch (a step's batch is split into "
                                   "micro-batches by tokens; one optimizer update per pass)",
    "micro_train_batch_size": "training.max_tokens_per_micro_batch",
    "ppo_micro_batch_size_per_gpu": "training.max_tokens_per_micro_batch",
    "epsilon": "training.clip_low", "epsilon_low": "training.clip_low", "epsilon_high": "training.clip_high",
    "eps_clip": "training.clip_low", "clip_ratio": "training.clip_low", "clip_ratio_low": "training.clip_low",
    "clip_ratio_high": "training.clip_high", "cliprange": "training.clip_low",
    "loss_type": "training.aggregation (grpo, dapo, dr_grpo)", "loss_agg_mode": "training.aggregation",
    "use_vllm": "sampling.engine=vllm", "vllm_mode": "sampling.engine",
    "gpu_memory_utilization": "sampling.vllm_gpu_memory_utilization",
    "scale_rewards": "training.advantage_scale (group, batch, none)",
    "importance_sampling_level": "training.use_gspo (true = sequence level)",
    "kl_coef": "training.beta", "init_kl_coef": "training.beta", "kl_loss_coef": "training.beta",
    "kl_loss_type": "training.kl_estimator",
    "ppo_epochs": "training.num_iterations", "max_epochs": "training.num_iterations",
    "max_steps": "training.steps", "num_train_epochs": "training.steps", "total_training_steps": "training.steps",
    "lr_scheduler_type": "training.lr_schedule", "warmup_ratio": "training.warmup_steps",
    "model_name_or_path": "model.name_or_path", "pretrain": "model.name_or_path", "model_name": "model.name_or_path",
    "torch_dtype": "model.dtype", "bf16": "model.dtype=bfloat16", "fp16": "model.dtype=float16",
    "use_peft": "lora.enabled", "lora_r": "lora.r", "lora_rank": "lora.r", "lora_alpha": "lora.alpha",
    "lora_dropout": "nothing: LoRA dropout is always off", "lora_target_modules": "lora.target_modules",
    "dataset_name": "data.path", "dataset": "data.path", "prompt_data": "data.path",
    "input_key": "data.prompt_column", "label_key": "data.answer_column",
    "output_dir": "run.dir", "run_name": "run.name", "save_steps": "checkpoint.every",
    "save_total_limit": "checkpoint.keep_last", "resume_from_checkpoint": "checkpoint.resume",
    "eval_steps": "eval.every", "report_to": "logging.backend (none, wandb, trackio)",
    "reward_funcs": "rewards.names", "reward_weights": "rewards.weights",
}


def suggestion(key: str, root: type) -> str | None:
    """The key of ours a mistyped or foreign `key` most likely means, or None."""
    keys = all_keys(root)
    leaf = key.rsplit(".", 1)[-1]
    if key in FOREIGN_NAMES:
        return FOREIGN_NAMES[key]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:  # the right name under another section: `sampling.beta` -> training.beta
        return same_leaf[0]
    if leaf in FOREIGN_NAMES:
        return FOREIGN_NAMES[leaf]
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.5) or \
        difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in keys], n=1, cutoff=0.75)
    if not close:
        return None
    return close[0] if close[0] in keys else next(k for k in keys if k.rsplit(".", 1)[-1] == close[0])


# keys this trainer had, and what does their job now
REMOVED_KEYS = {
    "launch.samplers": "use sampling.num_workers (the launcher starts that many samplers)",
    "lora.dropout": "LoRA dropout is always off (a token's log-prob must be one function of the weights in both "
                    "processes)",
}


def _unknown_key(key: str, root: type) -> str:
    if key in REMOVED_KEYS:
        return f"config key '{key}' is gone: {REMOVED_KEYS[key]}"
    hint = suggestion(key, root)
    hint = f"; did you mean {hint}?" if hint and " " in hint else f"; did you mean '{hint}'?" if hint else ""
    return f"unknown config key '{key}'{hint or '; see --help-config or docs/config.md for every key'}"


def set_key(node: Any, parts: list[str], value: Any, from_cli: bool, full_key: str, root: type) -> list[str]:
    """Set the leaf `parts` (a dotted key split) below `node`; a mapping sets a whole section.
    Returns the problems found (unknown keys, wrong types), each naming its key; nothing is set
    for a key with a problem."""
    name = parts[0]
    names = {f.name for f in dataclasses.fields(node)}
    if name not in names:
        return [_unknown_key(full_key, root)]
    tp = _hints(type(node))[name]
    if dataclasses.is_dataclass(tp):
        if len(parts) == 1:
            if not isinstance(value, dict):
                return [f"{full_key}: expected a section (mapping), got {value!r}"]
            return [problem for k, v in value.items()
                    for problem in set_key(getattr(node, name), [str(k)], v, from_cli, f"{full_key}.{k}", root)]
        return set_key(getattr(node, name), parts[1:], value, from_cli, full_key, root)
    if len(parts) > 1:
        if tp is not dict:
            return [_unknown_key(full_key, root)]
        # pass-through mappings (deepspeed.config) take any nested key
        target = getattr(node, name)
        for part in parts[1:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                return [f"{full_key}: '{part}' is not a mapping"]
        target[parts[-1]] = value
        return []
    try:
        setattr(node, name, _coerce(full_key, value, tp, from_cli))
    except ConfigError as e:
        return [str(e)]
    return []


def apply_mapping(root_obj: Any, mapping: dict, from_cli: bool) -> list[str]:
    """Set every key of a (YAML) mapping; the problems of all of them."""
    return [problem for key, value in mapping.items()
            for problem in set_key(root_obj, str(key).split("."), value, from_cli, str(key), type(root_obj))]


def parse_override(text: str) -> tuple[str, Any]:
    """`training.use_gspo=true` -> ("training.use_gspo", True); values are read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. sampling.temperature=0.7)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _shown_default(default: Any) -> str:
    if isinstance(default, str) and "\n" in default:
        return json.dumps(default)  # one line: "<think>\n", not a broken one
    shown = yaml.safe_dump(default, default_flow_style=True, width=10**6).strip()
    return shown.removesuffix("\n...").removesuffix("...").strip()


def _leaves(cls: type, obj: Any, prefix: str = ""):
    """(dotted key, default, help) of every leaf, in declaration order."""
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, getattr(obj, f.name), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, getattr(obj, f.name), f.metadata["help"]


def reference_text(root: type, width: int = 100) -> str:
    """Every key with its default and help, for a terminal (`--help-config`)."""
    import textwrap

    lines, section = [], None
    for key, default, help in _leaves(root, root()):
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            lines.append(f"\n[{head or 'top level'}]")
        lines.append(f"{key} = {_shown_default(default)}")
        lines += textwrap.wrap(help, width=width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines).lstrip("\n")


def markdown_table(root: type) -> str:
    """| key | default | meaning | for every leaf of the tree `root`, from the fields' help."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, help in _leaves(root, root()):
        shown = _shown_default(default)
        shown = shown[:57] + "..." if len(shown) > 60 else shown
        rows.append(f"| `{key}` | `{shown}` | {help} |")
    return "\n".join(rows)
