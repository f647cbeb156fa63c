"""Tools as plain Python functions: `env.tools: [package.module:function, path/to/file.py:function]`.

Each function is offered to the model through its chat template (`apply_chat_template(...,
tools=...)`) with the JSON schema transformers builds from its signature and docstring
(`transformers.utils.get_json_schema`: type hints, and an `Args:` section describing each
argument). The model's message is read by `env.tool_parser` (grpo/environments/tool_calls.py);
each call is checked against its tool's schema (the arguments' names, required ones and JSON types)
and run, and its result, or the error (a malformed call, an unknown tool, arguments that do not
fit, a tool that raised), cut at MAX_RESULT_CHARS, goes back as a `tool`-role message, one per
call, rendered by the template. A message without a call is the answer: the episode ends. The
environment runs in the environments' child like any other (grpo/environments/pool.py); each
call runs in a jail of its own that the child started (grpo/common/jail.py), within what is left of
the message's `env.timeout_s`, and only its text comes back: docs/environments.md tabulates what
a call can reach ("What the sandbox allows"). `env.tools: [python]` is the built-in code tool.
"""

from __future__ import annotations

import inspect
import json
import time
from typing import Callable

from grpo.common.child import ChildFailed, ChildRefused
from grpo.environments import Reply, cut
from grpo.environments.tool_calls import PARSERS, ToolCall

OK, MALFORMED, FAILED = "ok", "malformed", "failed"  # how a call went
SETTINGS = ("max_calls", "demonstration")  # env.args of the tool environment


class ToolError(ValueError):
    """A tool cannot be offered (env.tools): the message names it and what to fix."""


def load_tools(paths: list[str]) -> dict[str, tuple[dict, Callable]]:
    """The functions env.tools names, by name, each with its schema (built once: the chat template
    offers it, the environment calls the function); ToolError naming a bad one."""
    tools = {}
    for path in paths:
        fn = import_tool(path)
        if not callable(fn):
            raise ToolError(f"env.tools: {path!r} is not a function")
        schema = tool_schema(fn, path)
        name = schema["function"]["name"]
        if name in tools:
            raise ToolError(f"env.tools: two tools are named {name!r}")
        tools[name] = (schema, fn)
    return tools


def import_tool(path: str):
    """The function env.tools names: a built-in tool's name (BUILT_IN_TOOLS) or an import path."""
    from grpo.common.imports import import_object

    return import_object(BUILT_IN_TOOLS.get(path, path), "env.tools")


def start_tool_jail(paths: list[str], limits, timeout_s: float):
    """This process's tool calls run in a jail started now (grpo/common/jail.py), with the env section's
    budgets (`limits`: env.memory_mb, env.max_processes, env.cpu_s, env.network, env.pass_env), each
    within what is left of its step's `timeout_s`; the jail. The environments' child starts it
    before it confines itself (the jail makes namespaces of its own)."""
    from grpo.common.jail import Jail, JailLimits

    jail_limits = JailLimits(memory_mb=limits.memory_mb, max_processes=limits.max_processes, cpu_s=limits.cpu_s,
                             network=limits.network == "allow")
    try:
        _JAIL.update(jail=Jail("tools", "grpo.environments.tools:jailed_tool", paths, jail_limits,
                               pass_env=limits.pass_env), timeout_s=timeout_s)
    except ChildRefused as e:  # each run_tool says why, rather than run what the model wrote unjailed
        _JAIL.update(jail=RefusedJail(str(e)), timeout_s=timeout_s)
        raise
    return _JAIL["jail"]


class RefusedJail:
    """Stands for a jail that could not start: every call fails with the reason."""

    def __init__(self, why: str):
        self.why, self.info = why, {"refused": why}

    def call(self, *_args, **_kwargs):
        raise ChildFailed(self.why)


def jailed_tool(path: str):
    """What the jail runs for the tool `path` (in its warden): the function called with the model's
    arguments, its result as the text the model reads."""
    fn = import_tool(path)

    def run(arguments: dict) -> str:
        return cut(shown(fn(**arguments)))  # cut here: only what the model reads crosses back
    run.__wrapped__ = fn  # the jail reads the tool's module through it (grpo/common/jail_warden.py: served_files)
    return run


def _tool_jail():
    """(the jail this process's tool calls run in, the time of one step); one is started with the
    env section's defaults where none was (the tool environment made outside the environments' child)."""
    if "jail" not in _JAIL:
        from grpo.settings import EnvConfig

        start_tool_jail([], EnvConfig(), EnvConfig().timeout_s)
    return _JAIL["jail"], _JAIL["timeout_s"]


def run_tool(tool: str, arguments: dict, timeout_s: float | None = None) -> str:
    """How an environment runs what the model wrote: `tool` (a built-in tool's name, e.g. "python",
    or an import path) called with `arguments` in this process's jail, within `timeout_s` (None: a
    step's time); its text. ChildFailed where it raised, ran past its time or a budget."""
    jail, step_s = _tool_jail()
    limit = step_s - STEP_MARGIN_S if timeout_s is None else timeout_s
    return jail.call(tool, [arguments], limit, f"the tool ran past {limit:g} s")


_JAIL: dict = {}  # this process's tool jail and step time (start_tool_jail)
BUILT_IN_TOOLS = {"python": "grpo.environments.python_tool:python"}  # env.tools: [python]
STEP_MARGIN_S = 0.5  # a step's tool calls end this long before env.timeout_s, so the step can answer


def tool_schema(fn, path: str = "") -> dict:
    """transformers' JSON schema of a tool function; ToolError saying what its docstring lacks."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # DocstringParsingException, TypeHintParsingException
        raise ToolError(f"env.tools: {path or fn.__name__} cannot be offered to the model: {e} (a tool needs type "
                        "hints and a docstring with a description and an 'Args:' line per argument)") from None


def tool_schemas(paths: list[str]) -> list[dict]:
    """The schemas of env.tools, in their order, as the chat template takes them (`tools=`)."""
    return [schema for schema, _ in load_tools(paths).values()]


def shown(result) -> str:
    """A tool's return value as the text of its message: str as it is, other JSON values as JSON."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, default=str)
    except (TypeError, ValueError):
        return str(result)


JSON_TYPES = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "true or false",
              "array": "an array", "object": "an object", "null": "null"}


def _is(value, kind: str) -> bool:
    """Whether a decoded JSON value is of JSON schema type `kind` (true is no integer, 1.0 is no integer)."""
    if kind in ("integer", "number"):
        return isinstance(value, int if kind == "integer" else (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}.get(kind)
    return python is None or isinstance(value, python)


def mismatch(schema: dict, value, where: str = "") -> str | None:
    """Why `value` does not fit `schema`, None when it does: the JSON schema transformers writes for
    a tool (type, nullable, enum, items, prefixItems, properties, required, additionalProperties)."""
    name = where or "the arguments"
    if value is None and schema.get("nullable"):
        return None
    kinds = [schema["type"]] if isinstance(schema.get("type"), str) else list(schema.get("type") or [])
    if kinds and not any(_is(value, kind) for kind in kinds):
        return f"{name} must be {' or '.join(JSON_TYPES.get(k, k) for k in kinds)}"
    if "enum" in schema and not any(value == v and type(value) is type(v) for v in schema["enum"]):
        return f"{name} must be one of {', '.join(json.dumps(v) for v in schema['enum'])}"
    if isinstance(value, list):
        prefix = schema.get("prefixItems")
        if prefix is not None and len(value) != len(prefix):
            return f"{name} must hold {len(prefix)} items"
        for i, item in enumerate(value):
            inner = prefix[i] if prefix is not None else schema.get("items")
            if isinstance(inner, dict) and (problem := mismatch(inner, item, f"{name}[{i}]")):
                return problem
    if isinstance(value, dict):
        for key in [*schema.get("required", []), *value]:
            inside = f"{where}[{key!r}]" if where else repr(key)
            if key not in value:
                return f"{inside} is missing"
            inner = schema.get("properties", {}).get(key, schema.get("additionalProperties"))
            if isinstance(inner, dict) and (problem := mismatch(inner, value[key], inside)):
                return problem
    return None


class ToolEnvironment:
    """One episode with tools: every message's calls answered, until a message makes none (at most
    `max_calls` calls an episode; past them a call is an error)."""

    reply_roles = ("tool",)

    def __init__(self, row: dict, tools: list[str], parser: str = "hermes", max_calls: int = 8,
                 demonstration: str | None = None):
        if parser not in PARSERS:
            raise ToolError(f"env.tool_parser: unknown parser {parser!r}; valid: {', '.join(PARSERS)}")
        loaded = load_tools(tools)
        self.tools = {name: path for (name, _), path in zip(loaded.items(), tools)}  # what the jail imports
        self.functions = {name: fn for name, (_, fn) in loaded.items()}  # for their signatures
        self.parameters = {name: schema["function"].get("parameters", {}) for name, (schema, _) in loaded.items()}
        self.parse, self.calls_left = PARSERS[parser], max_calls

    def step(self, message: str) -> Reply:
        calls = self.parse(message)
        if not calls:
            return Reply(done=True)
        jail, timeout_s = _tool_jail()
        deadline = time.monotonic() + timeout_s - STEP_MARGIN_S
        results = [self.run(call, jail, deadline, timeout_s) for call in calls]
        return Reply(text=[text for text, _ in results], role="tool", tool_calls=len(calls),
                     tool_errors=sum(kind != OK for _, kind in results),
                     malformed_calls=sum(kind == MALFORMED for _, kind in results))

    def run(self, call: ToolCall, jail, deadline: float, step_s: float) -> tuple[str, str]:
        """(the message the model reads, cut at MAX_RESULT_CHARS; OK / MALFORMED (unreadable, no such
        tool, arguments that do not fit the function or its schema) / FAILED (the tool raised, ran
        past its step's time or a budget, or no calls were left)). The tool runs in `jail` until
        `deadline` (time.monotonic(): what is left of its step, `step_s` in all); its text is all that
        comes back."""
        text, kind = self._run(call, jail, deadline, step_s)
        return cut(text), kind

    def _run(self, call: ToolCall, jail, deadline: float, step_s: float) -> tuple[str, str]:
        if call.error is not None:
            return f"error: {call.error}", MALFORMED
        if call.name not in self.tools:
            return f"error: there is no tool {call.name!r}; tools: {', '.join(self.tools)}", MALFORMED
        try:
            inspect.signature(self.functions[call.name]).bind(**call.arguments)
        except TypeError as e:
            return f"error: bad arguments for {call.name}: {e}", MALFORMED
        problem = mismatch(self.parameters[call.name], call.arguments)
        if problem is not None:  # {"expression": 48} for a str: the model's mistake, never the tool's to meet
            return f"error: bad arguments for {call.name}: {problem}", MALFORMED
        if self.calls_left <= 0:
            return "error: no tool calls left in this episode", FAILED
        self.calls_left -= 1
        try:
            text = jail.call(self.tools[call.name], [call.arguments], max(deadline - time.monotonic(), 0.0),
                             f"the tool ran past env.timeout_s={step_s:g} s")
            return shown(text), OK  # a str, whatever the call wrote into its answer
        except ChildFailed as e:  # the tool's own error, its time, a budget: the model reads it
            return f"error: {e}", FAILED
