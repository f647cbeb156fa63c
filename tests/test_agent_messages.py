"""The model's text as the assistant turn the harness reads (grpo/agent/messages.py), on the forms vLLM's
parsers read alike."""

import itertools

from grpo.agent.messages import assistant_turn, split_reasoning


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def message(text, parser, truncated=False):
    turn = assistant_turn(text, parser, ids(), truncated, 10, 5)
    return turn.message(), turn.finish_reason


def test_reasoning_is_what_stands_before_the_closing_tag():
    assert split_reasoning("<think>3 + 4 is 7.</think>\n\nIt is 7.") == ("3 + 4 is 7.", "\n\nIt is 7.")
    assert split_reasoning("3 + 4 is 7.</think>It is 7.") == ("3 + 4 is 7.", "It is 7.")  # <think> in the prefill
    assert split_reasoning("<think>still thinking") == (None, "<think>still thinking")  # cut before it closed


def test_hermes_calls_become_tool_calls_with_ids_and_the_text_before_them_content():
    text = ('<think>I add.</think>Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {"a": "é"}}</tool_call>')
    assert message(text, "hermes") == ({
        "role": "assistant", "content": "Let me add.\n", "reasoning": "I add.", "reasoning_content": "I add.",
        "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}},
            {"id": "call_1", "type": "function", "function": {"name": "mul", "arguments": '{"a": "é"}'}}]},
        "tool_calls")


def test_a_message_whose_calls_cannot_all_be_read_or_that_was_cut_is_plain_content():
    broken = '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call><tool_call>{"name": "add",'
    assert message(broken, "hermes") == ({"role": "assistant", "content": broken}, "stop")
    cut = '<tool_call>{"name": "add", "arguments": {"a": 3}}</tool_call>'
    assert message(cut, "hermes", truncated=True) == ({"role": "assistant", "content": cut}, "length")
    assert message(cut, None) == ({"role": "assistant", "content": cut}, "stop")


def test_llama3_json_calls_opening_the_message_leave_no_content():
    sent, finish = message('{"name": "add", "parameters": {"a": 3}}', "llama3_json")
    assert finish == "tool_calls" and sent["content"] is None
    assert sent["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 3}'}
