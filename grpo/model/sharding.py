"""Splitting a batch's groups across ranks and micro-batches, always whole (a batch's own groups and
sub-batches: grpo/trainer/groups.py).

A group (a prompt and its G completions) is the unit: the shared-prefix forward needs the
prompt with all of its completions. Ranks get groups balanced by token cost (longest
processing time first); there is no divisibility rule, and a rank may get none.
"""

from __future__ import annotations

import torch


def group_token_cost(prompt: torch.Tensor, completions) -> int:
    """Tokens one group puts through the shared-prefix forward: its prompt plus its completions."""
    return len(prompt) + sum(len(c) for c in completions)


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
