"""How a batch was made: the sampler's behaviour settings and the digest of the weights it
sampled with travel in every batch header, and the trainer checks both before it trains on it.

A sampler started with `sampling.temperature=0.7` and a trainer with 0.9 would otherwise train
with wrong importance ratios and say nothing; the same for top-p/top-k, the completion limit and
its masking, the model, its dtype and the tokenizer. The weights digest (the sha256 of the
version's manifest.json, grpo/weights/folder.py) proves per batch that the sampler ran a version this
run's trainer published, e.g. not one left in a `weights.dir` by another run.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import TYPE_CHECKING

from grpo.settings.tree import get_key
from grpo.weights.folder import INITIAL_DIGEST
from grpo.wire.staleness import too_stale

if TYPE_CHECKING:
    from grpo.settings import Config

# config keys that change the behaviour log-probs, which tokens the loss sees, or how stale a batch may be
BEHAVIOUR_KEYS = ("sampling.temperature", "sampling.top_p", "sampling.top_k", "sampling.min_p",
                  "sampling.repetition_penalty", "sampling.stop", "sampling.max_new_tokens",
                  "model.name_or_path", "model.dtype", "sampling.dtype",
                  "sampling.num_workers", "sampling.max_staleness", "weights.publish_every",
                  # the sampler's copy scales by its own alpha
                  "lora.enabled", "lora.r", "lora.alpha", "lora.target_modules", "lora.use_rslora", "lora.use_dora",
                  "lora.modules_to_save", "model.train_vision",
                  "env.name", "env.max_turns", "agent.entrypoint", "agent.command", "agent.max_turns",
                  "distill.teacher")  # whose log-probs the batch carries


class BehaviourMismatch(ValueError):
    """A batch made with other settings than the trainer's."""


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (first 16 hex digits) of the vocabulary and the special tokens."""
    text = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.eos_token_id, tokenizer.pad_token_id,
                       getattr(tokenizer, "bos_token_id", None)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def behaviour_of(cfg: Config, tokenizer, objective: dict) -> dict:
    """What the sampler records in each batch header (and the trainer expects): the settings above,
    the tokenizer, and the objective (its header) the batch's loss tokens, denominators and
    advantages were made for."""
    return {**{key: get_key(cfg, key) for key in BEHAVIOUR_KEYS}, "tokenizer": tokenizer_fingerprint(tokenizer),
            "objective": objective}


def check_behaviour(recorded: dict, expected: dict, sampler: int, step: int) -> None:
    """Raise naming every key on which the batch's making differs from the trainer's settings. A setting the
    batch does not record was not one when it was made (a batch spooled before an upgrade): its sampler ran as
    the setting's default does."""
    made = {**setting_defaults(), **recorded}
    differences = [f"{key}: the sampler used {made.get(key)!r}, this trainer has {value!r}"
                   for key, value in expected.items() if made.get(key) != value]
    if differences:
        raise BehaviourMismatch(f"sampler {sampler} step {step} was made with other settings than this trainer's; "
                                f"nothing was trained with it. Start both with the same config: "
                                + "; ".join(differences))


@functools.cache
def setting_defaults() -> dict:
    """Each of BEHAVIOUR_KEYS at its default."""
    from grpo.settings import Config

    defaults = Config()
    return {key: get_key(defaults, key) for key in BEHAVIOUR_KEYS}


def check_staleness(trainer_version: int, batch_version: int, max_staleness: int, sampler: int, step: int) -> None:
    """Raise when a batch's weights are more than `max_staleness` versions older than the trainer's
    policy about to train on it (the sampler waits for them, so only a sampler with another bound
    or a bug gets here)."""
    if too_stale(batch_version, trainer_version, max_staleness):
        raise BehaviourMismatch(
            f"sampler {sampler} step {step} was sampled with weights v{batch_version}, "
            f"{trainer_version - batch_version} "
            f"versions behind this trainer's v{trainer_version}; sampling.max_staleness={max_staleness} allows "
            f"{max_staleness}. Nothing was trained with it.")


def check_weights_digest(version: int, digest: str, published: dict[int, set[str]], sampler: int, step: int) -> None:
    """Raise unless `digest` is one this run published as `version` (`grpo.weights.folder.published_digests`)."""
    known = {INITIAL_DIGEST} if version == 0 else published.get(version, set())
    if digest not in known:
        raise BehaviourMismatch(
            f"sampler {sampler} step {step} was sampled with weights v{version} whose manifest sha256 is "
            f"{digest[:16]}, but this trainer published v{version} as "
            f"{', '.join(sorted(d[:16] for d in known)) or 'nothing'}; "
            "nothing was trained with it. Does the sampler read this run's weights (weights.dir, run.dir)?")


MANTISSA_BITS = {"float32": 24, "float16": 11, "bfloat16": 8}


def uncorrected_precision_gap(cfg: Config) -> str:
    """What to tell the user when the sampler computes in a lower precision than the trainer and
    no importance-sampling correction is on (empty otherwise): docs/results.md measured a mean
    log-prob gap of ~0.03 for a bfloat16 sampler against a float32 trainer."""
    if cfg.training.importance_sampling != "none" or \
            MANTISSA_BITS[cfg.sampler_dtype] >= MANTISSA_BITS[cfg.model.dtype]:
        return ""
    return (f"the sampler runs in {cfg.sampler_dtype} and the trainer in {cfg.model.dtype}: their log-probs differ "
            "(~0.03 on average for bfloat16 against float32, logged as sampling/sampling_logp_difference/mean) and "
            "training.importance_sampling=none does not correct it; consider token_truncate")
