"""The tool calls in a model's message, read the way the model's chat template writes them.

`env.tool_parser` names the form; each agrees with vLLM's parser of the same name on a message
that holds well-formed calls (tests/test_vllm_engine.py compares them on the same texts):
  hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number of them
               (Qwen2.5/3, SmolLM3, Hermes; the shipped chatml-tools template)
  llama3_json  {"name": ..., "arguments" or "parameters": {...}}, optionally after <|python_tag|>,
               several separated by ';' (Llama 3.1/3.2 JSON tool calling); as in vLLM, an object
               without "arguments" or "parameters" is no call ({"name": "Alice", "age": 31} is data)
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


def _call(obj, arguments_keys: tuple[str, ...], required: bool = False) -> ToolCall:
    """A decoded JSON value as a call: an object with a str "name" and an object of arguments (under
    the first of `arguments_keys` it has; none: no arguments, or a malformed call where `required`)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'a tool call is a JSON object with a "name" string')
    key = next((k for k in arguments_keys if k in obj), None)
    if key is None and required:
        return ToolCall(obj["name"], {}, f'a tool call holds its arguments in "{arguments_keys[0]}" (or '
                                         f'"{arguments_keys[1]}"): a JSON object')
    arguments = obj[key] if key is not None else {}
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, f'the "{arguments_keys[0]}" of a tool call must be a JSON object')
    return ToolCall(obj["name"], arguments)


TOO_DEEP = "the tool call's JSON is nested too deep to read"
HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)  # vLLM's hermes regex


def parse_hermes(message: str) -> list[ToolCall]:
    calls = []
    for closed, unclosed in HERMES.findall(message):
        try:
            calls.append(_call(json.loads(closed or unclosed), ("arguments",)))
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
        except RecursionError:  # nested deeper than the parser goes: a model's message must not stop the step
            calls.append(ToolCall("", {}, TOO_DEEP))
    return calls


PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("arguments", "parameters")  # vLLM's llama3_json parser requires one of them
# a call begun after other text (a prefill, a thought): its name, then its arguments' key
CALL_START = re.compile(r'\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"(?:arguments|parameters)"\s*:')


def parse_llama3_json(message: str) -> list[ToolCall]:
    """JSON objects in the message, as vLLM's llama3_json parser finds them (each '{' not inside an
    object already read starts one); an object is a call when it has "name" and "arguments" or
    "parameters", as vLLM requires. A message that opens with '{' or <|python_tag|> is all calls:
    an object in it that is not one, or JSON that cannot be read, is a malformed call. After other
    text, an object that is not a call is text (an answer that holds a JSON record), and JSON that
    cannot be read is a malformed call only where it begins as one ('{"name": "...", "arguments":')."""
    text = message.replace(PYTHON_TAG, "")
    opens = message.lstrip().startswith(("{", PYTHON_TAG))
    decoder, calls, end = json.JSONDecoder(), [], -1
    for match in re.finditer(r"\{", text):
        if match.start() <= end:
            continue
        try:
            obj, length = decoder.raw_decode(text[match.start():])
        except json.JSONDecodeError as e:
            if opens or CALL_START.match(text, match.start()):
                calls.append(ToolCall("", {}, f"the tool call is not valid JSON ({e.msg} at character {e.pos})"))
            break
        except RecursionError:
            calls.append(ToolCall("", {}, TOO_DEEP))
            break
        end = match.start() + length
        is_call = isinstance(obj.get("name"), str) and any(k in obj for k in ARGUMENT_KEYS)
        if is_call or opens:
            calls.append(_call(obj, ARGUMENT_KEYS, required=True))
    return calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
