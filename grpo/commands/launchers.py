"""Where `grpo train` starts a run's processes: on this machine, or through a cluster's scheduler.

A launcher is a module with `take_options(argv)` -> (its own options, the rest of argv: --config and
key=value), `launch(options, cfg, args, dry_run)` -> the exit code, FLAGS (the options it takes) and
OPTIONS_HELP (its lines in `grpo train --help`). `grpo train --<name>` picks one; with none named the
run starts here. A new one (a Kubernetes Job, say) is its module and one line in LAUNCHERS.
"""

from __future__ import annotations

import importlib
from types import ModuleType

LAUNCHERS = {
    "local": "grpo.commands.local",  # the processes on this machine, supervised by `grpo train`
    "slurm": "grpo.commands.slurm",  # one sbatch script for a Slurm allocation
}
DEFAULT_LAUNCHER = "local"


def chosen_launcher(argv: list[str]) -> tuple[str, list[str]]:
    """The launcher `--<name>` names (the default when none does), and argv without that flag."""
    named = [arg for arg in argv if arg.startswith("--") and arg[2:] in LAUNCHERS]
    if len(set(named)) > 1:
        raise ValueError(f"{' and '.join(dict.fromkeys(named))}: a run has one launcher")
    return (named[0][2:] if named else DEFAULT_LAUNCHER), [arg for arg in argv if arg not in named]


def launcher_module(name: str) -> ModuleType:
    return importlib.import_module(LAUNCHERS[name])


def misplaced_flag(name: str, argv: list[str]) -> str | None:
    """What is wrong with an option of another launcher than `name` left in argv (None: there is none)."""
    for flag in (arg.split("=", 1)[0] for arg in argv if arg.startswith("--")):
        for other in (other for other in LAUNCHERS if other != name):
            if flag in launcher_module(other).FLAGS:
                return f"{flag} is an option of {_described(other)}, not of {_described(name)}"
    return None


def _described(name: str) -> str:
    return "a run on this machine (grpo train without a launcher flag)" if name == DEFAULT_LAUNCHER else \
        f"grpo train --{name}"
