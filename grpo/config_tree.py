"""A typed tree of dataclasses read from YAML and dotted `key=value` overrides: the machinery
behind grpo/config.py, independent of which settings the tree holds.

Each leaf is a dataclass field made with `setting(default, help)`; its type annotation is what a
value is checked and coerced against, and its help is its documentation (`markdown_table`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import field
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config file, override or combination of settings that cannot run."""


def _f(default, help: str, **kw):
    """A config field with its documentation; list/dict defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def setting(default, help: str, **kw):
    """A config field with its documentation; list/dict defaults are copied per instance."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


_TYPE_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _TYPE_HINTS:
        _TYPE_HINTS[cls] = typing.get_type_hints(cls)
    return _TYPE_HINTS[cls]


def _type_name(tp: Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any, from_cli: bool) -> Any:
    """Check `value` against the annotation `tp`; return it converted (int -> float, str from the CLI)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(key, value, inner[0], from_cli)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list of {_type_name(args[0])}, got {value!r}")
        return [_coerce(f"{key}[{i}]", v, args[0], from_cli) for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `3e-6` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
        if from_cli and isinstance(value, (int, float, bool)):
            return str(value)  # `run.name=123` means the string "123"
    raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def all_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted leaf key of the config tree, in declaration order."""
    keys = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            keys += all_keys(tp, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def get_key(node: Any, key: str) -> Any:
    """The value of a dotted key, e.g. get_key(cfg, "sampling.temperature")."""
    for part in key.split("."):
        node = getattr(node, part)
    return node


def _unknown_key_error(key: str, root: type) -> ConfigError:
    close = difflib.get_close_matches(key, all_keys(root), n=1, cutoff=0.5)
    hint = f"; did you mean '{close[0]}'?" if close else "; see the config reference in README.md"
    return ConfigError(f"unknown config key '{key}'{hint}")


def set_key(node: Any, parts: list[str], value: Any, from_cli: bool, full_key: str, root: type) -> None:
    """Set the leaf `parts` (a dotted key split) below `node`; a mapping sets a whole section."""
    name = parts[0]
    names = {f.name for f in dataclasses.fields(node)}
    if name not in names:
        raise _unknown_key_error(full_key, root)
    tp = _hints(type(node))[name]
    if dataclasses.is_dataclass(tp):
        if len(parts) == 1:
            if not isinstance(value, dict):
                raise ConfigError(f"{full_key}: expected a section (mapping), got {value!r}")
            for k, v in value.items():
                set_key(getattr(node, name), [str(k)], v, from_cli, f"{full_key}.{k}", root)
            return
        set_key(getattr(node, name), parts[1:], value, from_cli, full_key, root)
        return
    if len(parts) > 1:
        if tp is not dict:
            raise _unknown_key_error(full_key, root)
        # pass-through mappings (deepspeed.config) take any nested key
        target = getattr(node, name)
        for part in parts[1:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(f"{full_key}: '{part}' is not a mapping")
        target[parts[-1]] = value
        return
    setattr(node, name, _coerce(full_key, value, tp, from_cli))


def apply_mapping(root_obj: Any, mapping: dict, from_cli: bool) -> None:
    for key, value in mapping.items():
        set_key(root_obj, str(key).split("."), value, from_cli, str(key), type(root_obj))


def parse_override(text: str) -> tuple[str, Any]:
    """`training.use_gspo=true` -> ("training.use_gspo", True); values are read as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. sampling.temperature=0.7)")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def markdown_table(root: type) -> str:
    """| key | default | meaning | for every leaf of the tree `root`, from the fields' help."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]

    def walk(cls: type, obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            tp = _hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, getattr(obj, f.name), f"{prefix}{f.name}.")
                continue
            default = getattr(obj, f.name)
            if isinstance(default, str) and "\n" in default:
                shown = json.dumps(default)  # one table row: "<think>\n", not a broken line
            else:
                shown = yaml.safe_dump(default, default_flow_style=True, width=10**6).strip()
                shown = shown.removesuffix("\n...").removesuffix("...").strip()
            if len(shown) > 60:
                shown = shown[:57] + "..."
            rows.append(f"| `{prefix}{f.name}` | `{shown}` | {f.metadata['help']} |")

    walk(root, root(), "")
    return "\n".join(rows)
