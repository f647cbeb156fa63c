"""The prefix rule's message half: is an agent's next request the conversation we served, continued?

A harness sends the whole history with every request. Before any token is reused, the history is compared with
what this session served: the messages of its last request, then the assistant message we returned, then
only new messages from the harness (tool results, user turns). Compared turn by turn on what the model reads:
role, text content, reasoning, tool calls (name, and arguments as the values they spell: key order,
whitespace, and a harness's Python spelling of the same JSON, {'a': False} for {"a": false}, do not count),
tool_call_id and name. `continuation` says which case a request is; the token half (does the template still
render every earlier turn?) is the session's.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass

CONTINUES = "continues"  # the served conversation, then only new tool / user messages
# why a request does not continue the served conversation (each a metric's name: agent/refused/<reason>)
SHORTER = "shorter"  # fewer messages than we served: a history dropped or summarised
REPEATED = "repeated"  # the last request's messages again (without the SDK's retry header): a turn sampled again
EDITED = "edited"  # an earlier message differs
ASSISTANT_CHANGED = "assistant_changed"  # our message came back otherwise (thinking dropped, text edited)
FOREIGN_ASSISTANT = "foreign_assistant"  # a new message in another role than user or tool (one we did not write)
UNKNOWN_CALL = "unknown_call"  # a tool message answering a call id our message did not make
NOTHING_NEW = "nothing_new"  # no new message after ours: nothing for the model to answer
NEW_ROLES = ("user", "tool")  # what a harness may add after our message


@dataclass(frozen=True)
class Continuation:
    kind: str  # CONTINUES or a reason it does not
    new: tuple[dict, ...] = ()  # with CONTINUES: the harness's new messages, in order
    at: int | None = None  # otherwise: the index of the first message that differs, where there is one


def continuation(served: list[dict], returned: dict, request: list[dict]) -> Continuation:
    """`request`'s messages against the `served` ones (the last request's) and the assistant message we
    `returned` to it."""
    expected = [*served, returned]
    for i, (ours, theirs) in enumerate(zip(expected, request)):  # the first message that differs, if any
        if normal(ours) != normal(theirs):
            return Continuation(ASSISTANT_CHANGED if i == len(served) else EDITED, at=i)
    if len(request) < len(expected):
        return Continuation(REPEATED if len(request) == len(served) else SHORTER, at=len(request))
    new = request[len(expected):]
    if not new:
        return Continuation(NOTHING_NEW, at=len(request))
    foreign = next((len(expected) + k for k, m in enumerate(new) if m.get("role") not in NEW_ROLES), None)
    if foreign is not None:
        return Continuation(FOREIGN_ASSISTANT, at=foreign)
    ours = {call.get("id") for call in returned.get("tool_calls") or () if isinstance(call, dict)}
    unknown = next((len(expected) + k for k, m in enumerate(new)
                    if m.get("role") == "tool" and m.get("tool_call_id") not in ours), None)
    if unknown is not None:
        return Continuation(UNKNOWN_CALL, at=unknown)
    return Continuation(CONTINUES, tuple(new))


def normal(message: dict) -> tuple:
    """What the model reads of a chat message, in a form that compares equal when only its spelling
    differs: text parts joined, tool calls' arguments parsed."""
    return (message.get("role"), text_of(message.get("content")),
            text_of(message.get("reasoning_content") or message.get("reasoning")),
            tuple(_call(c) for c in message.get("tool_calls") or ()), message.get("tool_call_id"),
            message.get("name"))


def text_of(content) -> str:
    """A message's content as the text the template shows: a string, or its text parts (OpenAI's list form)
    joined by newlines, as vLLM joins them for a template that takes text; None is ''."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def as_text(messages: list[dict]) -> list[dict]:
    """The messages with each list of text parts as its text (`text_of`): what the chat template is given."""
    return [{**m, "content": text_of(m["content"])} if isinstance(m.get("content"), list) else m for m in messages]


def _call(call) -> tuple:
    function = call.get("function", call) if isinstance(call, dict) else {}
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if isinstance(arguments, str):
        arguments = _value(arguments)
    try:
        spelled = json.dumps(arguments, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):  # a Python literal JSON cannot hold (a set, mixed keys): compared as written
        spelled = repr(arguments)
    except RecursionError:  # nested too deep to write: equal to nothing else
        spelled = f"<nested too deep: {id(arguments)}>"
    return (function.get("name") if isinstance(function, dict) else None, spelled)


def _value(arguments: str):
    """Tool call arguments as the value they spell: JSON, or the same written as a Python literal (a harness that
    printed a dict); otherwise the text as written, so two unreadable ones match only letter for letter."""
    try:
        return json.loads(arguments)
    except ValueError:
        pass
    except RecursionError:  # nested too deep to read: compared as written
        return arguments.strip()
    try:
        value = ast.literal_eval(arguments.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return arguments.strip()
    return value if isinstance(value, (dict, list)) else arguments.strip()
