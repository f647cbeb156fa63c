"""Completion bookkeeping: cutting at EOS, truncation, and chunk-major reordering."""

from __future__ import annotations

from typing import Sequence, TypeVar

import torch

T = TypeVar("T")


def eos_token_ids(tokenizer, model) -> list[int]:
    """The tokenizer's EOS and the checkpoint's generation_config EOS list (both engines stop at these)."""
    ids = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids.update(configured if isinstance(configured, list) else [configured])
    return sorted(i for i in ids if i is not None)


def cut_at_eos(tokens: torch.Tensor, eos_token_ids: Sequence[int]) -> tuple[torch.Tensor, bool]:
    """Keep tokens up to and including the first EOS; (tokens, truncated).

    `truncated` means no EOS was produced: the completion hit the length limit. What follows
    the first EOS (more EOS, or pad tokens that may equal EOS) is dropped, so padding is never
    mistaken for content and EOS always counts as the completion's last token.
    """
    is_eos = torch.isin(tokens, torch.tensor(list(eos_token_ids), device=tokens.device))  # [T]
    if not bool(is_eos.any()):
        return tokens, True
    first = int(is_eos.int().argmax())
    return tokens[: first + 1], False


def chunk_major_to_prompt_major(items: Sequence[T], num_prompts: int, per_chunk: Sequence[int]) -> list[T]:
    """Reorder generation output to prompt-major.

    Chunk c produced `per_chunk[c]` completions for every prompt, prompt by prompt:
    [p0 x per_chunk[0], p1 x per_chunk[0], ..., p0 x per_chunk[1], ...]. The result holds
    prompt 0's completions from every chunk in chunk order, then prompt 1's, and so on.
    """
    if len(items) != num_prompts * sum(per_chunk):
        raise ValueError(f"{len(items)} items do not match {num_prompts} prompts x {list(per_chunk)} per chunk")
    out: list[T] = []
    for prompt in range(num_prompts):
        chunk_start = 0
        for count in per_chunk:
            first = chunk_start + prompt * count
            out.extend(items[first:first + count])
            chunk_start += num_prompts * count
    return out
