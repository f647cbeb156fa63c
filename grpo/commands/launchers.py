"""Where `grpo train` starts a run's processes: on this machine, or through a cluster's scheduler.

A launcher is a module with `take_options(argv)` -> (its own options, the rest of argv: --config and
key=value) and `launch(options, cfg, args, dry_run)` -> the exit code. `grpo train --<name>` picks
one; with none named the run starts here. A new one (a Kubernetes Job, say) is its module and one
line in LAUNCHERS.
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


def launcher_flags() -> str:
    return ", ".join(f"--{name}" for name in LAUNCHERS if name != DEFAULT_LAUNCHER)
