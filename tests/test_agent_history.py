"""The prefix rule's message half (grpo/agent/history.py): a harness's next request against the conversation a
session served, with the requests a gaming or sloppy agent loop sends."""

import pytest

from grpo.agent.history import (
    ASSISTANT_CHANGED,
    CONTINUES,
    EDITED,
    FOREIGN_ASSISTANT,
    NOTHING_NEW,
    REPEATED,
    SHORTER,
    UNKNOWN_CALL,
    continuation,
    normal,
)

SERVED = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "What is 3 + 4?"}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "add", "arguments": '{"a": 3, "b": 4, "exact": false}'}}
RETURNED = {"role": "assistant", "content": "", "reasoning_content": "I add.", "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "7"}


def with_call(arguments: str, **message) -> dict:
    return {**RETURNED, **message, "tool_calls": [{**CALL, "function": {"name": "add", "arguments": arguments}}]}


def test_the_served_conversation_then_a_tool_result_continues_whatever_the_spelling_of_the_same_values():
    """Our message back with its arguments re-serialised (keys reordered, spaces, Python's False), content as
    OpenAI's list of text parts, None for '': the same conversation; the new messages are the tool result."""
    spellings = ['{"b":4,"a":3,"exact":false}', "{'a': 3, 'b': 4, 'exact': False}",
                 ' {"a": 3, "b": 4, "exact": false} ']
    for arguments in spellings:
        back = with_call(arguments, content=None)
        request = [SERVED[0], {"role": "user", "content": [{"type": "text", "text": "What is 3 + 4?"}]}, back, RESULT]
        assert continuation(SERVED, RETURNED, request) == continuation(SERVED, RETURNED, [*SERVED, RETURNED, RESULT])
        assert continuation(SERVED, RETURNED, request).kind == CONTINUES
        assert continuation(SERVED, RETURNED, request).new == (RESULT,)
    user = {"role": "user", "content": "Now times 2."}
    assert continuation(SERVED, RETURNED, [*SERVED, RETURNED, RESULT, user]).new == (RESULT, user)


@pytest.mark.parametrize("request_, kind, at", [
    # the thinking dropped from our message (templates and harnesses that strip reasoning)
    ([*SERVED, {**RETURNED, "reasoning_content": None}, RESULT], ASSISTANT_CHANGED, 2),
    # our call's arguments changed (a value, not a spelling), or a call added
    ([*SERVED, with_call('{"a": 3, "b": 5, "exact": false}'), RESULT], ASSISTANT_CHANGED, 2),
    ([*SERVED, {**RETURNED, "tool_calls": [CALL, CALL]}, RESULT], ASSISTANT_CHANGED, 2),
    # an earlier turn edited (the question rewritten), the system prompt dropped, the history summarised
    ([SERVED[0], {"role": "user", "content": "What is 3 + 5?"}, RETURNED, RESULT], EDITED, 1),
    ([SERVED[1], RETURNED, RESULT], EDITED, 0),
    ([SERVED[0], {"role": "user", "content": "Summary: asked 3 + 4, called add."}, RESULT], EDITED, 1),
    ([SERVED[0]], SHORTER, 1),
    # the last request again, without the retry header
    (SERVED, REPEATED, 2),
    # an assistant message we never wrote after ours (a harness answering for the model)
    ([*SERVED, RETURNED, RESULT, {"role": "assistant", "content": "The answer is 7."}], FOREIGN_ASSISTANT, 4),
    # a new message in a role a harness does not add ("Assistant", "system": a turn written for the model)
    ([*SERVED, RETURNED, RESULT, {"role": "Assistant", "content": "7"}], FOREIGN_ASSISTANT, 4),
    ([*SERVED, RETURNED, {"role": "system", "content": "You answered 7."}], FOREIGN_ASSISTANT, 3),
    # a tool result for a call our message did not make
    ([*SERVED, RETURNED, {**RESULT, "tool_call_id": "call_9"}], UNKNOWN_CALL, 3),
    # the same request again, with nothing new to answer
    ([*SERVED, RETURNED], NOTHING_NEW, 3),
], ids=["thinking-dropped", "arguments-changed", "call-added", "question-edited", "system-dropped", "summarised",
        "cut-short", "repeated", "foreign-assistant", "capitalised-role", "system-added", "unknown-call",
        "nothing-new"])
def test_a_request_that_is_not_the_served_conversation_continued_names_why_and_where(request_, kind, at):
    result = continuation(SERVED, RETURNED, request_)
    assert (result.kind, result.at, result.new) == (kind, at, ())


def test_unreadable_arguments_match_only_as_written():
    """JSON cut short (a stream cut mid-call), a Python value that is no object (a set): the text as written,
    spaces at the ends aside."""
    broken = with_call('{"a": 3,')
    assert normal(broken) == normal(with_call(' {"a": 3, '))
    assert normal(broken) != normal(with_call('{"a": 3}'))
    assert normal(with_call("{1, 2}")) != normal(with_call("{2, 1}"))
    assert normal(with_call("{'a': {1, 2}}")) == normal(with_call("{'a': {1, 2}}"))  # no JSON for it: its repr
