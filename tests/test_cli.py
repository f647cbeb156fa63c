"""The `grpo` command's top level: its usage, a mistyped command, and output cut short by its reader."""

import os
import subprocess
import sys

import pytest
from conftest import REPO

from grpo.cli import COMMANDS, main


def test_usage_lists_every_command_and_a_mistyped_one_is_named(capsys):
    assert main(["--help"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert listed == list(COMMANDS)
    assert main(["trian"]) == 2
    assert capsys.readouterr().err.startswith("grpo: unknown command 'trian'\n")


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]])
def test_a_reader_that_closes_early_ends_the_command_quietly(args):
    """`grpo --help | grep -q train`: grep exits at its first match; the command must not print a traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write: every write fails with EPIPE
    try:
        proc = subprocess.run([sys.executable, "-c", "from grpo.cli import entry; entry()", *args], cwd=REPO,
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert (proc.returncode, proc.stderr) == (0, "")
