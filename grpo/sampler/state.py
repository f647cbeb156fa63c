"""A sampler's resumable state: the next step to make and the data cursor, saved after each send;
what a start that trained nothing left is dropped when the next start has other settings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grpo.common.files import write_atomically
from grpo.wire.delivery import Spool


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


def drop_a_start_made_otherwise(run_dir: Path, sampler: int, settings: dict) -> bool:
    """In a run of which no step was trained (the caller checks: grpo.run.start.trained_nothing),
    drop what an earlier start of this sampler left, its saved position and spooled batches, when
    that start had other `settings` (the ones they depend on) or did not record them: kept, they
    would re-send batches that a trainer with other settings refuses, or restore a cursor over
    other data. This start then makes them again from step 0. Records `settings` for the next
    start; True when it dropped something."""
    state, spool = SamplerState.of_sampler(run_dir, sampler), Spool.of_sampler(run_dir, sampler)
    record = Path(run_dir) / ("sampler_settings.json" if sampler == 0 else f"sampler{sampler}_settings.json")
    settings = json.loads(json.dumps(settings))  # as the record reads back
    made_otherwise = not record.is_file() or json.loads(record.read_text()) != settings
    dropped = made_otherwise and (state.path.is_file() or bool(spool.steps()))
    if dropped:
        state.path.unlink(missing_ok=True)
        spool.prune(below=sys.maxsize)
    if made_otherwise:
        write_atomically(record, json.dumps(settings))
    return dropped
