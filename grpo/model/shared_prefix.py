"""Shared-prefix packing: one row `[prompt | c_1 | ... | c_G]` per group, the prompt computed once.

Each completion's positions continue from the prompt's end, and each completion attends to
the prompt and to its own earlier tokens only, so every completion token sees exactly the
context it would see in the plain `[prompt | c_j]` row. Several groups share a row (a packed
batch of one) when they fit a token budget, so there is no padding at all.

The attention is hooked in through transformers' AttentionInterface under its own name; the
model's attention modules, RoPE and PEFT LoRA layers run unmodified. The layout reaches the
attention function as a keyword argument of the forward call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import torch
import torch.nn.functional as F

from grpo.model import flex_prefix, prefix_attention
from grpo.model.sharding import group_token_cost, pack_micro_batches

ATTENTION_NAME = "grpo_shared_prefix"


@dataclass
class GroupSpan:
    """Where one group sits in a packed row."""

    start: int  # row offset of the prompt's first token
    prompt_len: int  # P
    completion_lens: list[int]  # C_1 .. C_G
    prompt: int = 0  # its prompt's index in the batch
    _mask: torch.Tensor | None = field(default=None, repr=False)

    @property
    def completions_len(self) -> int:
        return sum(self.completion_lens)

    @property
    def end(self) -> int:
        return self.start + self.prompt_len + self.completions_len

    def completion_mask(self, device: torch.device) -> torch.Tensor:
        """bool [Lc, P + Lc]: completion queries see the whole prompt and their own past.

        Built once per forward and reused by every layer. It covers only the completion
        queries of one group, not the whole row, and is shared by all heads.
        """
        if self._mask is None or self._mask.device != device:
            lens = torch.tensor(self.completion_lens, device=device)
            segment = torch.repeat_interleave(torch.arange(len(lens), device=device), lens)  # [Lc]
            position = torch.arange(self.completions_len, device=device)  # [Lc]
            own_past = (segment[:, None] == segment[None, :]) & (position[None, :] <= position[:, None])  # [Lc, Lc]
            prompt = torch.ones(self.completions_len, self.prompt_len, dtype=torch.bool, device=device)  # [Lc, P]
            self._mask = torch.cat([prompt, own_past], dim=1)  # [Lc, P + Lc]
        return self._mask


@dataclass
class PackedRow:
    """One forward's input: several groups back to back, with what to read out of it."""

    input_ids: torch.Tensor  # int64 [L]
    position_ids: torch.Tensor  # int64 [L]
    groups: list[GroupSpan]
    completion_index: list[int]  # global index of each completion in this row, in row order
    hidden_index: torch.Tensor  # int64 [M]: row position whose output predicts each target
    targets: torch.Tensor  # int64 [M]: the completion tokens, in row order
    _block_mask: object = field(default=None, repr=False)

    def block_mask(self, device: torch.device):
        """The row's layout as FlexAttention's BlockMask (grpo/model/flex_prefix.py): built once a forward and
        reused by every layer, and by the recomputation of gradient checkpointing."""
        if self._block_mask is None or self._block_mask.kv_indices.device != device:
            self._block_mask = flex_prefix.row_block_mask(self.groups, device)
        return self._block_mask


def group_bounds(group_sizes: Sequence[int]) -> list[tuple[int, int]]:
    """[(first completion index, one past the last)] per group, prompt-major."""
    bounds, start = [], 0
    for g in group_sizes:
        bounds.append((start, start + g))
        start += g
    return bounds


def pack_groups(prompt_ids: Sequence[torch.Tensor], completion_ids: Sequence[torch.Tensor],
                group_sizes: Sequence[int], max_tokens: int) -> list[PackedRow]:
    """Pack whole groups, in order, into rows of at most `max_tokens` tokens.

    A group larger than the budget gets a row of its own (a group is never split: its
    completions must see the same prompt computation).
    """
    bounds = group_bounds(group_sizes)
    costs = [group_token_cost(prompt_ids[i], completion_ids[a:b]) for i, (a, b) in enumerate(bounds)]
    rows = pack_micro_batches(list(range(len(bounds))), costs, max_tokens)
    return [_build_row(groups, prompt_ids, completion_ids, bounds) for groups in rows]


def _build_row(group_indices, prompt_ids, completion_ids, bounds) -> PackedRow:
    ids, positions, spans, order, hidden, targets = [], [], [], [], [], []
    offset = 0
    for i in group_indices:
        prompt = prompt_ids[i]
        P = len(prompt)
        a, b = bounds[i]
        span = GroupSpan(offset, P, [len(c) for c in completion_ids[a:b]], prompt=i)
        ids.append(prompt)
        positions.append(torch.arange(P))
        cursor = offset + P
        for j in range(a, b):
            c = completion_ids[j]
            C = len(c)
            ids.append(c)
            positions.append(torch.arange(P, P + C))
            # token t of c_j is predicted by the prompt's last token (t = 0) or by c_j[t-1]
            hidden.append(torch.cat([torch.tensor([offset + P - 1]), torch.arange(cursor, cursor + C - 1)]))
            targets.append(c)
            order.append(j)
            cursor += C
        spans.append(span)
        offset = cursor
    return PackedRow(torch.cat(ids).long(), torch.cat(positions).long(), spans, order,
                     torch.cat(hidden).long(), torch.cat(targets).long())


def shared_prefix_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            shared_prefix_row=None, base_attention=None, base_name="", **kwargs):
    """AttentionInterface function; query [1, H, L, D], key/value [1, Hkv, L, D] -> [1, L, H, D].

    Without a layout (generation, plain forwards) it is the model's own kernel. With one and the
    model's kernel FlexAttention: the whole row in one call under the row's block mask. Otherwise, per
    group: the prompt attends causally to itself; the completion queries attend to the group's
    keys (a contiguous slice of the row: prompt then completions, so the prompt's keys and
    values are never copied) under the group's completion mask.
    """
    if shared_prefix_row is None:
        return base_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if base_name == "flex_attention":
        return base_attention(module, query, key, value, shared_prefix_row.block_mask(query.device),
                              dropout=dropout, scaling=scaling, **kwargs)
    gqa = query.shape[1] != key.shape[1]
    # CPU: the exact block-sparse kernel (no mask, no wasted completion x other-completion
    # scores). Elsewhere: SDPA with the group's mask (memory-efficient kernels take masks).
    block_sparse = prefix_attention.available(query.device)
    pieces = []
    for g in shared_prefix_row.groups:
        s, p, e = g.start, g.start + g.prompt_len, g.end
        pieces.append(F.scaled_dot_product_attention(
            query[:, :, s:p], key[:, :, s:p], value[:, :, s:p], is_causal=True, scale=scaling,
            enable_gqa=gqa))  # [1, H, P, D]
        if e == p:
            continue
        if block_sparse:
            pieces.append(prefix_attention.prefix_merged_attention(
                query[:, :, p:e], key[:, :, s:p], value[:, :, s:p], key[:, :, p:e], value[:, :, p:e],
                g.completion_lens, scaling))  # [1, H, Lc, D]
        else:
            pieces.append(F.scaled_dot_product_attention(
                query[:, :, p:e], key[:, :, s:e], value[:, :, s:e], attn_mask=g.completion_mask(query.device),
                scale=scaling, enable_gqa=gqa))  # [1, H, Lc, D]
    out = torch.cat(pieces, dim=2)  # [1, H, L, D]
    return out.transpose(1, 2).contiguous(), None


# Compiled graphs FlexAttention may keep (torch's default 8): row lengths past the first, block counts, one-block
# rows, with and without grad; past the limit torch falls back to the unfused kernel, which holds [L, L] scores
FLEX_RECOMPILE_LIMIT = 64

# A 4D mask makes transformers skip building its own [L, L] mask; the function above ignores it.
NO_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)


def install_shared_prefix_attention(causal_lm) -> None:
    """Route the model's attention through `shared_prefix_attention`, for good.

    Installed once rather than switched around each call: gradient checkpointing re-runs the
    forward during backward, and it must take the same path then. The model's original kernel
    stays in charge whenever no layout is passed (generation, the plain path).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = causal_lm.config._attn_implementation
    if base.startswith(ATTENTION_NAME):
        return
    if base not in ALL_ATTENTION_FUNCTIONS or base not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"the shared-prefix forward wraps a registered attention kernel (sdpa, flash_attention_2, "
                         f"flex_attention); this model uses '{base}': set model.attn_implementation=sdpa")
    if base == "flex_attention":  # transformers compiles FlexAttention once; each new row layout may compile again
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, FLEX_RECOMPILE_LIMIT)
    name = f"{ATTENTION_NAME}:{base}"
    AttentionInterface.register(name, partial(shared_prefix_attention, base_attention=ALL_ATTENTION_FUNCTIONS[base],
                                              base_name=base))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    causal_lm.config._attn_implementation = name
