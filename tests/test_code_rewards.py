"""The unit_tests rewards, the built-in python tool and the generated code tasks: worked scores,
and the programs a gaming policy writes to pass tests it does not solve (exit early, print what a
passing run prints, patch assert or the harness, write into the answer pipe, read the expected
values), each scored as the failure it is."""

import json

import pytest

from grpo.data.code_tasks import FAMILIES, code_task_rows, task_row
from grpo.environments.pool import EnvironmentPool
from grpo.rewards.code_tests import completion_code, split_test
from grpo.rewards.sandbox import RewardFailed, RewardSandbox

ROW = {"tests": ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 5) == 15"],
       "reference_answer": "def add(a, b):\n    return a + b"}


@pytest.fixture(scope="module")
def sandbox():
    jail = RewardSandbox(timeout_s=20.0)
    yield jail
    jail.close()


def fenced(code: str) -> str:
    return f"Here it is:\n```python\n{code}\n```\nDone."


def test_the_code_is_read_from_the_fences_an_answer_block_or_an_unclosed_fence():
    assert completion_code("```python\nx = 1\n```\ntext\n```py\ny = 2\n```\n```python\ncut") == "x = 1\n\ny = 2\n"
    assert completion_code("```python\nx = 1\n```\nso:\n```\nadd(2, 3) -> 5\n```") == "x = 1\n"  # prose skipped
    assert completion_code("<answer>z = 3</answer>") == "z = 3"
    assert completion_code("```python\nw = 4\nreturn") == "w = 4\nreturn"
    assert completion_code("v = 5") == "v = 5"


def test_value_tests_are_split_from_the_rest():
    assert split_test("assert add(2, 3) == 5") == ("value", "add(2, 3)", 5)
    assert split_test("assert f('a') == ['a', 1]") == ("value", "f('a')", ["a", 1])
    assert split_test("assert math.isclose(f(1), 0.5)") == ("run", "assert math.isclose(f(1), 0.5)", None)
    assert split_test("assert f(1) == g(1)") == ("run", "assert f(1) == g(1)", None)  # not a literal


def test_worked_scores(sandbox):
    right, wrong_one = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a + b if a != 10 else 0"
    assert sandbox("unit_tests", fenced(right), ROW) == 1.0
    assert sandbox("unit_tests_partial", fenced(right), ROW) == 1.0
    assert sandbox("unit_tests", fenced(wrong_one), ROW) == 0.0
    assert sandbox("unit_tests_partial", fenced(wrong_one), ROW) == pytest.approx(2 / 3)
    assert sandbox("unit_tests_partial", "no code at all", ROW) == 0.0
    assert sandbox("unit_tests_partial", fenced("def add(a, b):\n    return a +"), ROW) == 0.0  # does not compile
    assert sandbox("unit_tests", fenced(right), {"reference_answer": ""}) is None  # no tests: does not apply
    # a run test (not a value): passes by running; setup code runs first
    row = {"tests": ["assert math.isclose(half(1), 0.5)"], "test_setup": "import math"}
    assert sandbox("unit_tests", fenced("def half(x):\n    return x / 2"), row) == 1.0


def test_values_compare_as_the_assert_does(sandbox):
    """numpy values, a named tuple, a Counter, a frozenset and a float off by 1e-12 pass as `==` (and
    evalplus's float tolerance) would have them; a tuple for a list does not, as `==` would not."""
    row = {"tests": ["assert f(0) == 3", "assert f(1) == (1, 2)", "assert f(2) == {'a': 2}", "assert f(3) == {1, 2}",
                     "assert f(4) == 0.3", "assert f(5) == [1, 2]"]}
    code = ("import collections, numpy as np\nP = collections.namedtuple('P', 'x y')\n"
            "def f(n):\n    return [np.int64(3), P(1, 2), collections.Counter('aa'), frozenset({1, 2}), 0.1 + 0.2,"
            " (1, 2)][n]\n")
    assert sandbox("unit_tests_partial", fenced(code), row) == pytest.approx(5 / 6)


def test_a_main_block_does_not_run_and_rows_of_other_test_forms_fail_naming_why(sandbox):
    main = "def add(a, b):\n    return a + b\nif __name__ == '__main__':\n    print(add(int(input()), 1))"
    assert sandbox("unit_tests", fenced(main), ROW) == 1.0
    row = {"tests": "import math\n# the checks\nassert math.floor(add(2.5, 0)) == 2"}  # an import, a comment
    assert sandbox("unit_tests", fenced(main), row) == 1.0
    for tests, why in (([{"input": "1", "output": "2"}], "must be assert statements"),
                       ("def check(candidate):\n    assert candidate(1) == 2", "not an assert or an import"),
                       (["add(1, 2)"], "not an assert or an import")):
        with pytest.raises(RewardFailed, match=why):
            sandbox("unit_tests", fenced(main), {"tests": tests})


GAMING = {
    "exits before the tests": "import os\nos._exit(0)",
    "prints a passing run": "import sys, json\nprint(json.dumps([['value', '5'], ['value', '0'], ['value', '15']]))"
                            "\nsys.stdout.flush()\nimport os\nos._exit(0)",
    "writes a passing answer to every descriptor": "import os, json\nfor fd in range(1, 64):\n    try:\n"
                                                   "        os.write(fd, json.dumps([['value', '5']] * 3).encode())\n"
                                                   "    except OSError:\n        pass\nos._exit(0)",
    "patches the harness's repr": "import builtins\nbuiltins.repr = lambda v: '5'\ndef add(a, b):\n    return 0",
    "returns an object equal to anything": "class Any:\n    def __eq__(self, o):\n        return True\n"
                                           "    def __repr__(self):\n        return '5'\n"
                                           "def add(a, b):\n    return Any()",
    "raises SystemExit": "raise SystemExit(0)",
    "reads the expected values": "import gc\n"
                                 "found = [o for o in gc.get_objects() if isinstance(o, dict) and 'tests' in o]\n"
                                 "def add(a, b):\n    return int(found[0]['tests'][0].split('==')[1]) if found else 0",
}


@pytest.mark.parametrize("attack", list(GAMING))
def test_a_program_that_games_the_tests_scores_what_it_computes(sandbox, attack):
    """Each passes at most the test whose value it happens to compute (the patched repr's '5' is the
    first test's, which it cannot return for the others): never all three."""
    score = sandbox("unit_tests_partial", fenced(GAMING[attack]), ROW)
    assert score <= 1 / 3, attack
    assert sandbox("unit_tests", fenced(GAMING[attack]), ROW) == 0.0


def test_a_program_that_hangs_or_floods_fails_its_tests_not_the_reward(sandbox):
    row = {**ROW, "timeout_s": 1.0}
    assert sandbox("unit_tests_partial", fenced("while True:\n    pass"), row) == 0.0
    assert sandbox("unit_tests_partial", fenced("def add(a, b):\n    return 'x' * 10**7"), row) == 0.0


def test_unit_tests_refuse_to_run_outside_the_jail():
    from grpo.rewards.code_tests import unit_tests

    with pytest.raises(RuntimeError, match="runs only in the rewards' jail"):
        unit_tests(fenced("def add(a, b):\n    return a + b"), ROW)


def test_a_unit_tests_reward_without_a_jail_is_a_config_error():
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="unit_tests, which runs the model's code: it runs only in the rewards' jail"):
        load_config("config.yaml", ["rewards.names=[unit_tests]", "rewards.weights=[1.0]", "rewards.timeout_s=0"])
    with pytest.raises(ConfigError, match="the rewards name unit_tests_partial, which runs the model's code"):
        load_config("config.yaml", ["rewards.accuracy_reward=unit_tests_partial", "rewards.timeout_s=0"])


def test_the_built_in_python_tool_runs_code_in_the_jail():
    pool = EnvironmentPool("tools", {"tools": ["python"], "parser": "hermes"}, 20.0)
    try:
        def run(code):
            message = '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>' % json.dumps(code)
            reply, failure = pool.step("e", {}, [], message)
            return reply.text[0], failure
        assert run("print(sum(range(10)))") == ("45\n", None)
        assert run("import sys\nprint('bad', file=sys.stderr)\nsys.exit(3)") == ("bad\n(exit code 3)", None)
        assert run("open('/etc/shadow').read()")[0].endswith("PermissionError: [Errno 13] Permission denied: "
                                                           "'/etc/shadow'\n(exit code 1)")
    finally:
        pool.close()


def test_generated_code_tasks_are_deterministic_and_their_reference_passes(sandbox):
    rows = code_task_rows("train", {"size": 40})
    assert rows == code_task_rows("train", {"size": 40}) and rows[7] == task_row(7)
    assert {row["question"].split("`")[1].split("(")[0].rstrip("_0123456789") for row in rows} >= {"add", "square"}
    held_out = code_task_rows("test", {"test_size": 100})
    assert not {r["question"] for r in held_out} & {r["question"] for r in code_task_rows("train", {})}
    multiples = [r for r in rows + held_out if "multiple" in r["question"]]
    assert multiples and all(any("True" in t for t in r["tests"]) and any("False" in t for t in r["tests"])
                             for r in multiples)  # `return False` never passes a whole row
    for row in [task_row(seed) for seed in range(len(FAMILIES) * 2)] + held_out[:10]:
        assert sandbox("unit_tests", fenced(row["answer"]), row) == 1.0, row
    with pytest.raises(ValueError, match="code-tasks has no setting 'difficulty'"):
        code_task_rows("train", {"difficulty": 2})
