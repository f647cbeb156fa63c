"""Tools as plain Python functions: `env.tools: [package.module:function, path/to/file.py:function]`.

Each function is offered to the model through its chat template (`apply_chat_template(...,
tools=...)`) with the JSON schema transformers builds from its signature and docstring
(`transformers.utils.get_json_schema`: type hints, and an `Args:` section describing each
argument). The model's message is read by `env.tool_parser` (grpo/environments/tool_calls.py);
each call is run, and its result, or the error (a malformed call, an unknown tool, arguments that
do not fit, a tool that raised), goes back as a `tool`-role message, one per call, rendered by the
template. A message without a call is the answer: the episode ends. The environment runs in the
environments' child like any other (grpo/environments/pool.py): no network, `env.timeout_s` for
the calls of one message.
"""

from __future__ import annotations

import inspect
import json
from typing import Callable

from grpo.environments import Reply
from grpo.environments.tool_calls import PARSERS, ToolCall

OK, MALFORMED, FAILED = "ok", "malformed", "failed"  # how a call went
SETTINGS = ("max_calls", "demonstration")  # env.args of the tool environment
MAX_RESULT_CHARS = 4000  # a tool's result beyond this is cut: it is context the model must read


class ToolError(ValueError):
    """A tool cannot be offered (env.tools): the message names it and what to fix."""


def load_tools(paths: list[str]) -> dict[str, tuple[dict, Callable]]:
    """The functions env.tools names, by name, each with its schema (built once: the chat template
    offers it, the environment calls the function); ToolError naming a bad one."""
    from grpo.imports import import_object

    tools = {}
    for path in paths:
        fn = import_object(path, "env.tools")
        if not callable(fn):
            raise ToolError(f"env.tools: {path!r} is not a function")
        schema = tool_schema(fn, path)
        name = schema["function"]["name"]
        if name in tools:
            raise ToolError(f"env.tools: two tools are named {name!r}")
        tools[name] = (schema, fn)
    return tools


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
        text = result
    else:
        try:
            text = json.dumps(result, default=str)
        except (TypeError, ValueError):
            text = str(result)
    return text if len(text) <= MAX_RESULT_CHARS else text[:MAX_RESULT_CHARS] + " ... (cut)"


class ToolEnvironment:
    """One episode with tools: every message's calls answered, until a message makes none (at most
    `max_calls` calls an episode; past them a call is an error)."""

    reply_roles = ("tool",)

    def __init__(self, row: dict, tools: list[str], parser: str = "hermes", max_calls: int = 8,
                 demonstration: str | None = None):
        if parser not in PARSERS:
            raise ToolError(f"env.tool_parser: unknown parser {parser!r}; valid: {', '.join(PARSERS)}")
        self.tools = {name: fn for name, (_, fn) in load_tools(tools).items()}
        self.parse, self.calls_left = PARSERS[parser], max_calls

    def step(self, message: str) -> Reply:
        calls = self.parse(message)
        if not calls:
            return Reply(done=True)
        results = [self.run(call) for call in calls]
        return Reply(text=[text for text, _ in results], role="tool", tool_calls=len(calls),
                     tool_errors=sum(kind != OK for _, kind in results),
                     malformed_calls=sum(kind == MALFORMED for _, kind in results))

    def run(self, call: ToolCall) -> tuple[str, str]:
        """(the message the model reads, OK / MALFORMED (unreadable, no such tool, arguments that do
        not fit the function) / FAILED (the tool raised, or no calls were left))."""
        if call.error is not None:
            return f"error: {call.error}", MALFORMED
        if call.name not in self.tools:
            return f"error: there is no tool {call.name!r}; tools: {', '.join(self.tools)}", MALFORMED
        fn = self.tools[call.name]
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return f"error: bad arguments for {call.name}: {e}", MALFORMED
        if self.calls_left <= 0:
            return "error: no tool calls left in this episode", FAILED
        self.calls_left -= 1
        try:
            return shown(fn(**call.arguments)), OK
        except Exception as e:  # the tool's own error: the model reads it
            return f"error: {type(e).__name__}: {e}", FAILED
