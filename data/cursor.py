"""A resumable position in the shuffled dataset: (epoch, index) plus the seed.

Each epoch is a fresh permutation drawn from (seed, epoch), so the order is reproducible and
a restored cursor continues exactly where the saved one stopped.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from grpo.common.files import write_atomically


@dataclass
class CursorState:
    seed: int
    size: int
    epoch: int = 0
    index: int = 0


class PromptCursor:
    def __init__(self, size: int, seed: int):
        if size < 1:
            raise ValueError("cannot iterate over an empty dataset")
        self.state = CursorState(seed=seed, size=size)
        self._order = self._permutation(0)
        self._at: tuple[int, list[int]] = (0, self._order)  # `at`'s epoch and its order

    def _permutation(self, epoch: int) -> list[int]:
        generator = torch.Generator().manual_seed(self.state.seed * 1_000_003 + epoch)
        return torch.randperm(self.state.size, generator=generator).tolist()

    def take(self, count: int) -> list[int]:
        """The next `count` dataset indices, crossing into the next epoch when needed."""
        out = []
        while len(out) < count:
            if self.state.index == self.state.size:
                self.state.epoch += 1
                self.state.index = 0
                self._order = self._permutation(self.state.epoch)
            out.append(self._order[self.state.index])
            self.state.index += 1
        return out

    def at(self, position: int) -> int:
        """The dataset index at `position` of the stream from the start of epoch 0, where `take` would
        give it; the cursor's own position is not moved (each epoch's order is made once in a row)."""
        epoch, index = divmod(position, self.state.size)
        if self._at[0] != epoch:
            self._at = (epoch, self._permutation(epoch))
        return self._at[1][index]

    def seek(self, consumed: int) -> None:
        """Position the cursor after `consumed` prompts from the start of epoch 0."""
        self.state.epoch, self.state.index = divmod(consumed, self.state.size)
        self._order = self._permutation(self.state.epoch)

    def state_dict(self) -> dict:
        return asdict(self.state)

    def load_state_dict(self, state: dict) -> None:
        restored = CursorState(**state)
        if (restored.seed, restored.size) != (self.state.seed, self.state.size):
            raise ValueError(
                f"saved cursor is for seed {restored.seed} and {restored.size} prompts, but this run has "
                f"seed {self.state.seed} and {self.state.size} prompts; start a new run folder or restore the data"
            )
        self.state = restored
        self._order = self._permutation(restored.epoch)

    def save(self, path: str | os.PathLike) -> None:
        write_atomically(path, json.dumps(self.state_dict()))

    def restore(self, path: str | os.PathLike) -> bool:
        """Load a saved state if the file exists; True when restored."""
        path = Path(path)
        if not path.is_file():
            return False
        self.load_state_dict(json.loads(path.read_text()))
        return True
