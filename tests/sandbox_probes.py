"""Tools for the tests, named by path (env.tools=[tests/sandbox_probes.py:python]): code execution,
what a model is given to run its code and will try to escape through (tests/test_sandbox.py), and
tools whose calls are checked against their schema or whose errors are long (tests/test_tools.py)."""

import contextlib
import io
import subprocess


def python(code: str) -> str:
    """Run Python code in the tool's process and return what it prints.

    Args:
        code: The Python code to run.
    """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {"__name__": "__tool__"})
    return out.getvalue()


def shell(command: str) -> str:
    """Run a shell command and return what it prints.

    Args:
        command: The command line.
    """
    done = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def scale(values: list[int], factor: float, exact: bool = False) -> list:
    """Multiply each value by a factor.

    Args:
        values: The whole numbers to scale.
        factor: The factor.
        exact: Whether to keep fractions.
    """
    return [v * factor for v in values]


def shout(size: int) -> str:
    """Fail with an error message of `size` characters.

    Args:
        size: How long the error message is.
    """
    raise ValueError("x" * size)


def run_completion(completion: str, row: dict) -> float:
    """A rule reward that runs the completion as code (what a unit-test reward does): its score is the
    `score` the code leaves, 1.0 where it set `escaped` true (the probes of tests/test_sandbox.py)."""
    namespace = {"__name__": "__reward__", "row": row}
    exec(completion, namespace)
    return float(namespace.get("score", 1.0 if namespace.get("escaped") else 0.0))


class CodeRunner:
    """An environment that runs the model's message as a Python program through the jail (run_tool
    with the built-in python tool): what an environment of coding tasks does."""

    def __init__(self, row: dict):
        self.row = row

    def step(self, message: str):
        from grpo.environments import Reply
        from grpo.environments.tools import run_tool

        return Reply(text=run_tool("python", {"code": message}))


class InOwnProcess:
    """An environment that runs the model's message in its own process (what no environment should do;
    here to see what that process holds): the printed output is the reply."""

    def __init__(self, row: dict):
        self.row = row

    def step(self, message: str):
        import contextlib
        import io

        from grpo.environments import Reply

        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(message, {})
        return Reply(text=printed.getvalue())
