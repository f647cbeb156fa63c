"""A run folder's config across its launches, and what a resume may change.

The run folder's `config.yaml` is always the config of the latest start. A start whose settings
differ from it first keeps the old one beside it as `config.001.yaml`, `config.002.yaml`, ... (one
per launch, numbered in launch order: zero-padded so that a listing sorts them, made by a hard
link or an exclusive create so that none is ever overwritten; the file keeps its own date). Keys
that every launch sets itself (`LAUNCH_SET`) update config.yaml without a copy; equal settings
write nothing. The trainer (rank 0) writes it at every start, and sampler 0 until a step is
trained; a lock on the run folder keeps them in turn.

A resume (a start that continues the run from its own checkpoints) is compared with that
config.yaml: a change to a setting the checkpoint, the samplers' saved position or the spooled
batches depend on (`REFUSED`) is refused before anything starts or is written; a change to one
of `ALLOWED` is listed in one line; a key in neither list is refused until someone decides.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Mapping

from grpo.common.files import CHECKPOINT_MARK, RunFolderError, fsync_path, write_atomically
from grpo.common.run_folder import RunFolder
from grpo.config import Config, ConfigError, all_keys, get_key, load_config, save_config
from grpo.run.start import continues_the_run
from grpo.wire.behaviour import BEHAVIOUR_KEYS

# set by every launch itself (the launcher's address, the sampler's index, how this start treats the folder)
LAUNCH_SET = ("transport.address", "sampling.worker_index", "run.overwrite", "checkpoint.resume")
CONFIG_LOCK = ".config.lock"  # in the run folder: the writers of config.yaml take turns on it

DATA_ORDER = "the data order and the samplers' saved position in it"
SPOOLED = "batches record it: the trainer would refuse those spooled with the old value"
TASK = "the task the prompts and episodes are made of"
REFERENCE = "batches spooled without reference log-probs cannot be trained with them"
UNDECIDED = "not known to be safe to change on a resume"

# a setting (or a section, ending in '.') the resumed run depends on, and what depends on it
REFUSED = {
    "seed": DATA_ORDER, "data.": DATA_ORDER, "sampling.prompts_per_step": DATA_ORDER,
    "sampling.dynamic_sampling": DATA_ORDER, "sampling.dynamic_sampling_max_rounds": DATA_ORDER,
    "model.name_or_path": "the model the checkpoint holds",
    "model.dtype": "the dtype of the checkpoint's weights and optimizer state",
    "model.chat_template": "the prompts the policy was trained on",
    "model.train_vision": "the weights the checkpoint trains",
    "lora.enabled": "a LoRA adapter or the full model: what the checkpoint holds",
    "lora.": "the checkpoint's LoRA adapter",
    "training.use_gspo": "the objective the checkpoint was trained with",
    "deepspeed.zero_stage": "how the checkpoint's optimizer state is partitioned",
    "deepspeed.config": "the DeepSpeed settings the checkpoint was written under",
    "sampling.num_workers": "which sampler makes which step: the spools and the trainer's position",
    "weights.dir": "the published versions the spooled batches name",
    "weights.channel": "the published versions the spooled batches name",
    "env.tools": TASK, "env.args": TASK, "env.tool_parser": TASK, "agent.tool_parser": TASK,
    "agent.split_reasoning": TASK, "agent.verifiers": TASK,
}
# what grpo/wire/behaviour.py's behaviour_of records in every batch (a key REFUSED names already keeps its reason)
# and what the trainer recomputes every batch's advantages with (grpo/trainer/advantage_check.py)
for _key in (*BEHAVIOUR_KEYS, "training.mask_truncated_completions", "training.advantage_scale", "training.advantage",
             "training.kl_in",
             "rewards.names", "rewards.weights", "rewards.overlong_buffer", "rewards.overlong_penalty"):
    if _key not in REFUSED and not any(_key.startswith(name) for name in REFUSED if name.endswith(".")):
        REFUSED[_key] = SPOOLED

# safe to change on a resume (listed in one line when changed): keys, and sections whose keys are
# safe unless REFUSED names them
ALLOWED = (
    "run.name", "run.dir", "model.attn_implementation", "model.gradient_checkpointing", "model.cache_dir",
    "model.trust_remote_code", "sampling.engine", "sampling.device", "sampling.group_size",
    "sampling.vllm.gpu_memory_utilization", "sampling.vllm.kv_cache_gb", "sampling.vllm.python",
    "sampling.generation_batch_size",
    "sampling.old_logps", "sampling.wait_timeout_s", "sampling.episode_feed_tokens", "sampling.continuous_batching",
    "sampling.in_flight_updates", "sampling.in_flight_kv", "sampling.compile_decode",
    "training.steps", "training.epochs", "training.learning_rate", "training.lr_schedule", "training.warmup_steps",
    "training.min_lr_ratio", "training.weight_decay", "training.max_grad_norm", "training.max_bad_steps",
    "training.beta", "training.reference_on", "training.kl_estimator", "training.clip_low", "training.clip_high",
    "training.aggregation", "training.num_iterations", "training.max_tokens_per_micro_batch",
    "training.importance_sampling", "training.importance_sampling_cap", "training.max_token_age", "training.loss",
    "training.sapo_temperature_pos", "training.sapo_temperature_neg", "training.entropy_coef",
    "training.shared_prefix", "training.verify_shared_prefix", "distill.coef", "distill.with_rewards",
    "distill.teacher_url", "distill.served_name", "distill.timeout_s", "distill.api_key_env",
    "deepspeed.backend", "weights.keep_last",
    "checkpoint.every", "checkpoint.keep_last", "rewards.", "eval.", "env.", "transport.", "logging.", "launch.",
    "agent.idle_timeout_s", "agent.session_timeout_s", "agent.memory_mb", "agent.max_processes", "agent.cpu_s",
    "agent.readable", "agent.max_sessions",
)
NOTES = {"training.learning_rate": "the schedule continues from where it stands, with the new peak",
         "training.loss": "the clip range is training.clip_low/clip_high as this start has them: a loss's own "
                          "defaults (cispo: 1, 4) apply only where they are unset, not over a run's config.yaml"}
SECRETS = ("transport.secret",)
SHOWN_CHARS = 60  # a longer value (a system prompt) is cut in messages


class ResumeRefused(RunFolderError):
    """A resume whose settings differ from the run's on a key its checkpoint depends on."""


# ----------------------------------------------------------------------------- comparing

def settings_of(cfg: Config) -> dict[str, Any]:
    """Every leaf key of the tree and its value."""
    return {key: get_key(cfg, key) for key in all_keys()}


def changed_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (old value, new value)} for each key whose value differs, in `new`'s order then `old`'s."""
    keys = [*new, *(key for key in old if key not in new)]
    return {key: (old.get(key), new.get(key)) for key in keys if old.get(key) != new.get(key)}


def depends_on(key: str) -> str | None:
    """What of a run depends on `key` (so that a resume may not change it), or None."""
    return REFUSED.get(key) or REFUSED.get(_section(key, REFUSED))


def settings_a_resume_keeps(cfg: Config) -> dict[str, Any]:
    """The settings a resume may not change, and their values (what a sampler's position and spool depend on)."""
    return {key: value for key, value in settings_of(cfg).items() if depends_on(key)}


def refused_changes(changes: Mapping[str, tuple[Any, Any]], old: Config, new: Config) -> dict[str, str]:
    """{key: what depends on it} for each change a resume may not make."""
    refused = {}
    for key in changes:
        reason = depends_on(key)  # before ALLOWED's sections
        if reason is None and key in ("training.beta", "training.reference_on") and _needs_spooled_reference(old, new):
            reason = REFERENCE
        if reason is None and key in ("training.beta", "training.kl_estimator") and old.training.kl_in == "reward":
            reason = SPOOLED  # the spooled batches' KL penalty column
        if reason is None and key not in ALLOWED and _section(key, ALLOWED) is None:
            reason = UNDECIDED
        if reason is not None:
            refused[key] = reason
    return refused


def _section(key: str, names) -> str | None:
    """The section among `names` ('lora.') that holds `key` ('lora.r'), or None."""
    return next((name for name in names if name.endswith(".") and key.startswith(name)), None)


def _needs_spooled_reference(old: Config, new: Config) -> bool:
    """The new settings read reference log-probs from the batches, and the old ones did not make them."""
    def from_sampler(cfg: Config) -> bool:
        return cfg.training.beta > 0 and cfg.training.reference_on == "sampler"
    return from_sampler(new) and not from_sampler(old)


# ----------------------------------------------------------------------------- what a resume says

def resume_changes(cfg: Config) -> tuple[str | None, str | None]:
    """(the refusal, or None; the line listing the allowed changes, or None) of a start with `cfg`
    against the run folder's config.yaml; both None unless the start continues the run. Changes
    nothing on disk."""
    run_dir = Path(cfg.run_dir)
    if not continues_the_run(cfg.checkpoint.resume, run_dir) or not RunFolder(run_dir).config.is_file():
        return None, None
    try:
        old = saved_config(RunFolder(run_dir).config)
    except ConfigError as e:
        return unreadable_message(cfg, e), None
    changes = changed_settings(settings_of(old), settings_of(cfg))
    for key in LAUNCH_SET:
        changes.pop(key, None)
    refused = refused_changes(changes, old, cfg)
    if refused:
        return refusal_message(cfg, {key: (*changes[key], refused[key]) for key in refused}), None
    return None, allowed_line(changes) if changes else None


def refuse_a_changed_resume(cfg: Config) -> str | None:
    """The workers' check: raise `ResumeRefused` with `resume_changes`' refusal; else its line."""
    refusal, changed = resume_changes(cfg)
    if refusal is not None:
        raise ResumeRefused(refusal)
    return changed


def saved_config(path: Path) -> Config:
    """A run's config.yaml as `load_config(..., written_by_a_run=True)` reads it, its values only (how
    that start resumed does not matter, its checkpoint folder may be gone, and its reward files
    need not import any more: only what changed is compared)."""
    return load_config(path, ["checkpoint.resume=auto"], written_by_a_run=True, validated=False)


def refusal_message(cfg: Config, refused: Mapping[str, tuple[Any, Any, str]]) -> str:
    """One line: each refused key with its old and new value and what depends on it, and the ways on."""
    changes = ", ".join(f"{key} {shown(key, old)} -> {shown(key, new)} ({why})"
                        for key, (old, new, why) in refused.items())
    olds = " ".join(f"{key}={shown(key, old)}" if not shown(key, old).endswith("...") else f"{key} as in config.yaml"
                    for key, (old, _, _) in refused.items())
    return (f"run folder {cfg.run_dir} (run.name={cfg.run.name}) resumes from its {checkpoint_name(cfg.run_dir)}, "
            f"which depends on settings this start changes: {changes}; nothing was changed. Run the same command "
            f"with {olds}, or start a new run: a new run.name, or checkpoint.resume=never run.overwrite=true to "
            "move this one aside")


def unreadable_message(cfg: Config, error: Exception) -> str:
    return (f"run folder {cfg.run_dir} (run.name={cfg.run.name}) resumes from its {checkpoint_name(cfg.run_dir)}, "
            f"but its config.yaml, the settings the checkpoint was made with, cannot be read "
            f"({' '.join(str(error).split())}); nothing was "
            "changed. Restore it, or start a new run: a new run.name, or checkpoint.resume=never "
            "run.overwrite=true to move this one aside")


def allowed_line(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """`resuming with changed settings: training.steps 200 -> 400, ...` (with a note where one helps)."""
    items = [f"{key} {shown(key, old)} -> {shown(key, new)}" + (f" ({NOTES[key]})" if key in NOTES else "")
             for key, (old, new) in changes.items()]
    return "resuming with changed settings: " + ", ".join(items)


def checkpoint_name(run_dir: Path) -> str:
    """'checkpoint of step 2' (what DeepSpeed's `latest` names in the run's checkpoints)."""
    tag = (RunFolder(run_dir).checkpoints / CHECKPOINT_MARK).read_text().strip()
    match = re.fullmatch(r"step(\d+)", tag)
    return f"checkpoint of step {int(match.group(1))}" if match else f"checkpoint {tag}"


def shown(key: str, value: Any) -> str:
    """A value as a `key=value` override reads it (lists without spaces), cut when long; secrets hidden."""
    if key in SECRETS and value is not None:
        return "***"
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, list):
        return "[" + ",".join(shown("", item) for item in value) + "]"
    text = value if isinstance(value, str) and re.fullmatch(r"[\w./:@+-]*", value) and value else \
        json.dumps(value, separators=(",", ":"))
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


# ----------------------------------------------------------------------------- keeping each launch's config

def save_run_config(cfg: Config) -> Path | None:
    """Write `cfg` as the run folder's config.yaml. When its settings differ from the config.yaml
    there (other than `LAUNCH_SET`), the old one is first kept as config.NNN.yaml (returned);
    equal settings write nothing. Safe while the other worker does the same."""
    run_dir = Path(cfg.run_dir)
    path = RunFolder(run_dir).config
    kept = None
    with _locked(run_dir):
        if path.is_file():
            changed = _changed_keys(path, cfg)
            if not changed:
                return None
            if changed - set(LAUNCH_SET):
                kept = keep_beside(path)
        save_config(cfg, path)
    return kept


def _changed_keys(path: Path, cfg: Config) -> set[str]:
    """The keys whose values differ between the config file at `path` and `cfg`; all of them when
    this version cannot read it (it is then kept, whatever it holds)."""
    try:
        return set(changed_settings(settings_of(saved_config(path)), settings_of(cfg)))
    except ConfigError:
        return set(all_keys())


def launch_numbers(run_dir: Path) -> list[int]:
    """The numbers of the configs kept beside config.yaml (config.001.yaml -> 1)."""
    return [int(m.group(1)) for p in Path(run_dir).glob("config.*.yaml")
            if (m := re.fullmatch(r"config\.(\d+)\.yaml", p.name))]


def keep_beside(path: Path) -> Path:
    """Keep `path` as config.NNN.yaml, NNN one past the highest there, never over an existing file."""
    number = max(launch_numbers(path.parent), default=0) + 1
    while True:
        kept = path.with_name(f"config.{number:03d}.yaml")
        try:
            _copy_exclusively(path, kept)
        except FileExistsError:
            number += 1
            continue
        fsync_path(path.parent)
        return kept


def _copy_exclusively(source: Path, target: Path) -> None:
    """`target` becomes a copy of `source`; FileExistsError rather than replace a file. Where the file
    system has no hard links, the name is taken first and the bytes written aside and renamed onto
    it, so that a crash leaves no half copy under it."""
    try:
        os.link(source, target)  # the same bytes and date
        return
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links
        pass
    os.close(os.open(target, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # the name is ours now
    write_atomically(target, source.read_bytes())
    with contextlib.suppress(OSError):  # a file system that keeps no dates or modes
        shutil.copystat(source, target)


@contextlib.contextmanager
def _locked(run_dir: Path):
    """An exclusive lock while config.yaml is compared and written: on a regular file opened for
    writing (`.config.lock` in the run folder), as flock needs on NFS."""
    with open(Path(run_dir) / CONFIG_LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield
