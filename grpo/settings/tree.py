"""A typed tree of dataclasses read from YAML and dotted `key=value` overrides: the machinery
behind grpo/config/__init__.py, independent of which settings the tree holds.

Each leaf is a dataclass field made with `setting(default, help)`; its type annotation is what a
value is checked and coerced against, and its help is its documentation (`markdown_table`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
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


# Names users bring from TRL's GRPOConfig, veRL and OpenRLHF, and what of ours does the job: a key
# ("training.beta"), a key with a note, or a sentence where no key does (a hint that does not start
# with one of our keys). veRL's names are those of verl/trainer/config/ppo_trainer.yaml, OpenRLHF's
# the flags of openrlhf/cli/train_ppo_ray.py (flat, e.g. --pretrain, and dotted, e.g. --ckpt.save_steps).
GPU_PLACEMENT = ("scripts/launch.py places the processes on the GPUs it sees (CUDA_VISIBLE_DEVICES); "
                 "launch.trainer_ranks sets how many of them train, the rest sample")
NODES = ("scripts/launch.py runs one node; across nodes start the trainer with deepspeed --hostfile and "
         "each sampler on its host (docs/running.md)")
NO_ENTROPY = "the loss has no entropy bonus (the entropy is logged as entropy)"
ADVANTAGES = "advantages are group-relative (GRPO); training.advantage_scale sets their scale (group, batch, none)"
BOTH_CLIPS = "training.clip_low and training.clip_high (set separately)"
RUN_FOLDER = "run.dir (checkpoints go to <run.dir>/checkpoints, weights to <run.dir>/weights)"
EXPORT = ("scripts/export.py runs/<name> --out DIR writes the trained model (the run keeps its weights in "
          "<run.dir>/weights)")
REWARD_MODEL = "rewards.names=[reward_model:<folder or Hub id>]"
REWARD_FUNCTION = "rewards.names=[path/to/file.py:function]"
GREEDY_EVAL = "evaluation answers each problem once, greedily (eval.num_problems sets how many)"
ONE_UPDATE_PER_PASS = ("sampling.prompts_per_step (one optimizer update per pass over a step's prompts_per_step "
                       "* group_size completions)")

# Top-level sections of veRL and OpenRLHF that we do not have: a key under one of them gets its entry
# in FOREIGN_KEYS or no suggestion (`actor_rollout_ref.model.path` is not `data.path`).
FOREIGN_SECTIONS = {
    "actor_rollout_ref", "critic", "reward_model", "reward_manager", "custom_reward_function", "algorithm",
    "trainer", "global_profiler", "transfer_queue", "ray_kwargs",  # veRL
    "actor", "ref", "reward", "train", "vllm", "algo", "ckpt", "ds", "rollout", "logger",  # OpenRLHF
}

FOREIGN_KEYS = {
    # veRL: actor_rollout_ref
    "actor_rollout_ref.model.path": "model.name_or_path",
    "actor_rollout_ref.model.lora_rank": "lora.r (lora.enabled=false trains the full model)",
    "actor_rollout_ref.model.lora_alpha": "lora.alpha",
    "actor_rollout_ref.model.target_modules": "lora.target_modules",
    "actor_rollout_ref.model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    "actor_rollout_ref.model.trust_remote_code": "model.trust_remote_code",
    "actor_rollout_ref.model.custom_chat_template": "model.chat_template",
    "actor_rollout_ref.actor.optim.lr": "training.learning_rate",
    "actor_rollout_ref.actor.optim.weight_decay": "training.weight_decay",
    "actor_rollout_ref.actor.optim.lr_warmup_steps": "training.warmup_steps",
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": "training.warmup_steps (in optimizer updates)",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "training.lr_schedule",
    "actor_rollout_ref.actor.optim.min_lr_ratio": "training.min_lr_ratio",
    "actor_rollout_ref.actor.optim.clip_grad": "training.max_grad_norm",
    "actor_rollout_ref.actor.optim.total_training_steps": "training.steps",
    "actor_rollout_ref.actor.grad_clip": "training.max_grad_norm",
    "actor_rollout_ref.actor.ppo_mini_batch_size": ONE_UPDATE_PER_PASS,
    "actor_rollout_ref.actor.ppo_micro_batch_size": "training.max_tokens_per_micro_batch",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "training.max_tokens_per_micro_batch",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "training.max_tokens_per_micro_batch",
    "actor_rollout_ref.actor.use_dynamic_bsz": "training.max_tokens_per_micro_batch (micro-batches are always "
                                               "packed by tokens)",
    "actor_rollout_ref.actor.ppo_epochs": "training.num_iterations",
    "actor_rollout_ref.actor.clip_ratio": BOTH_CLIPS,
    "actor_rollout_ref.actor.clip_ratio_low": "training.clip_low",
    "actor_rollout_ref.actor.clip_ratio_high": "training.clip_high",
    "actor_rollout_ref.actor.loss_agg_mode": "training.aggregation (token-mean: dapo, seq-mean-token-mean: grpo, "
                                             "seq-mean-token-sum-norm: dr_grpo)",
    "actor_rollout_ref.actor.policy_loss.loss_mode": "training.use_gspo (true: veRL's gspo)",
    "actor_rollout_ref.actor.use_kl_loss": "training.beta (0 turns the KL term off)",
    "actor_rollout_ref.actor.kl_loss_coef": "training.beta",
    "actor_rollout_ref.actor.kl_loss_type": "training.kl_estimator (k1, k2, k3; veRL's low_var_kl is k3)",
    "actor_rollout_ref.actor.entropy_coeff": NO_ENTROPY,
    "actor_rollout_ref.actor.strategy": "deepspeed.zero_stage (the trainer runs on DeepSpeed)",
    "actor_rollout_ref.rollout.name": "sampling.engine (hf or vllm)",
    "actor_rollout_ref.rollout.n": "sampling.group_size",
    "actor_rollout_ref.rollout.temperature": "sampling.temperature",
    "actor_rollout_ref.rollout.top_p": "sampling.top_p",
    "actor_rollout_ref.rollout.top_k": "sampling.top_k (0 = off)",
    "actor_rollout_ref.rollout.response_length": "sampling.max_new_tokens",
    "actor_rollout_ref.rollout.prompt_length": "data.max_prompt_tokens",
    "actor_rollout_ref.rollout.dtype": "sampling.dtype",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "sampling.vllm_gpu_memory_utilization",
    "actor_rollout_ref.rollout.val_kwargs.temperature": GREEDY_EVAL,
    "actor_rollout_ref.rollout.val_kwargs.n": GREEDY_EVAL,
    # veRL: data (a section we have too, with other names)
    "data.train_files": "data.path (a Hub dataset id, or a folder with train.jsonl and test.jsonl or parquet files)",
    "data.val_files": "eval.split (a split of data.path)",
    "data.prompt_key": "data.prompt_column",
    "data.max_prompt_length": "data.max_prompt_tokens",
    "data.max_response_length": "sampling.max_new_tokens",
    "data.train_batch_size": "sampling.prompts_per_step",
    "data.val_batch_size": "eval.batch_size",
    "data.reward_fn_key": REWARD_FUNCTION,
    # veRL: rewards
    "reward_model.enable": REWARD_MODEL,
    "reward_model.model.path": REWARD_MODEL,
    "custom_reward_function.path": REWARD_FUNCTION,
    "custom_reward_function.name": REWARD_FUNCTION,
    # veRL: algorithm
    "algorithm.adv_estimator": ADVANTAGES,
    "algorithm.norm_adv_by_std_in_grpo": "training.advantage_scale (group: divide by the group's std, none: do not)",
    "algorithm.use_kl_in_reward": "the KL term is in the loss (training.beta), never in the reward",
    "algorithm.rollout_correction.rollout_is": "training.importance_sampling",
    "algorithm.rollout_correction.rollout_is_threshold": "training.importance_sampling_cap",
    "algorithm.filter_groups.enable": "sampling.dynamic_sampling",
    "algorithm.filter_groups.max_num_gen_batches": "sampling.dynamic_sampling_max_rounds",
    # veRL: trainer
    "trainer.total_epochs": "training.steps (a run counts steps of sampling.prompts_per_step prompts, not epochs)",
    "trainer.total_training_steps": "training.steps",
    "trainer.save_freq": "checkpoint.every",
    "trainer.test_freq": "eval.every",
    "trainer.val_before_train": "eval.on_start",
    "trainer.default_local_dir": RUN_FOLDER,
    "trainer.project_name": "logging.project",
    "trainer.experiment_name": "run.name",
    "trainer.logger": "logging.backend (none, wandb, trackio; metrics.jsonl and TensorBoard are always written)",
    "trainer.n_gpus_per_node": GPU_PLACEMENT,
    "trainer.nnodes": NODES,
    "trainer.resume_mode": "checkpoint.resume",
    "trainer.resume_from_path": "checkpoint.resume",
    "trainer.max_actor_ckpt_to_keep": "checkpoint.keep_last",
    # OpenRLHF (dotted flags)
    "actor.model_name_or_path": "model.name_or_path",
    "actor.eps_clip": BOTH_CLIPS,
    "actor.eps_clip_low_high": BOTH_CLIPS,
    "actor.policy_loss_type": "training.use_gspo (true: OpenRLHF's gspo)",
    "actor.gradient_checkpointing_enable": "model.gradient_checkpointing",
    "actor.entropy_coef": NO_ENTROPY,
    "actor.num_gpus_per_node": GPU_PLACEMENT,
    "actor.num_nodes": NODES,
    "rollout.n_samples_per_prompt": "sampling.group_size",
    "rollout.batch_size": "sampling.prompts_per_step",
    "rollout.max_new_tokens": "sampling.max_new_tokens",
    "rollout.temperature": "sampling.temperature",
    "rollout.top_p": "sampling.top_p",
    "train.batch_size": ONE_UPDATE_PER_PASS,
    "train.micro_batch_size": "training.max_tokens_per_micro_batch",
    "train.max_tokens_per_gpu": "training.max_tokens_per_micro_batch",
    "train.max_epochs": "training.num_iterations",
    "train.num_episodes": "training.steps",
    "train.seed": "seed",
    "train.async_enable": "sampling.max_staleness (0 = synchronous)",
    "algo.kl.init_coef": "training.beta",
    "algo.kl.use_loss": "training.beta (0 turns the KL term off)",
    "algo.kl.estimator": "training.kl_estimator",
    "algo.advantage.estimator": ADVANTAGES,
    "algo.advantage.no_std_norm": "training.advantage_scale=none",
    "algo.advantage.is_correction_enable": "training.importance_sampling",
    "algo.advantage.is_correction_type": "training.importance_sampling",
    "algo.advantage.is_correction_threshold": "training.importance_sampling_cap",
    "algo.dynamic_filtering_enable": "sampling.dynamic_sampling",
    "ckpt.save_steps": "checkpoint.every",
    "ckpt.path": RUN_FOLDER,
    "ckpt.max_num": "checkpoint.keep_last",
    "ckpt.load_enable": "checkpoint.resume",
    "ckpt.output_dir": EXPORT,
    "ds.zero_stage": "deepspeed.zero_stage",
    "ds.param_dtype": "model.dtype",
    "ds.attn_implementation": "model.attn_implementation",
    "ds.lora.rank": "lora.r",
    "ds.lora.alpha": "lora.alpha",
    "ds.lora.target_modules": "lora.target_modules",
    "ds.lora.dropout": "LoRA dropout is always off",
    "vllm.gpu_memory_utilization": "sampling.vllm_gpu_memory_utilization",
    "vllm.num_engines": "sampling.num_workers (one engine per sampler, with sampling.engine=vllm)",
    "logger.wandb.project": "logging.project",
    "logger.wandb.run_name": "run.name",
    "logger.tensorboard_dir": "logging.tensorboard (written to <run.dir>/tb)",
    "reward.model_name_or_path": REWARD_MODEL,
    "reward.remote_url": "rewards.names=[http://host:port/score]",
    "reward.overlong_buffer_len": "rewards.overlong_buffer",
    "reward.overlong_penalty_factor": "rewards.overlong_penalty",
    "data.prompt_dataset": "data.path",
    "data.input_key": "data.prompt_column",
    "data.label_key": "data.answer_column",
    "data.max_len": "sampling.max_new_tokens and data.max_prompt_tokens (set separately)",
    "eval.steps": "eval.every",
    "eval.dataset": "eval.split (a split of data.path)",
    "eval.temperature": GREEDY_EVAL,
    "data.apply_chat_template": "model.chat_template (prompts always go through the chat template; this replaces it)",
    "data.prompt_split": "data.split",
    "eval.n_samples_per_prompt": GREEDY_EVAL,
}

# Flat names: TRL's GRPOConfig, OpenRLHF's flags, veRL's leaves written alone
# (a leaf name we share, e.g. `beta` under another of our sections, is found without this list).
FOREIGN_NAMES = {
    "lr": "training.learning_rate", "actor_learning_rate": "training.learning_rate",
    "num_generations": "sampling.group_size", "n_samples_per_prompt": "sampling.group_size", "n": "sampling.group_size",
    "max_completion_length": "sampling.max_new_tokens", "generate_max_len": "sampling.max_new_tokens",
    "response_length": "sampling.max_new_tokens", "max_response_length": "sampling.max_new_tokens",
    "max_tokens": "sampling.max_new_tokens",
    "max_prompt_length": "data.max_prompt_tokens", "prompt_max_len": "data.max_prompt_tokens",
    "max_len": "sampling.max_new_tokens and data.max_prompt_tokens (set separately)",
    "per_device_train_batch_size": "sampling.prompts_per_step (prompts, each with sampling.group_size completions)",
    "train_batch_size": "sampling.prompts_per_step", "rollout_batch_size": "sampling.prompts_per_step",
    "ppo_mini_batch_size": ONE_UPDATE_PER_PASS,
    "gradient_accumulation_steps": "training.max_tokens_per_micro_batch (a step's batch is split into "
                                   "micro-batches by tokens; one optimizer update per pass)",
    "micro_train_batch_size": "training.max_tokens_per_micro_batch",
    "ppo_micro_batch_size_per_gpu": "training.max_tokens_per_micro_batch",
    "ppo_max_token_len_per_gpu": "training.max_tokens_per_micro_batch",
    "epsilon": "training.clip_low", "epsilon_low": "training.clip_low", "epsilon_high": "training.clip_high",
    "eps_clip": BOTH_CLIPS, "eps_clip_low_high": BOTH_CLIPS, "clip_ratio": BOTH_CLIPS,
    "clip_ratio_low": "training.clip_low", "clip_ratio_high": "training.clip_high", "cliprange": BOTH_CLIPS,
    "loss_type": "training.aggregation (grpo, dapo, dr_grpo)", "loss_agg_mode": "training.aggregation",
    "policy_loss_type": "training.use_gspo (true: gspo)",
    "use_vllm": "sampling.engine=vllm", "vllm_mode": "sampling.engine",
    "gpu_memory_utilization": "sampling.vllm_gpu_memory_utilization",
    "vllm_num_engines": "sampling.num_workers (one engine per sampler, with sampling.engine=vllm)",
    "scale_rewards": "training.advantage_scale (group, batch, none)",
    "no_advantage_std_norm": "training.advantage_scale=none", "advantage_estimator": ADVANTAGES,
    "adv_estimator": ADVANTAGES,
    "importance_sampling_level": "training.use_gspo (true = sequence level)",
    "kl_coef": "training.beta", "init_kl_coef": "training.beta", "kl_loss_coef": "training.beta",
    "use_kl_loss": "training.beta (0 turns the KL term off)",
    "kl_loss_type": "training.kl_estimator",
    "entropy_coeff": NO_ENTROPY, "entropy_loss_coef": NO_ENTROPY,
    "ppo_epochs": "training.num_iterations", "max_epochs": "training.num_iterations",
    "max_steps": "training.steps", "num_train_epochs": "training.steps", "total_training_steps": "training.steps",
    "total_epochs": "training.steps (a run counts steps of sampling.prompts_per_step prompts, not epochs)",
    "num_episodes": "training.steps",
    "lr_scheduler_type": "training.lr_schedule", "lr_scheduler": "training.lr_schedule",
    "warmup_ratio": "training.warmup_steps", "lr_warmup_ratio": "training.warmup_steps",
    "max_norm": "training.max_grad_norm", "l2": "training.weight_decay",
    "model_name_or_path": "model.name_or_path", "pretrain": "model.name_or_path", "model_name": "model.name_or_path",
    "torch_dtype": "model.dtype", "param_dtype": "model.dtype", "bf16": "model.dtype=bfloat16",
    "fp16": "model.dtype=float16",
    "use_peft": "lora.enabled", "lora_r": "lora.r", "lora_rank": "lora.r", "lora_alpha": "lora.alpha",
    "lora_dropout": "LoRA dropout is always off", "lora_target_modules": "lora.target_modules",
    "target_modules": "lora.target_modules",
    "dataset_name": "data.path", "dataset": "data.path", "prompt_data": "data.path",
    "train_files": "data.path", "val_files": "eval.split (a split of data.path)", "eval_dataset": "eval.split",
    "input_key": "data.prompt_column", "prompt_key": "data.prompt_column", "label_key": "data.answer_column",
    "output_dir": "run.dir", "run_name": "run.name", "experiment_name": "run.name", "wandb_run_name": "run.name",
    "project_name": "logging.project", "wandb_project": "logging.project",
    "save_steps": "checkpoint.every", "save_freq": "checkpoint.every",
    "ckpt_path": RUN_FOLDER, "default_local_dir": RUN_FOLDER, "save_path": EXPORT,
    "save_total_limit": "checkpoint.keep_last", "max_ckpt_num": "checkpoint.keep_last",
    "resume_from_checkpoint": "checkpoint.resume", "load_checkpoint": "checkpoint.resume",
    "eval_steps": "eval.every", "test_freq": "eval.every",
    "report_to": "logging.backend (none, wandb, trackio)", "use_wandb": "logging.backend=wandb",
    "logger": "logging.backend (none, wandb, trackio)", "use_tensorboard": "logging.tensorboard",
    "reward_funcs": "rewards.names", "reward_weights": "rewards.weights",
    "reward_pretrain": REWARD_MODEL, "remote_rm_url": "rewards.names=[http://host:port/score]",
    "overlong_buffer_len": "rewards.overlong_buffer", "overlong_penalty_factor": "rewards.overlong_penalty",
    "dynamic_filtering": "sampling.dynamic_sampling",
    "enable_vllm_is_correction": "training.importance_sampling",
    "n_gpus_per_node": GPU_PLACEMENT, "actor_num_gpus_per_node": GPU_PLACEMENT,
    "nnodes": NODES, "actor_num_nodes": NODES,
    "eval_temperature": GREEDY_EVAL, "eval_n_samples_per_prompt": GREEDY_EVAL,
    "apply_chat_template": "model.chat_template (prompts always go through the chat template; this replaces it)",
    "critic_learning_rate": "there is no critic: " + ADVANTAGES,
}


TYPO_CUTOFF = 0.8  # difflib's similarity for a typo (`temprature`); looser cutoffs pair unrelated names


def suggestion(key: str, root: type) -> str | None:
    """What of ours a mistyped or foreign `key` most likely means: a key, a key with a note, or a
    sentence where no key does the job; None where nothing fits. Names from veRL and OpenRLHF are
    looked up whole; under their sections (FOREIGN_SECTIONS) nothing is guessed."""
    if key in FOREIGN_KEYS:
        return FOREIGN_KEYS[key]
    if "." not in key:
        return FOREIGN_NAMES.get(key) or _closest(key, all_keys(root))
    head, rest = key.split(".", 1)
    sections = [f.name for f in dataclasses.fields(root) if dataclasses.is_dataclass(_hints(root)[f.name])]
    if head not in sections:
        typo = difflib.get_close_matches(head, sections, n=1, cutoff=TYPO_CUTOFF)
        if head in FOREIGN_SECTIONS or not typo:
            return None
        key, head = f"{typo[0]}.{rest}", typo[0]  # `trainig.beta` -> training.beta
    keys = all_keys(root)
    if key in keys:
        return key
    parent, leaf = key.rsplit(".", 1)
    if not _is_section(root, parent):  # `data.custom_cls.path`: no section of ours holds it
        return None
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:  # the right name under another of our sections: `sampling.beta` -> training.beta
        return same_leaf[0]
    if leaf in FOREIGN_NAMES:  # `training.lr` -> training.learning_rate
        return FOREIGN_NAMES[leaf]
    return _closest(key, [k for k in keys if k.startswith(parent + ".")])


def _is_section(root: type, dotted: str) -> bool:
    """Whether `dotted` ("rewards.judge") names a section of the tree, not a leaf or nothing."""
    node = root
    for part in dotted.split("."):
        fields = {f.name for f in dataclasses.fields(node)}
        if part not in fields or not dataclasses.is_dataclass(_hints(node)[part]):
            return False
        node = _hints(node)[part]
    return True


def _closest(key: str, keys: list[str]) -> str | None:
    """A typo's nearest key, by its last part."""
    leaves = {k.rsplit(".", 1)[-1]: k for k in reversed(keys)}  # the first key of each leaf name
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=TYPO_CUTOFF)
    return leaves[close[0]] if close else None


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
    if hint is None:
        return f"unknown config key '{key}'; see --help-config or docs/config.md for every key"
    named = re.match(r"[a-z_.]*", hint).group()
    if named not in all_keys(root):  # a sentence: no key of ours does this
        return f"unknown config key '{key}'; {hint}"
    return f"unknown config key '{key}'; did you mean {hint}?" if " " in hint else \
        f"unknown config key '{key}'; did you mean '{hint}'?"


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
