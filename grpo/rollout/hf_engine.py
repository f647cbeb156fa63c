"""transformers `generate` that prefills each prompt once and expands its KV cache G ways.

Plain `generate` on G copies of a prompt runs the prompt's prefill G times. Here the B
prompts are prefilled once (all but their last token), the cache is repeated G ways along
the batch, and `generate` continues from it. Large B x G is generated in chunks of at most
`generation_batch_size` sequences, each chunk taking some completions of every prompt, and
the result is put back in prompt-major order.
"""

from __future__ import annotations

import copy

import torch

from grpo.completions import chunk_major_to_prompt_major, cut_at_eos
from grpo.rollout import Rollouts


def eos_token_ids(tokenizer, model) -> list[int]:
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


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


class SampledLogprobs:
    """Records log softmax(logits / T) of each token `generate` draws: the behaviour policy's
    log-probs, without a second forward pass over the completions.

    A logits processor passed to `generate` runs before its temperature / top-p warpers, so it
    sees the raw logits. The token drawn at step t is known only at step t+1 (the last input
    id), so each call settles the step before; `finish` settles the last one.
    """

    def __init__(self, temperature: float):
        self.temperature, self.pending, self.steps = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.pending is not None:
            self.steps.append(self.pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.pending = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[N, steps] log-probs; `last_tokens` is the last column `generate` returned."""
        steps = [*self.steps, self.pending.gather(-1, last_tokens[:, None]).squeeze(-1)]
        return torch.stack(steps, dim=1)


class HFEngine:
    def __init__(self, model, tokenizer, sampling_cfg):
        self.model, self.tokenizer, self.cfg = model, tokenizer, sampling_cfg
        self.eos_ids = eos_token_ids(tokenizer, model)

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
                       past_key_values=cache, use_cache=True)
        return cache

    def generate(self, prompts: list[list[int]], group_size: int, *, greedy: bool = False,
                 seed: int | None = None, record_logps: bool = False) -> Rollouts:
        """`record_logps`: also return each sampled token's log-prob (`Rollouts.engine_logps`)."""
        cfg = self.cfg
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = self._prefill(ids, mask) if ids.shape[1] > 1 else None
        plan = chunk_plan(len(prompts), group_size, cfg.generation_batch_size)
        if seed is not None:
            torch.manual_seed(seed)
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=cfg.temperature,
                                                             top_p=cfg.top_p, top_k=cfg.top_k or None)
        produced, truncated, logps = [], [], []
        for k in plan:
            chunk_cache = None
            if cache is not None:
                chunk_cache = cache if len(plan) == 1 else copy.deepcopy(cache)
                chunk_cache.batch_repeat_interleave(k)
            recorder = SampledLogprobs(1.0 if greedy else cfg.temperature) if record_logps else None
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=ids.repeat_interleave(k, 0), attention_mask=mask.repeat_interleave(k, 0),
                    past_key_values=chunk_cache, max_new_tokens=cfg.max_new_tokens,
                    eos_token_id=self.eos_ids, pad_token_id=self.tokenizer.pad_token_id,
                    logits_processor=[recorder] if recorder else None, **sampling)
            completions = out[:, ids.shape[1]:]
            recorded = recorder.finish(completions[:, -1]).cpu() if recorder else None
            for i, row in enumerate(completions.cpu()):
                tokens, cut = cut_at_eos(row, self.eos_ids)
                produced.append(tokens)
                truncated.append(cut)
                if recorded is not None:
                    logps.append(recorded[i, :len(tokens)].clone())
        def prompt_major(items):
            return chunk_major_to_prompt_major(items, len(prompts), plan)

        return Rollouts(prompt_major(produced), prompt_major(truncated), prompt_major(logps) if record_logps else None)
