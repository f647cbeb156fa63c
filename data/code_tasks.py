"""Small Python tasks with unit tests, generated offline: `data.path: code-tasks`.

Each row asks for one function ("Write a Python function `add_7(x)` that returns x plus 7.") and
carries a reference solution (`answer`) and value tests (`tests`: `assert add_7(3) == 10`), which
the `unit_tests` rewards run in the rewards' jail (rewards/code_tests.py). Ten families of task,
each drawn with its own constants from a seed, so the same settings give the same rows on every
machine and nothing is stored. The held-out split (`test`) asks only the five families with a
constant, drawn from ranges the train split never uses (`add_41` ... `add_99`, letters e-h), so
none of its questions is a train question. `data.task_args`: `size` and `seed` of the train split,
`test_size` and `test_seed` of the held-out one.
"""

from __future__ import annotations

import random

from grpo.data.generated import SPLIT_SETTINGS, row_seeds

PATH = "code-tasks"
DEFAULT_SIZE, DEFAULT_TEST_SIZE, DEFAULT_SEED = 2_000, 200, 0
SETTINGS = SPLIT_SETTINGS
INPUTS = 3  # tests per task


def _constant(r, split: str, train: range, held_out: range) -> int:
    """A task's constant: from `train` for the train split, from `held_out` (disjoint) for the test split."""
    return r.choice(train if split == "train" else held_out)


def _add(r, split):
    k = _constant(r, split, range(2, 41), range(41, 100))
    return (f"add_{k}(x)", f"returns x plus {k}", f"def add_{k}(x):\n    return x + {k}",
            [(f"add_{k}({a})", a + k) for a in r.sample(range(-50, 100), INPUTS)])


def _times(r, split):
    k = _constant(r, split, range(2, 13), range(13, 30))
    return (f"times_{k}(x)", f"returns x multiplied by {k}", f"def times_{k}(x):\n    return x * {k}",
            [(f"times_{k}({a})", a * k) for a in r.sample(range(-20, 50), INPUTS)])


def _is_multiple(r, split):
    k = _constant(r, split, range(2, 10), range(10, 16))
    multiples, others = [n for n in range(100) if n % k == 0], [n for n in range(100) if n % k]
    values = r.sample([r.choice(multiples), *r.sample(others, INPUTS - 2), r.choice(multiples + others)], INPUTS)
    return (f"is_multiple_of_{k}(n)", f"returns True when n is a multiple of {k}, else False",
            f"def is_multiple_of_{k}(n):\n    return n % {k} == 0",
            [(f"is_multiple_of_{k}({n})", n % k == 0) for n in values])  # a True and a False in every row


def _repeat(r, split):
    k = _constant(r, split, range(2, 5), range(5, 8))
    words = ["".join(r.choice("xyz") for _ in range(r.randint(1, 3))) for _ in range(INPUTS)]
    return (f"repeat_{k}(s)", f"returns the string s written {k} times in a row",
            f"def repeat_{k}(s):\n    return s * {k}", [(f"repeat_{k}({w!r})", w * k) for w in words])


def _count(r, split):
    c = r.choice("abcd" if split == "train" else "efgh")
    words = ["".join(r.choice(f"{c}{c}xyz") for _ in range(r.randint(3, 9))) for _ in range(INPUTS)]
    return (f"count_{c}(s)", f"returns how many times the letter '{c}' occurs in the string s",
            f"def count_{c}(s):\n    return s.count({c!r})", [(f"count_{c}({w!r})", w.count(c)) for w in words])


def _square(r, split):
    return ("square(x)", "returns x squared", "def square(x):\n    return x * x",
            [(f"square({a})", a * a) for a in r.sample(range(-30, 30), INPUTS)])


def _reverse(r, split):
    words = ["".join(r.choice("abcdefghij") for _ in range(r.randint(2, 7))) for _ in range(INPUTS)]
    return ("reverse(s)", "returns the string s reversed", "def reverse(s):\n    return s[::-1]",
            [(f"reverse({w!r})", w[::-1]) for w in words])


def _largest(r, split):
    lists = [r.sample(range(-50, 50), r.randint(2, 6)) for _ in range(INPUTS)]
    return ("largest(xs)", "returns the largest number in the list xs", "def largest(xs):\n    return max(xs)",
            [(f"largest({xs})", max(xs)) for xs in lists])


def _total(r, split):
    lists = [[r.randint(-20, 20) for _ in range(r.randint(1, 6))] for _ in range(INPUTS)]
    return ("total(xs)", "returns the sum of the numbers in the list xs", "def total(xs):\n    return sum(xs)",
            [(f"total({xs})", sum(xs)) for xs in lists])


def _ends(r, split):
    lists = [r.sample(range(0, 60), r.randint(2, 6)) for _ in range(INPUTS)]
    return ("ends(xs)", "returns a list of the first and the last item of the list xs",
            "def ends(xs):\n    return [xs[0], xs[-1]]", [(f"ends({xs})", [xs[0], xs[-1]]) for xs in lists])


WITH_CONSTANTS = (_add, _times, _is_multiple, _repeat, _count)  # the held-out split's: other constants
FAMILIES = (*WITH_CONSTANTS, _square, _reverse, _largest, _total, _ends)


def task_row(seed: int, split: str = "train") -> dict:
    """Row `seed` of a split: its question, reference solution and value tests."""
    r = random.Random(seed)
    families = FAMILIES if split == "train" else WITH_CONSTANTS
    signature, does, solution, cases = families[r.randrange(len(families))](r, split)
    return {"question": f"Write a Python function `{signature}` that {does}.", "answer": solution,
            "tests": [f"assert {call} == {expected!r}" for call, expected in cases]}


def is_code_tasks(path: str) -> bool:
    return path == PATH


def code_task_rows(split: str, task_args: dict) -> list[dict]:
    """The rows of a split (`train` or `test`); ValueError naming a setting it does not have."""
    seeds = row_seeds(PATH, SETTINGS, split, task_args, DEFAULT_SIZE, DEFAULT_TEST_SIZE, DEFAULT_SEED)
    return [task_row(seed, split) for seed in seeds]
