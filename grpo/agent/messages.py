"""The model's sampled text as the assistant message an OpenAI-compatible server returns: its reasoning
(<think>…</think>, as vLLM's deepseek_r1 / qwen3 reasoning parsers split it), its content, its tool calls (read
with env.tool_parser's form, grpo/environments/tool_calls.py) and the finish reason.

As vLLM's tool parsers do, a message whose calls cannot all be read comes back as plain content with no call:
the harness decides what to tell the model. The tokens the model sampled are kept by the session whatever the
message's form; this is only what the harness reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from grpo.agent.server import Turn
from grpo.environments.tool_calls import PARSERS

THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content): what stands before </think> (less an opening <think>), and what follows it; no
    </think>: no reasoning, all content."""
    if THINK_END not in text:
        return None, text
    reasoning, content = text.split(THINK_END, 1)
    reasoning = reasoning.lstrip()
    return reasoning.removeprefix(THINK_START), content


def assistant_turn(text: str, tool_parser: str | None, call_id: Callable[[], str], truncated: bool,
                   prompt_tokens: int, completion_tokens: int, split_thinking: bool = True) -> Turn:
    """The turn a harness reads (its `message()` is what the response carries and the next request must
    repeat): finish_reason length when cut at the budget, tool_calls when it made calls, else stop. `call_id()`
    gives each call its id (unique in the session: the harness answers by it). `split_thinking` False: the whole
    text is the content."""
    reasoning, content = split_reasoning(text) if split_thinking else (None, text)
    calls = PARSERS[tool_parser](content) if tool_parser else []
    if calls and all(call.error is None for call in calls) and not truncated:
        tool_calls = [{"id": call_id(), "type": "function",
                       "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
                      for call in calls]
        return Turn(_before_calls(content, tool_parser), "tool_calls", prompt_tokens, completion_tokens, reasoning,
                    tool_calls)
    return Turn(content, "length" if truncated else "stop", prompt_tokens, completion_tokens, reasoning)


def _before_calls(content: str, tool_parser: str) -> str:
    """The text before the first call, as vLLM's hermes parser returns it; its llama3_json parser returns no
    content with calls."""
    return content[:content.find("<tool_call>")] if tool_parser == "hermes" else ""
