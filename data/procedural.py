"""Procedural tasks from reasoning-gym as prompt/answer rows: `data.path: reasoning-gym:<task>`.

reasoning-gym (PyPI) generates verifiable reasoning problems, each with its own scorer, from a
seed: the same settings give the same rows on every machine, so nothing is stored. The split
`train` is `create_dataset(task, size, seed, **settings)`; the split `test` (the held-out set)
is the same task and settings from a seed a billion rows away, with every question that the train split also
holds (and every repeat) removed, so the two are disjoint whatever the task's value space. `data.task_args` holds
the task's own settings (the fields of its config class: difficulty ranges and the like) plus
`size` and `seed` of the train split and `test_size` and `test_seed` of the held-out one.

Each row is `{"question", "answer", "metadata"}` as reasoning-gym makes it (the metadata made
JSON-safe: it crosses to the reward process as JSON) plus `entry`, the task, settings and index
it was generated from: the `reasoning_gym` reward (rewards/procedural.py) regenerates that entry
and scores with the task's own scorer on it, as reasoning-gym itself would.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import random

from grpo.data.generated import SPLIT_SETTINGS, TEST_SEED_OFFSET

PREFIX = "reasoning-gym:"
SPLITS = ("train", "test")
DEFAULT_SIZE = 10_000  # train rows: a 60-minute run on 2 CPU cores asks for ~2,000 prompts
DEFAULT_TEST_SIZE = 1_000  # generated held-out rows, before removing those the train split holds
DEFAULT_SEED = 0
# reasoning-gym draws row i from Random(seed + i): seeds 0 and 1 share all but one row. The held-out
# rows start TEST_SEED_OFFSET from the train seed, so no train split below a billion rows reaches them.
OWN_KEYS = SPLIT_SETTINGS  # ours; every other key is the task's


class TaskError(ValueError):
    """A reasoning-gym task or setting that does not exist; the message names the config key."""


def is_procedural(path: str) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def task_names() -> list[str]:
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def task_of(path: str) -> str:
    """The task a `reasoning-gym:<task>` path names; TaskError with the valid names otherwise."""
    task = path[len(PREFIX):]
    names = task_names()
    if task not in names:
        raise TaskError(f"data.path={path!r}: reasoning-gym has no task {task!r}; valid tasks: {', '.join(names)}")
    return task


def split_settings(task_args: dict, split: str) -> dict:
    """The keyword arguments of `reasoning_gym.create_dataset` for one split (a pure function).
    The held-out seed defaults to the train seed + TEST_SEED_OFFSET: rows the train split never draws."""
    if split not in SPLITS:
        raise TaskError(f"a reasoning-gym task has the splits {', '.join(SPLITS)}; got {split!r} "
                        "(data.split / eval.split)")
    settings = {k: v for k, v in task_args.items() if k not in OWN_KEYS}
    seed = task_args.get("seed", DEFAULT_SEED)
    if split == "train":
        return {**settings, "size": task_args.get("size", DEFAULT_SIZE), "seed": seed}
    return {**settings, "size": task_args.get("test_size", DEFAULT_TEST_SIZE),
            "seed": task_args.get("test_seed", seed + TEST_SEED_OFFSET)}


def create(task: str, settings: dict):
    """The reasoning-gym dataset; a setting the task does not have, or a bad value, is a TaskError."""
    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    fields = [f.name for f in dataclasses.fields(DATASETS[task][1])]
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise TaskError(f"data.task_args: reasoning-gym task {task!r} has no setting {', '.join(map(repr, unknown))}; "
                        f"its settings: {', '.join(f for f in fields if f not in OWN_KEYS)} (and ours: "
                        f"{', '.join(OWN_KEYS)})")
    try:
        return reasoning_gym.create_dataset(task, **settings)
    except (AssertionError, TypeError, ValueError) as e:
        raise TaskError(f"data.task_args {settings} are not valid for reasoning-gym task {task!r}: "
                        f"{type(e).__name__}: {e}") from None


def json_safe(value):
    """Tuples become lists and anything JSON has no type for becomes its string (for logs and the
    wire; a scorer gets the task's own entry instead, `original_entry`)."""
    return json.loads(json.dumps(value, default=str))


def task_rows(path: str, split: str, task_args: dict) -> list[dict]:
    """The rows of one split: train as generated, test without the questions train holds. Each
    row names its entry (`entry`: task, settings, index), from which the scorer regenerates it."""
    task = task_of(path)
    settings = json_safe(split_settings(task_args, split))
    # through the scorer's cache: the reward sandbox, forked after the data is loaded, starts with
    # the dataset built (some tasks precompute every question: seconds, within its time limit)
    key = _settings_key(settings)
    rows = [{"question": e["question"], "answer": str(e["answer"]), "metadata": json_safe(e["metadata"]),
             "entry": {"task": task, "settings": settings, "index": i}}
            for i, e in ((i, _entry(task, key, i)) for i in range(len(_dataset(task, key))))]
    if split == "test":  # distinct questions that train does not hold
        train = _settings_key(split_settings(task_args, "train"))
        seen = {_entry(task, train, i)["question"] for i in range(len(_dataset(task, train)))}
        generated = len(rows)
        rows = [row for row in rows if row["question"] not in seen and not seen.add(row["question"])]
        if not rows:  # a small value space: the train split already holds every question
            raise TaskError(f"data.task_args: all {generated} held-out rows of {path} are questions the train split "
                            f"holds ({len(seen)} distinct); lower data.task_args.size or widen the task's settings")
    return rows


def _settings_key(settings: dict) -> str:
    """A split's settings as the caches' key: the same JSON however they were written."""
    return json.dumps(json_safe(settings), sort_keys=True)


@functools.lru_cache(maxsize=8)
def _dataset(task: str, settings_json: str):
    return create(task, json.loads(settings_json))


@functools.lru_cache(maxsize=4096)  # a group's G completions share one entry
def _entry(task: str, settings_json: str, index: int) -> dict:
    """Entry `index`, the same wherever and whenever it is made: some tasks (list_functions) draw from
    Python's global `random` as they make an entry, so it is seeded from the entry's name for the call."""
    state = random.getstate()
    random.seed(f"{task}|{settings_json}|{index}")
    try:
        return _dataset(task, settings_json)[index]
    finally:
        random.setstate(state)


def original_entry(reference: dict) -> dict:
    """The task's own entry a row was made from, regenerated from its seed as reasoning-gym made it
    (tuples, sets and objects in its metadata intact: JSON would turn them into other types, which
    some scorers then compare unequal). `reference` is a row's `entry`."""
    entry = _entry(str(reference["task"]), _settings_key(reference["settings"]), int(reference["index"]))
    return copy.deepcopy(entry)  # a scorer may write to it


def check_task(path: str, task_args: dict) -> None:
    """Fail now, in one line, on a task or setting that does not exist (config validation)."""
    create(task_of(path), {**split_settings(task_args, "train"), "size": 1})
