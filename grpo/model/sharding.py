"""Splitting a RolloutBatch across ranks and micro-batches, always by whole groups.

A group (a prompt and its G completions) is the unit: the shared-prefix forward needs the
prompt with all of its completions. Ranks get groups balanced by token cost (longest
processing time first); there is no divisibility rule, and a rank may get none.
"""

from __future__ import annotations

import torch

from grpo.wire.batch import FIELDS, RolloutBatch


def group_token_cost(prompt: torch.Tensor, completions) -> int:
    """Tokens one group puts through the shared-prefix forward: its prompt plus its completions."""
    return len(prompt) + sum(len(c) for c in completions)


def group_costs(batch: RolloutBatch) -> list[int]:
    return [group_token_cost(p, batch.completion_ids[s]) for p, s in zip(batch.prompt_ids, batch.group_slices())]


def shard_groups(costs: list[int], world_size: int) -> list[list[int]]:
    """Group indices per rank, greedily balancing total cost (biggest group first), each in order."""
    loads = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shards[rank].append(i)
        loads[rank] += costs[i]
    return [sorted(s) for s in shards]


def pack_micro_batches(groups: list[int], costs: list[int], max_tokens: int) -> list[list[int]]:
    """Consecutive groups per micro-batch under `max_tokens` (a bigger group goes alone)."""
    out: list[list[int]] = []
    load = 0
    for i in groups:
        if not out or load + costs[i] > max_tokens:
            out.append([])
            load = 0
        out[-1].append(i)
        load += costs[i]
    return out


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
