"""A typed tree of dataclasses read from YAML and dotted `key=value` overrides: the machinery
behind grpo/config/__init__.py, independent of which settings the tree holds.

Each leaf is a dataclass field made with `setting(default, help)`; its type annotation is what a
value is checked and coerced against, and its help is its documentation (`markdown_table`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from dataclasses import field
from typing import Any

import yaml

from grpo.settings.foreign import FOREIGN_KEYS, FOREIGN_NAMES, FOREIGN_SECTIONS


class ConfigError(ValueError):
    """A config file, override or combination of settings that cannot run."""


def setting(default, help: str, bound: str | None = None, why: str | None = None, choices: tuple | None = None,
            **kw):
    """A config field with its documentation; list/dict defaults are copied per instance. `bound`: the
    range a number must be in (">= 1", "> 0", "in (0, 1]", "in [0, 3]", with " or -1" for one more
    value it may take), `why`: what its edge means ("0 = off"); `choices`: the values it may take.
    `field_problems` checks them all."""
    metadata = {"help": help, "bound": bound, "why": why, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata, **kw)
    return field(default=default, metadata=metadata, **kw)


def within(bound: str, value) -> bool:
    """Whether `value` is in `bound` (see `setting`); NaN is in none."""
    rest, _, other = bound.partition(" or ")
    if other and value == float(other):
        return True
    if rest.startswith(">="):
        return value >= float(rest[2:])
    if rest.startswith(">"):
        return value > float(rest[1:])
    low, high = (float(x) for x in rest[4:-1].split(","))  # "in (a, b]"
    return (low <= value if rest[3] == "[" else low < value) and (value <= high if rest[-1] == "]" else value < high)


def field_problems(node: Any, prefix: str = "") -> list[str]:
    """Every field outside its declared bound or choices, in one text: `key must be <bound> (<why>);
    got <value>`, `key must be one of a, b; got 'c'` (an unset optional number, None, has no bound)."""
    problems = []
    for f in dataclasses.fields(node):
        value, meta = getattr(node, f.name), f.metadata
        if dataclasses.is_dataclass(value):
            problems += field_problems(value, f"{prefix}{f.name}.")
        elif meta.get("bound") and value is not None and not within(meta["bound"], value):
            why = f" ({meta['why']})" if meta.get("why") else ""
            problems.append(f"{prefix}{f.name} must be {meta['bound']}{why}; got {value}")
        elif meta.get("choices") and value not in meta["choices"]:
            problems.append(f"{prefix}{f.name} must be one of {', '.join(meta['choices'])}; got {value!r}")
    return problems


def choices_of(cls: type, key: str) -> tuple | None:
    """The values the dotted `key` of the tree `cls` may take (its declared choices), None for a free one."""
    *sections, leaf = key.split(".")
    for part in sections:
        cls = _hints(cls)[part]
    return next(f.metadata.get("choices") for f in dataclasses.fields(cls) if f.name == leaf)


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
        for tp_option in inner[:-1]:  # the first type the value is, in the order the annotation names them
            try:
                return _coerce(key, value, tp_option, from_cli)
            except ConfigError:
                pass
        return _coerce(key, value, inner[-1], from_cli)
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


TYPO_CUTOFF = 0.8  # difflib's similarity for a typo (`temprature`); looser cutoffs pair unrelated names


def suggestion(key: str, root: type) -> str | None:
    """What of ours a mistyped or foreign `key` most likely means: a key, a key with a note, or a
    sentence where no key does the job; None where nothing fits. Names from veRL and OpenRLHF are
    looked up whole; under their sections (FOREIGN_SECTIONS) nothing is guessed."""
    if key in FOREIGN_KEYS:
        return FOREIGN_KEYS[key]
    if "." not in key:
        return FOREIGN_NAMES.get(key) or _closest(key, all_keys(root))
    head, rest = key.split(".", 1)
    sections = [f.name for f in dataclasses.fields(root) if dataclasses.is_dataclass(_hints(root)[f.name])]
    if head not in sections:
        typo = difflib.get_close_matches(head, sections, n=1, cutoff=TYPO_CUTOFF)
        if head in FOREIGN_SECTIONS or not typo:
            return None
        key, head = f"{typo[0]}.{rest}", typo[0]  # `trainig.beta` -> training.beta
    keys = all_keys(root)
    if key in keys:
        return key
    parent, leaf = key.rsplit(".", 1)
    if not _is_section(root, parent):  # `data.custom_cls.path`: no section of ours holds it
        return None
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:  # the right name under another of our sections: `sampling.beta` -> training.beta
        return same_leaf[0]
    if leaf in FOREIGN_NAMES:  # `training.lr` -> training.learning_rate
        return FOREIGN_NAMES[leaf]
    return _closest(key, [k for k in keys if k.startswith(parent + ".")])


def _is_section(root: type, dotted: str) -> bool:
    """Whether `dotted` ("rewards.judge") names a section of the tree, not a leaf or nothing."""
    node = root
    for part in dotted.split("."):
        fields = {f.name for f in dataclasses.fields(node)}
        if part not in fields or not dataclasses.is_dataclass(_hints(node)[part]):
            return False
        node = _hints(node)[part]
    return True


def _closest(key: str, keys: list[str]) -> str | None:
    """A typo's nearest key, by its last part."""
    leaves = {k.rsplit(".", 1)[-1]: k for k in reversed(keys)}  # the first key of each leaf name
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(leaves), n=1, cutoff=TYPO_CUTOFF)
    return leaves[close[0]] if close else None


# keys this trainer had, and what does their job now
REMOVED_KEYS = {
    "launch.samplers": "use sampling.num_workers (the launcher starts that many samplers)",
    "lora.dropout": "LoRA dropout is always off (a token's log-prob must be one function of the weights in both "
                    "processes)",
}


# keys that moved, and where: a config that names the old key is told the new one; a run's saved
# config with the old key is read as if it named the new one
RENAMED_KEYS = {
    "sampling.vllm_gpu_memory_utilization": "sampling.vllm.gpu_memory_utilization",
    "sampling.vllm_kv_cache_gb": "sampling.vllm.kv_cache_gb",
    "launch.vllm_python": "sampling.vllm.python",
}


def _unknown_key(key: str, root: type) -> str:
    if key in RENAMED_KEYS:
        return f"config key '{key}' is now '{RENAMED_KEYS[key]}'"
    if key in REMOVED_KEYS:
        return f"config key '{key}' is gone: {REMOVED_KEYS[key]}"
    hint = suggestion(key, root)
    if hint is None:
        return f"unknown config key '{key}'; see --help-config or docs/config.md for every key"
    named = re.match(r"[a-z_.]*", hint).group()
    if named not in all_keys(root):  # a sentence: no key of ours does this
        return f"unknown config key '{key}'; {hint}"
    return f"unknown config key '{key}'; did you mean {hint}?" if " " in hint else \
        f"unknown config key '{key}'; did you mean '{hint}'?"


def set_key(node: Any, parts: list[str], value: Any, from_cli: bool, full_key: str, root: type) -> list[str]:
    """Set the leaf `parts` (a dotted key split) below `node`; a mapping sets a whole section.
    Returns the problems found (unknown keys, wrong types), each naming its key; nothing is set
    for a key with a problem."""
    name = parts[0]
    names = {f.name for f in dataclasses.fields(node)}
    if name not in names:
        return [_unknown_key(full_key, root)]
    tp = _hints(type(node))[name]
    if dataclasses.is_dataclass(tp):
        if len(parts) == 1:
            if not isinstance(value, dict):
                return [f"{full_key}: expected a section (mapping), got {value!r}"]
            return [problem for k, v in value.items()
                    for problem in set_key(getattr(node, name), [str(k)], v, from_cli, f"{full_key}.{k}", root)]
        return set_key(getattr(node, name), parts[1:], value, from_cli, full_key, root)
    if len(parts) > 1:
        if tp is not dict:
            return [_unknown_key(full_key, root)]
        # pass-through mappings (deepspeed.config) take any nested key
        target = getattr(node, name)
        for part in parts[1:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                return [f"{full_key}: '{part}' is not a mapping"]
        target[parts[-1]] = value
        return []
    try:
        setattr(node, name, _coerce(full_key, value, tp, from_cli))
    except ConfigError as e:
        return [str(e)]
    return []


def apply_mapping(root_obj: Any, mapping: dict, from_cli: bool) -> list[str]:
    """Set every key of a (YAML) mapping; the problems of all of them."""
    return [problem for key, value in mapping.items()
            for problem in set_key(root_obj, str(key).split("."), value, from_cli, str(key), type(root_obj))]


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


def _shown_default(default: Any) -> str:
    if isinstance(default, str) and "\n" in default:
        return json.dumps(default)  # one line: "<think>\n", not a broken one
    shown = yaml.safe_dump(default, default_flow_style=True, width=10**6).strip()
    return shown.removesuffix("\n...").removesuffix("...").strip()


def _leaves(cls: type, obj: Any, prefix: str = ""):
    """(dotted key, default, help) of every leaf, in declaration order."""
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _leaves(tp, getattr(obj, f.name), f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, getattr(obj, f.name), f.metadata["help"] + _declared(f.metadata)


def _declared(meta) -> str:
    """A bound as the reference states it (a choice's options are described in its help)."""
    return f" Must be {meta['bound']}." if meta.get("bound") else ""


def reference_text(root: type, width: int = 100) -> str:
    """Every key with its default and help, for a terminal (`--help-config`)."""
    import textwrap

    lines, section = [], None
    for key, default, help in _leaves(root, root()):
        head = key.split(".")[0] if "." in key else ""
        if head != section:
            section = head
            lines.append(f"\n[{head or 'top level'}]")
        lines.append(f"{key} = {_shown_default(default)}")
        lines += textwrap.wrap(help, width=width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines).lstrip("\n")


def markdown_table(root: type) -> str:
    """| key | default | meaning | for every leaf of the tree `root`, from the fields' help."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, help in _leaves(root, root()):
        shown = _shown_default(default)
        shown = shown[:57] + "..." if len(shown) > 60 else shown
        rows.append(f"| `{key}` | `{shown}` | {help} |")
    return "\n".join(rows)
