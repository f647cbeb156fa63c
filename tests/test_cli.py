"""The `grpo` command's top level: its usage, a mistyped command, and output cut short by its reader."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

from grpo.cli import COMMANDS, EXIT_CLOSED_READER, main


def test_usage_lists_every_command_and_a_mistyped_one_is_named(capsys):
    assert main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    assert main(["trian"]) == 2
    assert capsys.readouterr().err.startswith("grpo: unknown command 'trian'\n")


def run_grpo(args, stdout, unbuffered=False):
    """The console script as a shell runs it: stdout buffered in a pipe, unless `unbuffered`."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONUNBUFFERED"}
    env.update({"PYTHONUNBUFFERED": "1"} if unbuffered else {})
    return subprocess.run([sys.executable, "-c", "from grpo.cli import entry; entry()", *args], cwd=REPO, env=env,
                          stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=120)


def run_with_reader_gone(args, unbuffered=False):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write fails with EPIPE
    try:
        return run_grpo(args, write_end, unbuffered)
    finally:
        os.close(write_end)


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
