"""Samples of several rows: an agent's session whose request did not continue what the model had read goes on in a
new row, read after the prompt alone (grpo/agent/tokens.py NEW_ROW). A sample's `segments` say which row each of its
tokens is in. The log-prob passes take each row as a completion of its own in its group (the prompt still computed
once per group), and the rows' values are joined back into their sample's: the losses, the advantages and the
sequence-level ratios (GSPO) see the sample whole, and each token is read in the context it was sampled in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def split_rows(completion_ids: Sequence[torch.Tensor], group_sizes: Sequence[int],
               segments: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """(every row as a completion of its own, prompt-major; each group's size in rows; each sample's row count).
    `segments`: per sample, int [C_j], its tokens' row indices (0, 0, ..., 1, 1, ...)."""
    rows, counts = [], []
    for ids, segment in zip(completion_ids, segments, strict=True):
        lengths = torch.bincount(segment.long(), minlength=1).tolist() if len(segment) else [0]
        rows += list(torch.split(ids, lengths))
        counts.append(len(lengths))
    sizes, start = [], 0
    for g in group_sizes:
        sizes.append(sum(counts[start:start + g]))
        start += g
    return rows, sizes, counts


def join_rows(values: Sequence[torch.Tensor], counts: Sequence[int]) -> list[torch.Tensor]:
    """Per-row tensors [C_r] back into one per sample, `counts[j]` rows each, in order (differentiable)."""
    out, start = [], 0
    for n in counts:
        out.append(values[start] if n == 1 else torch.cat(list(values[start:start + n])))
        start += n
    return out


def has_rows(segments: Sequence[torch.Tensor] | None) -> bool:
    """Whether any sample holds more than one row."""
    return segments is not None and any(len(s) and int(s[-1]) > 0 for s in segments)
