"""`grpo train`: load and check the run's config, then hand it to a launcher (grpo/commands/launchers.py):
the processes here (grpo/commands/local.py, the default) or a Slurm job (grpo/commands/slurm.py)."""

from __future__ import annotations

import sys

from grpo.commands.launchers import LAUNCHERS, chosen_launcher, launcher_module, misplaced_flag
from grpo.common.imports import user_code_importable
from grpo.config import ConfigError, parse_cli, reference_text
from grpo.run.epochs import with_epochs_as_steps
from grpo.run.preflight import named_code_problems

EXIT_USAGE = 2

USAGE = """\
usage: grpo train [--config config.yaml] [--dry-run] [key=value ...]
       python -m grpo train ...    (the same with a given interpreter)
       make train ARGS="..."    (passes the same: make train ARGS="--dry-run training.steps=50";
                                 CONFIG=configs/<recipe>.yaml picks the config file)

Starts the sampler(s) and the DeepSpeed trainer of one run, shows its progress, and stops them
all together (Ctrl-C, a failure of any of them, or launch.max_minutes).

  --config PATH   the YAML config: config.yaml by default (the default run, offline on a CPU);
                  configs/ holds recipes, e.g. configs/qwen2.5-0.5b-gsm8k-1gpu.yaml
  key=value       overrides of any config key, after the file, e.g. training.steps=50 run.name=try2
  --dry-run       print the plan and start or change nothing: each process's GPUs or threads,
                  command and environment, the transport address and DeepSpeed port, the run
                  folder and whether it starts fresh, resumes or would be refused
{launchers}
  --help-config   every config key with its default and help (docs/config.md: the same, and details)
  -h, --help      this text"""


def usage() -> str:
    """USAGE with each launcher's own flags (its module's OPTIONS_HELP)."""
    return USAGE.format(launchers="\n".join(launcher_module(name).OPTIONS_HELP.rstrip() for name in LAUNCHERS))


def split_options(argv: list[str]) -> tuple[dict, list[str]]:
    """The command's own flags, and the rest (a launcher's flags, --config and key=value)."""
    options = {"help": False, "help_config": False, "dry_run": False}
    flags = {"-h": "help", "--help": "help", "--help-config": "help_config", "--dry-run": "dry_run"}
    rest = []
    for arg in argv:
        if arg in flags:
            options[flags[arg]] = True
        else:
            rest.append(arg)
    return options, rest


def main(argv: list[str]) -> int:
    user_code_importable()  # rewards, environments and tools named by import path, from here too
    try:
        options, argv = split_options(argv)
        name, argv = chosen_launcher(argv)
        launcher = launcher_module(name)
        launcher_options, argv = launcher.take_options(argv)
        problem = misplaced_flag(name, argv)
        if problem:
            raise ValueError(problem)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if options["help"]:
        print(usage())
        return 0
    if options["help_config"]:
        print(reference_text())
        return 0
    try:
        # a bad config stops here, before anything starts
        cfg = with_epochs_as_steps(parse_cli(argv, checks=[named_code_problems]))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return launcher.launch(launcher_options, cfg, argv, options["dry_run"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
