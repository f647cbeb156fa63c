"""A RolloutBatch's groups: their token costs and the sub-batch of some of them (the trainer's shards)."""

from __future__ import annotations

import torch

from grpo.model.sharding import group_token_cost
from grpo.wire.batch import FIELDS, RolloutBatch


def group_costs(batch: RolloutBatch) -> list[int]:
    return [group_token_cost(p, batch.completion_ids[s]) for p, s in zip(batch.prompt_ids, batch.group_slices())]


def select_groups(batch: RolloutBatch, groups: list[int]) -> RolloutBatch:
    """The sub-batch holding `groups`: every per-prompt, per-completion and per-token field (FIELDS)
    keeps those groups' entries; whole-batch fields (the global denominators too) are kept as they are."""
    slices = batch.group_slices()
    rows = [j for i in groups for j in range(slices[i].start, slices[i].stop)]
    index = torch.tensor(rows, dtype=torch.long)
    picked = {}
    for f in FIELDS:
        value = getattr(batch, f.name)
        if value is None or not f.rows:
            picked[f.name] = value
        elif f.rows == "prompt":
            picked[f.name] = [value[i] for i in groups]
        elif isinstance(value, torch.Tensor):
            picked[f.name] = value[index]
        else:
            picked[f.name] = [value[j] for j in rows]
    return RolloutBatch(**picked)
