"""The `grpo` command: one subcommand per task of a run's life, each the module that does it.

    grpo train [--config config.yaml] [--dry-run] [key=value ...]
    grpo evaluate --run runs/<name> [--version N] [--limit N]
    grpo export runs/<name> --out DIR [--merge]
    grpo plot runs/a runs/b [--out docs/figures]
    grpo check runs/<name> --steps N

`grpo <command> --help` says more. The scripts in scripts/ run the same code from a checkout.
"""

from __future__ import annotations

import importlib
import os
import sys

COMMANDS = {  # name: (module with main(argv) -> exit code, what it does)
    "train": ("grpo.commands.train", "start a run: the sampler(s) and the DeepSpeed trainer, supervised"),
    "evaluate": ("grpo.commands.evaluate", "held-out accuracy of the base model or a run's published weights"),
    "export": ("grpo.commands.export", "a run's weights as a model folder (adapter or merged) with a model card"),
    "plot": ("grpo.commands.plot", "the metrics of one or more runs as figures"),
    "check": ("grpo.commands.check", "check a finished run folder: metrics rows, weights, the adapter loads"),
}


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
    """The console script. Output cut short by its reader (`grpo --help | head`) ends quietly."""
    try:
        code = main()
        sys.stdout.flush()
    except BrokenPipeError:
        # Python's own recipe: point stdout at devnull so the flush at exit cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    sys.exit(code)


if __name__ == "__main__":
    entry()
