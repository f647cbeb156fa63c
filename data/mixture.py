"""A mixture of datasets (data.sources): each prompt drawn from source k with probability w_k / sum(w),
by a seeded draw that is a function of its position in the stream, so that a restart, a seek and N
samplers draw the same prompts; within each source its prompts go round in the shuffled order of a
PromptCursor of its own (every prompt once a pass)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import torch

from grpo.data.cursor import PromptCursor

BLOCK = 4096  # positions whose sources are drawn together (one generator per block: seeking is cheap)
SOURCE_KEYS = ("path", "weight", "split", "prompt_column", "answer_column", "answer_format", "hub_config", "few_shot",
               "task_args")  # what a data.sources entry may set; the rest is the data section's


def source_configs(data_cfg) -> list:
    """The data sections the training prompts come from: one per data.sources entry (its own keys over
    data's), or data itself without sources."""
    return [dataclasses.replace(data_cfg, sources=[], **{k: v for k, v in entry.items() if k != "weight"})
            for entry in data_cfg.sources] or [data_cfg]


def evaluation_source(data_cfg):
    """The data section evaluations read: data.eval_path in data.path's place when it is set, else the
    first training source (data.path itself without data.sources)."""
    if data_cfg.eval_path:
        return dataclasses.replace(data_cfg, path=data_cfg.eval_path, sources=[])
    return source_configs(data_cfg)[0]


def source_problems(entry) -> list[str]:
    """What is wrong with one data.sources entry (named by its path), for the config's error."""
    if not isinstance(entry, dict):
        return [f"data.sources entries are mappings such as {{path: gsm8k-embedded, weight: 3}}; got {entry!r}"]
    name = entry.get("path", "?")
    problems = [f"data.sources: {name}: unknown key {key!r} (it may set {', '.join(SOURCE_KEYS)})"
                for key in entry if key not in SOURCE_KEYS]
    if not isinstance(entry.get("path"), str) or not entry["path"]:
        problems.append(f"data.sources: an entry has no path: {entry!r}")
    weight = entry.get("weight")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
        problems.append(f"data.sources: {name}: weight must be a number > 0; got {weight!r}")
    return problems


@dataclass
class MixtureState:
    seed: int
    sizes: list[int]
    weights: list[float]
    position: int = 0


class MixtureCursor:
    """PromptCursor's interface (take, seek, state_dict) over the concatenated prompts of the sources:
    indices into that table, source k's at offsets[k] + its own index."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int):
        self.state = MixtureState(seed=seed, sizes=list(sizes), weights=[float(w) for w in weights])
        self.offsets = [sum(sizes[:k]) for k in range(len(sizes))]
        self.cursors = [PromptCursor(size, seed * 7919 + k) for k, size in enumerate(sizes)]
        self._counts: dict[int, list[int]] = {0: [0] * len(sizes)}  # block -> draws of each source before it
        self._drawn_block: tuple[int, list[int]] = (-1, [])  # the last block drawn, reused while taking from it

    def _block(self, block: int) -> list[int]:
        if self._drawn_block[0] != block:
            generator = torch.Generator().manual_seed(self.state.seed * 1_000_003 + block)
            self._drawn_block = (block, torch.multinomial(torch.tensor(self.state.weights, dtype=torch.float64),
                                                          BLOCK, replacement=True, generator=generator).tolist())
        return self._drawn_block[1]

    def _drawn_before(self, position: int) -> list[int]:
        """How many of the first `position` draws took each source."""
        block, within = divmod(position, BLOCK)
        while block not in self._counts:
            last = max(b for b in self._counts if b < block)
            counts = list(self._counts[last])
            for k in self._block(last):
                counts[k] += 1
            self._counts[last + 1] = counts
        counts = list(self._counts[block])
        for k in self._block(block)[:within]:
            counts[k] += 1
        return counts

    def take(self, count: int) -> list[int]:
        """The next `count` indices into the concatenated prompts."""
        start = self.state.position
        drawn = self._drawn_before(start)
        sources = [self._block(p // BLOCK)[p % BLOCK] for p in range(start, start + count)]
        out = []
        for k in sources:
            out.append(self.offsets[k] + self.cursors[k].at(drawn[k]))
            drawn[k] += 1
        self.state.position += count
        return out

    def seek(self, consumed: int) -> None:
        """Position the stream after `consumed` draws from its start."""
        self.state.position = consumed

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        restored = MixtureState(**state)
        mine = (self.state.seed, self.state.sizes, self.state.weights)
        if (restored.seed, restored.sizes, [float(w) for w in restored.weights]) != mine:
            raise ValueError(f"saved cursor is for seed {restored.seed}, sources of {restored.sizes} prompts and "
                             f"weights {restored.weights}, but this run has seed {mine[0]}, {mine[1]} and "
                             f"{mine[2]}; start a new run folder or restore the data")
        self.state = restored
