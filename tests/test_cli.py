"""The `grpo` command's top level: its usage, a mistyped command, and output cut short by its reader."""

import os
import subprocess
import sys

import pytest
from conftest import REPO
from helpers import closed_pipe

from grpo.cli import COMMANDS, EXIT_CLOSED_READER, main


def test_usage_lists_every_command_and_a_mistyped_one_is_named(capsys):
    assert main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    assert main(["trian"]) == 2
    assert capsys.readouterr().err.startswith("grpo: unknown command 'trian'\n")


GRPO = [sys.executable, "-c", "from grpo.cli import entry; entry()"]  # the console script


def run_grpo(args, stdout, unbuffered=False, command=GRPO):
    """The console script (or a script of scripts/) as a shell runs it: stdout buffered in a pipe, unless
    `unbuffered`."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    env.update({"PYTHONUNBUFFERED": "1"} if unbuffered else {})
    return subprocess.run([*command, *args], cwd=REPO, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True,
                          timeout=120)


def run_with_reader_gone(args, unbuffered=False, command=GRPO):
    with closed_pipe() as stdout:
        return run_grpo(args, stdout, unbuffered, command)


@pytest.mark.parametrize("args", [["--help"], *([name, "--help"] for name in COMMANDS)], ids=" ".join)
def test_help_into_a_closed_pipe_ends_quietly_with_its_own_code(args):
    """`grpo --help | grep -q train`: grep exits at its first match; no traceback, and the help's exit 0."""
    proc = run_with_reader_gone(args)
    assert (proc.returncode, proc.stderr) == (0, "")


def test_a_failing_command_keeps_its_code_and_a_command_the_closed_pipe_stopped_exits_141(tmp_path):
    missing = ["check", str(tmp_path / "no-run"), "--steps", "1"]
    failed = run_grpo(missing, subprocess.DEVNULL)
    assert failed.returncode not in (0, EXIT_CLOSED_READER)
    assert run_with_reader_gone(missing).returncode == failed.returncode  # the verdict survives a closed reader
    stopped = run_with_reader_gone(["--help"], unbuffered=True)  # the usage's own print fails
    assert (stopped.returncode, stopped.stderr) == (EXIT_CLOSED_READER, "")


def test_python_dash_m_grpo_ends_as_the_command_does():
    """`python -m grpo` is the `grpo` command with a given interpreter: the same exit into a closed pipe."""
    proc = run_with_reader_gone(["check", "--help"], command=[sys.executable, "-m", "grpo"])
    assert (proc.returncode, proc.stderr) == (0, "")
