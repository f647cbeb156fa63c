"""The `grpo` command: one subcommand per task of a run's life, each the module that does it.

    grpo train [--config config.yaml] [--dry-run] [key=value ...]
    grpo evaluate --run runs/<name> [--version N] [--limit N]
    grpo export runs/<name> --out DIR [--merge]
    grpo plot runs/a runs/b [--out docs/figures]
    grpo check runs/<name> --steps N

`grpo <command> --help` says more; `python -m grpo <command>` is the same with a given interpreter.
"""

from __future__ import annotations

import importlib
import os
import select
import sys
from collections.abc import Callable
from typing import NoReturn

COMMANDS = {  # name: (module with main(argv) -> exit code, what it does)
    "train": ("grpo.commands.train", "start a run: the sampler(s) and the DeepSpeed trainer, supervised"),
    "evaluate": ("grpo.commands.evaluate", "held-out accuracy of the base model or a run's published weights"),
    "export": ("grpo.commands.export", "a run's weights as a model folder (adapter or merged) with a model card"),
    "plot": ("grpo.commands.plot", "the metrics of one or more runs as figures"),
    "check": ("grpo.commands.check", "check a finished run folder: metrics rows, weights, the adapter loads"),
}


EXIT_CLOSED_READER = 141


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "usage: grpo <command> [arguments]\n\ncommands:\n" + "\n".join(lines) + \
        "\n\n`grpo <command> --help` for a command's arguments."


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"grpo: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv[0] = f"grpo {name}"  # what each command's --help calls itself
    return importlib.import_module(COMMANDS[name][0]).main(rest)


def entry() -> None:
    """The console script."""
    run_command(main)


def run_command(command: Callable[[], int | None]) -> NoReturn:
    """Run a command's main and exit with its code. A reader that closes the output early (`grpo --help |
    head -1`) ends the command without a traceback: with its own exit code where it had finished, with 141
    (128 + SIGPIPE, what a shell shows for any tool a closed reader stopped) where the closed pipe stopped it."""
    code: int | str | None = EXIT_CLOSED_READER
    try:
        try:
            code = command()
        except SystemExit as exit_:  # argparse's --help and usage errors: flush below, not at interpreter exit
            code = exit_.code
        sys.stdout.flush()
    except BrokenPipeError:
        if not reader_gone(sys.stdout):  # the broken pipe of something else is a real failure
            raise
        # Python's recipe (signal module docs, "Note on SIGPIPE"): stdout to devnull, so the flush at exit
        # cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(code)


def reader_gone(stream) -> bool:
    """Whether `stream` is a pipe or terminal whose reader has gone (poll reports an error or hang-up)."""
    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no descriptor (a replaced stream), no poll on this platform
        return False


if __name__ == "__main__":
    entry()
