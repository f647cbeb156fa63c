"""The shared-prefix layout as FlexAttention's block mask: a packed row's attention in one fused kernel.

With `model.attn_implementation=flex_attention` the shared-prefix forward hands the whole row to torch's
FlexAttention (through transformers' own compiled call) with this mask instead of running two attentions a group:
a token sees earlier tokens of its own group's prompt and, in a completion, its own completion's past. The mask
is built once a forward from two labels a token (its group, and 0 in a prompt or j + 1 in completion j) and
shared by every layer; FlexAttention skips the blocks it rules out whole.
"""

from __future__ import annotations

from typing import Sequence

import torch


def token_labels(groups: Sequence, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(group index, segment) of each token of a row packed from `groups` (GroupSpan, back to back from 0):
    segment 0 in the prompt, j + 1 in the group's completion j."""
    group, segment = [], []
    for g, span in enumerate(groups):
        lens = [span.prompt_len, *span.completion_lens]
        group.append(torch.full((sum(lens),), g, dtype=torch.int32))
        segment.append(torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens)))
    return torch.cat(group).to(device), torch.cat(segment).to(device)


def row_block_mask(groups: Sequence, device: torch.device):
    """FlexAttention's BlockMask of the row: query q sees key k <= q of its own group whose segment is the prompt's
    or q's own."""
    from torch.nn.attention.flex_attention import create_block_mask

    group, segment = token_labels(groups, device)

    def visible(batch, head, q, k):
        return (group[q] == group[k]) & (k <= q) & ((segment[k] == 0) | (segment[k] == segment[q]))

    length = len(group)
    # compiled on a GPU, as transformers builds its own masks: uncompiled it materialises the [L, L] mask first
    return create_block_mask(visible, B=None, H=None, Q_LEN=length, KV_LEN=length, device=device,
                             _compile=device.type == "cuda")
