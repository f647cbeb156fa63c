"""The built-in `python` tool (env.tools: [python]): the model's code run by a Python of its own.

Like every tool it is called in a jail of its own (grpo/common/jail.py: no network, no file of the run
but its temporary folder, budgets for the whole call), so the model's code reaches nothing that
scores it; inside the call it runs in a subprocess (`python -I`), so whatever it does to its own
process, the tool's answer is what that process printed and how it ended.
"""

from __future__ import annotations

import subprocess
import sys

RUN_TIMEOUT_S = 10.0  # the code's time; env.timeout_s bounds the whole step


def python(code: str) -> str:
    """Run Python code and return what it prints (stdout, then stderr).

    Args:
        code: The Python program to run.
    """
    try:
        done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, errors="replace",
                              timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"error: the code ran past {RUN_TIMEOUT_S:g} s"
    output = done.stdout + done.stderr
    return output if done.returncode == 0 else f"{output}(exit code {done.returncode})"
