"""The completions a person reads first when a reward misbehaves: each step's first few samples with
their prompt, what the model wrote, each reward and the advantage. They travel in the batch's header
(`meta["completions"]`) to the trainer, which writes them to <run.dir>/completions.jsonl and to the
tracker's table at the step they trained (grpo/run/metrics_log.py)."""

from __future__ import annotations

import json
import math

# the header holds every record: a long completion is cut to this many characters, and says so; the
# records together stay within MAX_SHOWN_BYTES of JSON (the batch header's cap is 4 MiB: grpo/wire/codec.py)
MAX_SHOWN_CHARS = 16_000
MAX_SHOWN_BYTES = 1 << 20


def shown_text(text: str, limit: int = MAX_SHOWN_CHARS) -> str:
    """`text`, or its first `limit` characters and how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... [{len(text) - limit} more characters]"


def shown_completions(count: int, prompts: list, completions: list[str], reward_names: list[str],
                      per_function: list[list[float]], failed: list[list[bool]], totals: list[float],
                      advantages: list[float], group_size: int) -> list[dict]:
    """The first `count` samples (prompt-major: the first prompts' groups) as JSON-safe records:
    `prompt` (the chat turns the prompt was rendered from), `completion` (an episode's: its whole
    conversation, the environment's turns included), `rewards` (each function's value before
    weighting; None where it failed on the sample), `reward` (the weighted total the advantage was
    computed from) and `advantage`. The first ones whose JSON fits MAX_SHOWN_BYTES together."""
    records, size = [], 0
    for i in range(min(count, len(completions))):
        prompt = prompts[i // group_size]
        records.append({
            "sample_id": prompt.problem.id,
            "prompt": [{"role": t["role"], "content": shown_text(str(t["content"]))} for t in prompt.turns],
            "completion": shown_text(completions[i]),
            "rewards": {name: None if failed[i][j] or not math.isfinite(per_function[i][j]) else per_function[i][j]
                        for j, name in enumerate(reward_names)},
            "reward": totals[i] if math.isfinite(totals[i]) else None,
            "advantage": advantages[i]})
        size += len(json.dumps(records[-1]))  # as the header encodes it (non-ASCII escaped: up to 6 bytes each)
        if size > MAX_SHOWN_BYTES:
            return records[:-1]
    return records
