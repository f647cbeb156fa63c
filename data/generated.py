"""The splits of a task generated offline (data/code_tasks.py, data/shapes.py): each row drawn from a seed of its own,
the train split from `seed` on, the held-out one (`test`) from `test_seed` on, far from every train seed."""

from __future__ import annotations

SPLIT_SETTINGS = ("size", "seed", "test_size", "test_seed")
TEST_SEED_OFFSET = 1_000_000_000  # the held-out rows' first seed past the train seed, by default


def row_seeds(path: str, settings: tuple[str, ...], split: str, task_args: dict, size: int, test_size: int,
              seed: int) -> list[int]:
    """Each row's seed in `split` (`train` or `test`); ValueError naming a setting `path` does not have (its
    `settings`), or another split. `size`, `test_size`, `seed`: the defaults of the task's settings."""
    unknown = sorted(set(task_args) - set(settings))
    if unknown:
        raise ValueError(f"data.task_args: {path} has no setting {', '.join(map(repr, unknown))}; its settings: "
                         f"{', '.join(settings)}")
    if split not in ("train", "test"):
        raise ValueError(f"{path} has the splits train and test; got {split!r} (data.split / eval.split)")
    first = int(task_args.get("seed", seed))
    if split == "train":
        return list(range(first, first + int(task_args.get("size", size))))
    start = int(task_args.get("test_seed", first + TEST_SEED_OFFSET))
    return list(range(start, start + int(task_args.get("test_size", test_size))))
