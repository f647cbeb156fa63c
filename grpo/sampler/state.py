"""A sampler's resumable state: the next step to make and the data cursor, saved after each send."""

from __future__ import annotations

import json
from pathlib import Path

from grpo.files import write_atomically


class SamplerState:
    """The next step and the data cursor, saved together after each send (atomically)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def of_sampler(cls, run_dir: Path, sampler: int) -> "SamplerState":
        return cls(Path(run_dir) / ("sampler_state.json" if sampler == 0 else f"sampler{sampler}_state.json"))

    def load(self) -> dict | None:
        if not self.path.is_file():
            return None
        return json.loads(self.path.read_text())

    def save(self, next_step: int, cursor: dict) -> None:
        write_atomically(self.path, json.dumps({"next_step": next_step, "cursor": cursor}))
