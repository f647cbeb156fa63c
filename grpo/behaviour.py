"""How a batch was made: the sampler's behaviour settings travel in every batch header, and the
trainer checks them against its own config before it trains on the batch.

A sampler started with `sampling.temperature=0.7` and a trainer with 0.9 would otherwise train
with wrong importance ratios and say nothing; the same for top-p/top-k, the completion limit and
its masking, the model, its dtype and the tokenizer.
"""

from __future__ import annotations

import hashlib
import json

from grpo.config import get_key

# config keys that change the behaviour log-probs or which tokens the loss sees
BEHAVIOUR_KEYS = ("sampling.temperature", "sampling.top_p", "sampling.top_k", "sampling.max_new_tokens",
                  "training.mask_truncated_completions", "model.name_or_path", "model.dtype")


class BehaviourMismatch(ValueError):
    """A batch made with other settings than the trainer's."""


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 (first 16 hex digits) of the vocabulary and the special tokens."""
    text = json.dumps([sorted(tokenizer.get_vocab().items()), tokenizer.eos_token_id, tokenizer.pad_token_id,
                       getattr(tokenizer, "bos_token_id", None)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def behaviour_of(cfg, tokenizer) -> dict:
    """What the sampler records in each batch header (and the trainer expects)."""
    return {**{key: get_key(cfg, key) for key in BEHAVIOUR_KEYS}, "tokenizer": tokenizer_fingerprint(tokenizer)}


def check_behaviour(recorded: dict, expected: dict, sampler: int, step: int) -> None:
    """Raise naming every key on which the batch's making differs from the trainer's settings."""
    differences = [f"{key}: the sampler used {recorded.get(key)!r}, this trainer has {value!r}"
                   for key, value in expected.items() if recorded.get(key) != value]
    if differences:
        raise BehaviourMismatch(f"sampler {sampler} step {step} was made with other settings than this trainer's; "
                                f"nothing was trained with it. Start both with the same config: "
                                + "; ".join(differences))
