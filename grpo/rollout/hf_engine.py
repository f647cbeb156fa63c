"""transformers `generate` that prefills each prompt once and expands its KV cache G ways.

Plain `generate` on G copies of a prompt runs the prompt's prefill G times. Here the B
prompts are prefilled once (all but their last token), the cache is repeated G ways along
the batch, and `generate` continues from it. Large B x G is generated in chunks of at most
`generation_batch_size` sequences, each chunk taking some completions of every prompt, and
the result is put back in prompt-major order. Tokens are drawn by `TokenSampler`, which also
records their log-probs (used as the old log-probs with `sampling.old_logps=generation`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
from pathlib import Path
from typing import Sequence

import torch

from grpo.completions import chunk_major_to_prompt_major, cut_at_eos, eos_token_ids
from grpo.models import unwrap_causal_lm
from grpo.rollout import Rollouts
from grpo.weights import INITIAL_DIGEST, Staged, stage_into


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def chunk_plan(num_prompts: int, group_size: int, max_sequences: int) -> list[int]:
    """Completions per prompt in each chunk, e.g. B=2, G=8, max 6 -> [3, 3, 2]."""
    per_chunk = max(1, max_sequences // num_prompts)
    plan = []
    while sum(plan) < group_size:
        plan.append(min(per_chunk, group_size - sum(plan)))
    return plan


class TokenSampler:
    """Draws each next token inside `generate`, which runs greedy and so takes the one token
    this leaves finite; records the drawn token's log-prob on the way.

    Sampling is inverse-CDF from softmax(logits / T) after top-k / top-p (transformers' own
    warpers): torch.multinomial takes ~25 ms per step for 16 x 49k probabilities on one CPU
    thread, about 8% of a decode step of the embedded model; a cumulative sum and a binary
    search take ~2 ms. A processor passed to `generate` sees the raw logits, so the recorded
    log-prob is the one under the untruncated softmax(logits / T), as the trainer computes it.
    """

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0, greedy: bool = False):
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.temperature, self.greedy, self.logps = (1.0 if greedy else temperature), greedy, []
        self.warpers = ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logits = scores.float() / self.temperature
        tokens = logits.argmax(-1) if self.greedy else self._draw(input_ids, logits)
        self.logps.append(torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1))
        return torch.full_like(scores, float("-inf")).scatter_(-1, tokens[:, None], 0.0)

    def _draw(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            logits = warper(input_ids, logits)
        probs = torch.softmax(logits, dim=-1)
        cdf = probs.cumsum(-1)
        u = torch.rand(len(cdf), 1, device=cdf.device) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)  # right: never a zero-probability token
        last_possible = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # u rounded up to the total
        return torch.minimum(tokens, last_possible)

    def recorded(self) -> torch.Tensor:
        """[N, steps] log-probs of the drawn tokens."""
        return torch.stack(self.logps, dim=1)


@contextlib.contextmanager
def only_our_generation_config(model, eos_ids: list[int], pad_id: int):
    """Generate with a generation config that holds nothing but EOS and padding.

    `generate` fills every setting we leave unset from the checkpoint's own `generation_config`
    (repetition penalty, no-repeat n-grams, suppressed tokens, ...), and their processors would
    change the logits before `TokenSampler` draws: the tokens would come from another
    distribution than the softmax(logits / T) recorded here and recomputed by the trainer
    (0.12 apart on a tiny model with repetition_penalty 2). So the checkpoint's config is set
    aside for the call; temperature, top-k and top-p are `sampling.*`, applied by `TokenSampler`.
    """
    from transformers import GenerationConfig

    target = unwrap_causal_lm(model)
    shipped = target.generation_config
    target.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=pad_id)
    try:
        yield
    finally:
        target.generation_config = shipped


class HFEngine:
    """The `RolloutEngine` on a transformers model, which is also the sampler's scoring model."""

    def __init__(self, model, tokenizer, sampling_cfg):
        self.model, self.tokenizer, self.cfg = model, tokenizer, sampling_cfg
        self.eos_ids = eos_token_ids(tokenizer, model)  # the checkpoint's EOS list counts; its processors do not
        self.version, self.weights_digest = 0, INITIAL_DIGEST

    def stage_weights(self, folder: Path, manifest: dict, version: int) -> Staged:
        staged = stage_into(self.model, folder, manifest)

        def commit():
            staged.commit()
            self.version, self.weights_digest = version, manifest["digest"]
        return Staged(commit)

    def load_weights(self, folder: Path, manifest: dict, version: int) -> None:
        self.stage_weights(folder, manifest, version).commit()

    def close(self) -> None:
        pass  # the model is the sampler's; nothing of the engine's own to release

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        """Run every prompt token but the last once; generate() then starts from this cache."""
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() uses with left padding
        with torch.no_grad():
            self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                       past_key_values=cache, use_cache=True, **self._one_logit_row)
        return cache

    @functools.cached_property
    def _one_logit_row(self) -> dict:
        """Only the cache is wanted from the prefill: the LM head on one row instead of every
        prompt token's (2 x hidden x vocab FLOPs and a [tokens, vocab] float tensor each)."""
        forward = inspect.signature(unwrap_causal_lm(self.model).forward).parameters
        return {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    def generate(self, prompts: list[list[int]], group_size: int, *, seed: int | None = None,
                 greedy: bool = False, max_new_tokens: Sequence[int] | None = None) -> Rollouts:
        cfg = self.cfg
        limits = list(max_new_tokens) if max_new_tokens is not None else [cfg.max_new_tokens] * len(prompts)
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = self._prefill(ids, mask) if ids.shape[1] > 1 else None
        plan = chunk_plan(len(prompts), group_size, cfg.generation_batch_size)
        if seed is not None:
            torch.manual_seed(seed)
        produced, truncated, logps = [], [], []
        for k in plan:
            chunk_cache = None
            if cache is not None:
                chunk_cache = cache if len(plan) == 1 else copy.deepcopy(cache)
                chunk_cache.batch_repeat_interleave(k)
            sampler = TokenSampler(cfg.temperature, cfg.top_k, cfg.top_p, greedy=greedy)
            with torch.no_grad(), only_our_generation_config(self.model, self.eos_ids, self.tokenizer.pad_token_id):
                out = self.model.generate(
                    input_ids=ids.repeat_interleave(k, 0), attention_mask=mask.repeat_interleave(k, 0),
                    past_key_values=chunk_cache, max_new_tokens=max(limits), do_sample=False,
                    eos_token_id=self.eos_ids, pad_token_id=self.tokenizer.pad_token_id, logits_processor=[sampler])
            recorded = sampler.recorded().cpu()
            for i, row in enumerate(out[:, ids.shape[1]:].cpu()):  # chunk rows: k per prompt, prompt-major
                tokens, cut = cut_at_eos(row[:limits[i // k]], self.eos_ids)
                produced.append(tokens)
                truncated.append(cut)
                logps.append(recorded[i, :len(tokens)].clone())

        def prompt_major(items):
            return chunk_major_to_prompt_major(items, len(prompts), plan)

        return Rollouts(prompt_major(produced), prompt_major(truncated), prompt_major(logps))
