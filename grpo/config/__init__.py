"""The config, loaded from `config.yaml` plus dotted `key=value` overrides, and validated.

Both workers call `parse_cli(argv)` (or `load_config`). The tree itself (every setting, its default
and documentation) is grpo/settings/; this package reads it from a file and overrides, and checks
it: unknown keys, wrong types and impossible combinations are errors that name the key and say
what to do (grpo/config/rules.py). It imports nothing of the trainer above the settings: what a
config names (rewards, environments, tools, templates) is imported by `grpo.run.preflight`.
"""

from __future__ import annotations

import os
import sys
import typing
from pathlib import Path

import yaml

from grpo.config.rules import validate
from grpo.settings import (
    DEFAULT_SYSTEM_PROMPT,
    AgentConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DeepSpeedConfig,
    DistillConfig,
    EnvConfig,
    EvalConfig,
    LaunchConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    RewardsConfig,
    RunConfig,
    SamplingConfig,
    TrainingConfig,
    TransportConfig,
    WeightsConfig,
    save_config,
    to_dict,
)
from grpo.settings.tree import (
    REMOVED_KEYS,
    RENAMED_KEYS,
    ConfigError,
    apply_mapping,
    get_key,
    markdown_table,
    parse_override,
    set_key,
)
from grpo.settings.tree import all_keys as _all_keys
from grpo.settings.tree import reference_text as _reference_text

# the tree's names too: importers take the whole config from here
__all__ = ["DEFAULT_SYSTEM_PROMPT", "AgentConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
           "DeepSpeedConfig", "DistillConfig", "EnvConfig", "EvalConfig", "LaunchConfig", "LoggingConfig", "LoraConfig",
           "ModelConfig", "RewardsConfig", "RunConfig", "SamplingConfig", "TrainingConfig", "TransportConfig",
           "WeightsConfig", "all_keys", "exit_code", "get_key", "help_requested", "load_config", "parse_cli",
           "reference_markdown", "reference_text", "save_config", "to_dict"]

Checks = typing.Sequence[typing.Callable[[Config], list[str]]]  # functions of a loaded config -> its problems


def all_keys() -> list[str]:
    """Every dotted leaf key of the config tree, in declaration order."""
    return _all_keys(Config)


# ----------------------------------------------------------------------------- loading

def load_config(path: str | os.PathLike | None = None, overrides: typing.Sequence[str] = (),
                written_by_a_run: bool = False, validated: bool = True, checks: Checks = ()) -> Config:
    """Defaults, then the YAML file, then `key=value` overrides; validated. Every problem (unknown
    keys, wrong types, impossible combinations) is reported at once, in one ConfigError.
    `written_by_a_run`: the file is the config a run saved (every key of its day), so keys removed
    since are dropped, not refused. `validated=False` reads the values only (keys and types): a
    saved config compared with a new one need not import its rewards again. `checks`: more problems
    to report with the rules' (a process's: grpo.run.preflight.named_code_problems)."""
    cfg, problems = Config(), []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            mapping = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path} is not valid YAML: {e}") from None
        if not isinstance(mapping, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(mapping).__name__}")
        if written_by_a_run:
            mapping = without_removed_keys(mapping)
        problems += apply_mapping(cfg, mapping, from_cli=False)
    for text in overrides:
        try:
            key, value = parse_override(text)
        except ConfigError as e:
            problems.append(str(e))
            continue
        problems += set_key(cfg, key.split("."), value, True, key, Config)
    if not validated:
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
        return cfg
    return validate(cfg, problems, checks)


def without_removed_keys(mapping: dict) -> dict:
    """A saved config's sections less the keys this version no longer has (REMOVED_KEYS), and the keys
    that moved under their new names (RENAMED_KEYS)."""
    kept = {section: dict(values) if isinstance(values, dict) else values for section, values in mapping.items()}
    for key in REMOVED_KEYS:
        section, name = key.split(".", 1)
        if isinstance(kept.get(section), dict):
            kept[section].pop(name, None)
    for old, new in RENAMED_KEYS.items():
        section, name = old.split(".", 1)
        if isinstance(kept.get(section), dict) and name in kept[section]:
            value = kept[section].pop(name)
            *parents, leaf = new.split(".")
            node = kept
            for part in parents:
                node[part] = dict(node.get(part) or {})
                node = node[part]
            node.setdefault(leaf, value)
    return kept


def parse_cli(argv: typing.Sequence[str], default_path: str | None = "config.yaml", checks: Checks = ()) -> Config:
    """`[--config PATH] [key=value ...]`, as both workers take them; `checks` as `load_config`'s."""
    argv = list(argv)
    path = default_path
    overrides = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path")
            path, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg.startswith("--local_rank") or arg.startswith("--local-rank"):
            # deepspeed's launcher appends this; the rank comes from the environment
            i += 1 if "=" in arg else 2
            continue
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg}; use --config PATH and key=value overrides")
        else:
            overrides.append(arg)
        i += 1
    if path is not None and not Path(path).is_file() and path == default_path:
        path = None  # no config.yaml in the working folder: defaults plus overrides
    return load_config(path, overrides, checks=checks)


def reference_markdown() -> str:
    """The config reference table (docs/config.md), generated from the fields' help."""
    return markdown_table(Config)


def reference_text() -> str:
    """Every key with its default and help, as `--help-config` prints it."""
    return _reference_text(Config)


CONFIG_HELP = """
The config: --config PATH (default: config.yaml in the working folder; configs/ holds recipes),
then key=value overrides with dotted keys, values read as YAML (training.use_gspo=true).
Every key with its default and meaning: --help-config (or docs/config.md)."""


def help_requested(argv: typing.Sequence[str], usage: str) -> bool:
    """Print the entry point's `usage` (`--help`, `-h`) or every config key (`--help-config`) when
    asked; True when it printed (the caller exits 0)."""
    if "--help-config" in argv:
        print(reference_text())
        return True
    if "--help" in argv or "-h" in argv:
        print(usage.strip() + "\n" + CONFIG_HELP)
        return True
    return False


def exit_code(main: typing.Callable[[list[str]], int], argv: list[str]) -> int:
    """An entry point's exit code: `main(argv)`'s, or 2 with a config error printed as one line."""
    try:
        return main(argv)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
