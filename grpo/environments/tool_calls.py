"""The tool calls in a model's message, read the way the model's chat template writes them.

`env.tool_parser` names the form; each agrees with vLLM's parser of the same name on a message
that holds well-formed calls (tests/test_vllm_engine.py compares them on the same texts):
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of them
               (Qwen2.5/3, SmolLM3, Hermes; the shipped chatml-tools template)
  llama3_json  {"name": ..., "arguments" or "parameters": {...}}, optionally after <|python_tag|>,
               several separated by ';' (Llama 3.1/3.2 JSON tool calling)
Where vLLM reads a malformed call as plain content, these read it as a call that failed, so the
model is told what was wrong (a tool error) instead of having its message taken as its answer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str  # "" when the call could not be read
    arguments: dict
    error: str | None = None  # why the call could not be read: the model is shown this


def _call(obj, arguments_keys: tuple[str, ...]) -> ToolCall:
    """A decoded JSON value as a call: an object with a str "name" and an object of arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'a tool call is a JSON object with a "name" string')
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = obj[key] if key is not None else {}
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, f'the "{arguments_keys[0]}" of a tool call must be a JSON object')
    return ToolCall(obj["name"], arguments)


HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM's hermes regex


def parse_hermes(message: str) -> list[ToolCall]:
    calls = []
    for closed, unclosed in HERMES.findall(message):
        try:
            calls.append(_call(json.loads(closed or unclosed), ("arguments",)))
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
    return calls


PYTHON_TAG = "<|python_tag|>"
CALL_START = re.compile(r'\{\s*"name"\s*:')  # a call begun after other text (a prefill, a thought)


def parse_llama3_json(message: str) -> list[ToolCall]:
    """JSON objects in the message, as vLLM's llama3_json parser finds them (each '{' not inside an
    object already read starts one). A message that neither opens with '{' or <|python_tag|> nor
    holds '{"name":' makes no call (an answer that happens to hold braces); one that does and
    cannot be read is a malformed call."""
    text = message.replace(PYTHON_TAG, "")
    attempted = message.lstrip().startswith(("{", PYTHON_TAG)) or CALL_START.search(text) is not None
    decoder, calls, end = json.JSONDecoder(), [], -1
    for match in re.finditer(r"\{", text):
        if match.start() <= end:
            continue
        try:
            obj, length = decoder.raw_decode(text[match.start():])
        except json.JSONDecodeError as e:
            if attempted:
                calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            break
        end = match.start() + length
        if isinstance(obj, dict) and "name" in obj:
            calls.append(_call(obj, ("arguments", "parameters")))
        elif attempted:
            calls.append(_call(obj, ("arguments", "parameters")))
    return calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
