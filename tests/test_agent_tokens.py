"""The prefix rule's token half (grpo/agent/tokens.py) on a Qwen2-style byte-level tokenizer with the shipped
chatml-tools template (Qwen2.5's), and a Qwen3-style template that drops earlier turns' thinking."""

from test_reply_tokens import qwen2_style_tokenizer

from grpo.agent.history import continuation
from grpo.agent.tokens import CLEAN, EQUIVALENT, NEW_ROW, next_context, render, render_ids, shows_every_turn
from grpo.sampler.episodes import EpisodeRunner

ASK = [{"role": "user", "content": "The answer is 4."}]
SAID = {"role": "assistant", "content": "The answer is 4."}
MORE = {"role": "user", "content": "So it is 3."}
# Qwen3's rule, cut down: an assistant turn's thinking is shown only after the last user message
QWEN3_STYLE = ("{%- set ns = namespace(last=0) %}{%- for m in messages %}{%- if m.role == 'user' %}"
               "{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
               "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
               "{%- if m.role == 'assistant' and m.reasoning_content and loop.index0 > ns.last %}"
               "{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
               "{{- m.content + '<|im_end|>\\n' }}{%- endfor %}"
               "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def sampled(tokenizer, text: str, canonical: bool) -> list[int]:
    """The model's turn as it may have drawn it: the tokenizer's own reading of the text, or one character a
    token (as a model may sample), then its EOS."""
    ids = (tokenizer(text, add_special_tokens=False)["input_ids"] if canonical else
           [t for c in text for t in tokenizer(c, add_special_tokens=False)["input_ids"]])
    return ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]


def test_the_tokenizers_own_reading_goes_on_clean_another_goes_on_from_the_rows_own_tokens():
    tokenizer = qwen2_style_tokenizer()
    runner = EpisodeRunner(None, tokenizer, 400, 4)
    prompt = render_ids(tokenizer, ASK)
    request = [*ASK, SAID, MORE]
    fresh = render_ids(tokenizer, request)
    continues = continuation(ASK, SAID, request).new == (MORE,)
    shows = shows_every_turn(render(tokenizer, request), request)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    row = prompt + sampled(tokenizer, SAID["content"], canonical=True)
    kind, ids = next_context(row, fresh, continues, shows, lambda: runner.reply_tokens(MORE["content"], "user", eos))
    assert kind == CLEAN and row + ids == fresh
    assert tokenizer.decode(ids) == "\n<|im_start|>user\nSo it is 3.<|im_end|>\n<|im_start|>assistant\n"

    row = prompt + sampled(tokenizer, SAID["content"], canonical=False)
    assert row != fresh[:len(row)]  # the same text, other tokens
    kind, ids = next_context(row, fresh, continues, shows, lambda: runner.reply_tokens(MORE["content"], "user", eos))
    assert kind == EQUIVALENT and tokenizer.decode(row + ids) == tokenizer.decode(fresh)  # the same text
    assert ids == fresh[len(prompt) + len(sampled(tokenizer, SAID["content"], canonical=True)):]  # the same reply


def test_a_template_that_drops_earlier_thinking_starts_a_new_row_from_the_fresh_render():
    tokenizer = qwen2_style_tokenizer()
    tokenizer.chat_template = QWEN3_STYLE
    thought = {**SAID, "reasoning_content": "Let me check."}
    request = [*ASK, thought, MORE]
    text = render(tokenizer, request)
    assert "Let me check." not in text and not shows_every_turn(text, request)
    assert shows_every_turn(render(tokenizer, [*ASK, thought]), [*ASK, thought])  # the last turn's is shown
    fresh = render_ids(tokenizer, request)
    kind, ids = next_context([1, 2, 3], fresh, continues=True, shows_all=False, reply=lambda: [9])
    assert (kind, ids) == (NEW_ROW, fresh)


def test_after_a_turn_cut_at_its_max_tokens_the_reply_holds_the_templates_whole_end_of_turn():
    """A turn cut before its EOS (a request's max_tokens) ends with any token, here "<", the first character of
    <|im_end|>: the reply rule keeps the template's end of turn whole after it (left out only after a special
    token, the model's own EOS), and the row's text is then the template's render of the cut turn."""
    tokenizer = qwen2_style_tokenizer()
    runner = EpisodeRunner(None, tokenizer, 400, 4)
    cut = {"role": "assistant", "content": "The answer is <"}
    request = [*ASK, cut, MORE]
    row = render_ids(tokenizer, ASK) + [t for c in cut["content"] for t in tokenizer(c, add_special_tokens=False)[
        "input_ids"]]
    assert tokenizer.decode(row[-1:]) == "<"
    ids = runner.reply_tokens(MORE["content"], "user", row[-1])
    assert tokenizer.decode(ids) == "<|im_end|>\n<|im_start|>user\nSo it is 3.<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(row + ids) == render(tokenizer, request)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(runner.reply_tokens(MORE["content"], "user", eos)).startswith("\n<|im_start|>user")


def test_what_a_message_said_keeps_the_token_that_completed_a_stop_string_and_drops_only_the_eos():
    """The text an environment or a tool parser reads: a turn ended by its EOS without it; one ended by a stop
    string ("</tool_call>") whole, its last token included (a call cut short there would not parse)."""
    import torch

    from grpo.sampler.episode_records import Episode

    tokenizer = qwen2_style_tokenizer()
    runner = EpisodeRunner(None, tokenizer, 400, 4)
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    ids = tokenizer(call, add_special_tokens=False)["input_ids"]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for tokens, said in ((ids, call), (ids + [eos], call), (ids[:-1], tokenizer.decode(ids[:-1]))):
        e = Episode()
        runner._add_model_turn(e, torch.tensor(tokens), torch.zeros(len(tokens)), False)
        assert e.said == said


def test_a_new_row_that_the_model_already_read_is_refused_as_a_re_roll_and_a_new_context_is_not():
    """A sample's rows after the prompt [1, 2]: [5, 6, 7] and [8, 9]. A new row whose context (the prompt, then
    its tokens) is a prefix of the prompt and a row is what the model read before it sampled there: refused."""
    import pytest

    from grpo.agent.server import AgentError
    from grpo.agent.tokens import REPEATED, check_not_reread

    prompt, rows = [1, 2], [[5, 6, 7], [8, 9]]
    for tokens in ([5], [5, 6], [5, 6, 7], [8]):  # an earlier request again; a completions prompt cut back
        with pytest.raises(AgentError, match="a turn it sampled would be sampled again") as refused:
            check_not_reread(prompt, rows, tokens)
        assert refused.value.code == REPEATED
    for tokens in ([5, 9], [6], [8, 9, 4], [5, 6, 7, 1]):  # another context, or more than the model read
        check_not_reread(prompt, rows, tokens)
