"""The `reasoning_gym` reward: a reasoning-gym task's own scorer on the last <answer> block.

Rows of `data.path=reasoning-gym:<task>` (data/procedural.py) carry the task's metadata, whose
`source_dataset` names the task, and the reference of the entry they were made from, which is
regenerated for the scorer (data.procedural.original_entry); its `score_answer` gives 1.0 for a right answer, 0.0 for a
wrong or missing one, and for some tasks partial credit between. A row of another dataset has no
task: the reward does not apply to it (None).
"""

from __future__ import annotations

import functools

from grpo.rewards.gsm8k_answer import last_answer_block


@functools.lru_cache(maxsize=None)
def task_scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym_score(completion: str, row: dict) -> float | None:
    """The task's score of the last <answer> block (stripped) against the task's own entry; 0.0
    without a block; None off a task's rows."""
    metadata = row.get("metadata")
    task = metadata.get("source_dataset") if isinstance(metadata, dict) else None
    if not task:
        return None
    block = last_answer_block(completion)
    if isinstance(row.get("entry"), dict):
        from grpo.data.procedural import original_entry

        entry = original_entry(row["entry"])
    else:  # a row made elsewhere (a user's own dataset of reasoning-gym rows): as the row holds it
        entry = {"question": row.get("question", ""), "answer": row.get("answer", row.get("reference_answer")),
                 "metadata": metadata}
    return float(task_scorer(task)(block.strip() if block is not None else None, entry))


def _prepare(row: dict) -> None:
    """Run where the reward's jail forks its calls (grpo/common/jail.py), from the row alone: the task's
    scorer and its dataset built there once, so that no call builds them again (some tasks
    precompute every question: seconds)."""
    metadata = row.get("metadata")
    if isinstance(metadata, dict) and metadata.get("source_dataset"):
        task_scorer(metadata["source_dataset"])
        if isinstance(row.get("entry"), dict):
            from grpo.data.procedural import original_entry

            original_entry(row["entry"])


reasoning_gym_score.prepare = _prepare

