"""The prefix rule's token half: a session's requests as tokens, and how its row goes on after each.

CLEAN: the template's fresh render of the request extends the row's tokens as they are (the model sampled the
tokenizer's own reading of its text): the row goes on with the render's new tokens. EQUIVALENT: not so (the model
drew "a","b" where the tokenizer writes "ab", the template writes our tool calls with its own spacing), but the
request continues the served conversation (history.CONTINUES) and the template still shows every earlier turn
whole: the row goes on from its own tokens plus the new messages as the reply rule renders them
(grpo/sampler/episodes.py reply_ids). Otherwise (the template or the harness dropped the thinking, an edited or
compacted history, a message we did not write) a NEW_ROW starts from the fresh render: what the model reads next
is not the row's context, so the row ends where it is, and the sample goes on in a row of its own, read after the
group's prompt alone (grpo/model/segments.py). A new row must begin with that prompt (the session's first
request's render); one whose context the model already read (the last request again, an earlier one, a
completions prompt cut back: `check_not_reread`) is refused, as it would sample a turn already sampled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from grpo.agent.bridge import continues_final
from grpo.agent.history import CONTINUES, NOTHING_NEW, REPEATED, Continuation, as_text, text_of
from grpo.agent.server import AgentError
from grpo.sampler.episodes import TemplateRoleError

CLEAN, EQUIVALENT, NEW_ROW = "clean", "equivalent", "new_row"
# why a request is refused and its session ends (each agent/refused/<reason>), besides history.py's NOTHING_NEW
# and REPEATED (a turn to sample again)
TOOLS_CHANGED = "tools_changed"  # the request offers other tools than the session's first
KIND_CHANGED = "kind_changed"  # chat after completions, or the other way round
# why a request starts a new row, besides history.py's reasons (each agent/new_row/<reason>)
TEMPLATE_DROPS = "template_drops"  # the template no longer shows an earlier turn as it was sampled
TOKENS_DIFFER = "tokens_differ"  # a completions prompt that does not extend the session's tokens
# refused: a new row's render that does not begin with the session's first (the group's prompt)
PROMPT_CHANGED = "prompt_changed"
MAX_TOKEN_CHARS = 64  # no token is longer: messages past this many characters a token of room are refused unread


def render(tokenizer, messages: list[dict], tools: list | None = None, continued: bool = False) -> str:
    """The template's text of a request: ending with the next assistant turn's header, or (`continued`, vLLM's
    continue_final_message) inside the last message, an assistant turn the model goes on with."""
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=not continued, continue_final_message=continued)


def render_ids(tokenizer, messages: list[dict], tools: list | None = None) -> list[int]:
    """The request as the model reads it: the template's text, then its tokens (special tokens as the template
    writes them)."""
    return tokenizer(render(tokenizer, messages, tools), add_special_tokens=False)["input_ids"]


def shows_every_turn(rendered: str, messages: list[dict]) -> bool:
    """Every assistant message's reasoning and text stand in the template's rendering, in order: a template that
    drops earlier turns' thinking (Qwen3's, after a new user turn) or ignores reasoning_content does not."""
    at = 0  # each found after the one before: a short text that also stands elsewhere does not pass for it
    for message in messages:
        if message.get("role") != "assistant":
            continue
        reasoning = text_of(message.get("reasoning_content") or message.get("reasoning"))
        for part in (reasoning.strip(), text_of(message.get("content")).strip()):
            if part:
                found = rendered.find(part, at)
                if found < 0:
                    return False
                at = found + len(part)
    return True


def next_context(row: list[int], fresh: list[int], continues: bool, shows_all: bool,
                 reply: Callable[[], list[int]]) -> tuple[str, list[int]]:
    """(how the row goes on, the tokens after it): with `continues` (history.CONTINUES), CLEAN and the fresh
    render's tokens past the row, or EQUIVALENT and `reply()` (the new messages by the reply rule); otherwise
    NEW_ROW and the whole fresh render.
    `row`: the prompt and everything after it so far, ending with the model's last token."""
    if not continues:  # whatever its tokens: what the model reads next is not the row's conversation continued
        return NEW_ROW, fresh
    if len(fresh) > len(row) and fresh[:len(row)] == row:
        return CLEAN, fresh[len(row):]
    if shows_all:
        return EQUIVALENT, reply()
    return NEW_ROW, fresh


class RequestTokens:
    """A session's requests as the model reads them: the first one's tokens (`first`), and how each later one goes
    on from the row (`continued`). `reply_tokens(texts, role, ended_with, prefill)`: the reply rule
    (grpo/sampler/episodes.py EpisodeRunner.reply_tokens); `lock`: the tokenizer's, shared with it."""

    def __init__(self, tokenizer, reply_tokens: Callable, lock: threading.Lock, max_new_tokens: int):
        self.tokenizer, self.reply_tokens, self.lock = tokenizer, reply_tokens, lock
        self.max_new_tokens = max_new_tokens

    def first(self, kind: str, body: dict) -> list[int]:
        if kind == "chat":
            return self.ids_of(self.render(body["messages"], body.get("tools"), continues_final(body)))
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return self.ids_of(prompt)
        vocab = len(self.tokenizer)
        if not prompt or not all(type(t) is int and 0 <= t < vocab for t in prompt):
            raise AgentError(400, f"prompt must be a string or a non-empty list of token ids in [0, {vocab})",
                             code="prompt")
        return list(prompt)

    def continued(self, began: tuple[str, list | None, list[int]], row: list[int], used: int, kind: str, body: dict,
                  continuation: Continuation) -> tuple[str, list[int], str]:
        """(CLEAN, EQUIVALENT or NEW_ROW; the tokens the model reads before its next message: past the row, or for
        a NEW_ROW past the prompt; why a new row: "" otherwise); AgentError (its code the reason) for a request the
        session cannot take. `began`: the session's first request's kind, tools and render (the group's prompt);
        `row`: that prompt and the row's tokens since (the model's context); `used`: the sample's tokens so far."""
        first_kind, tools, prompt = began
        if kind != first_kind:
            raise broken(KIND_CHANGED, f"a {kind} request in a session that began with {first_kind}")
        if kind == "completions":
            ids = self.first(kind, body)
            if len(ids) > len(row) and ids[:len(row)] == row:
                return CLEAN, ids[len(row):], ""
            return NEW_ROW, self.past_prompt(ids, prompt), TOKENS_DIFFER
        if continuation.kind in (NOTHING_NEW, REPEATED):  # a turn for the model to sample again
            raise broken(continuation.kind, "nothing new after this session's last turn" if continuation.kind ==
                         NOTHING_NEW else "the session's last request again, without the SDK's retry header")
        if (body.get("tools") or None) != (tools or None):
            raise broken(TOOLS_CHANGED, "the request offers other tools than the session's first")
        room = self.max_new_tokens - used
        continues = continuation.kind == CONTINUES  # else the whole conversation is rendered again, after the prompt
        new, room = (continuation.new, room) if continues else (body["messages"], room + len(prompt))
        if sum(len(text_of(m.get("content"))) for m in new) > MAX_TOKEN_CHARS * room:
            raise broken("context_length_exceeded", "the messages are longer than what is left of "
                                                    f"sampling.max_new_tokens={self.max_new_tokens}")
        messages = as_text(body["messages"])
        text = self.render(messages, tools, continues_final(body))
        fresh = self.ids_of(text)
        if not continues:  # whatever its tokens: not the conversation the model read, continued
            return NEW_ROW, self.past_prompt(fresh, prompt), continuation.kind
        roles = {m["role"] for m in continuation.new}
        prefill = text_of(messages[-1].get("content")) if continues_final(body) else ""  # the turn it begins

        def reply() -> list[int]:
            texts = [text_of(m.get("content")) for m in continuation.new]
            return self.reply_tokens(texts, roles.pop(), ended_with=row[-1], prefill=prefill)

        try:
            how, tokens = next_context(row, fresh, True, len(roles) == 1 and shows_every_turn(text, messages), reply)
        except TemplateRoleError:  # the reply rule cannot write these roles: the fresh render, in a row of its own
            how = NEW_ROW
        if how == NEW_ROW:  # the template drops or rewrites an earlier turn
            return NEW_ROW, self.past_prompt(fresh, prompt), TEMPLATE_DROPS
        return how, tokens, ""

    @staticmethod
    def past_prompt(ids: list[int], prompt: list[int]) -> list[int]:
        """A new row's tokens after the prompt it shares with its group; AgentError where it does not begin with that
        prompt, or is that prompt alone (the session's first request again)."""
        if ids[:len(prompt)] != prompt:
            raise broken(PROMPT_CHANGED, "the request does not begin as the session's first did (the system prompt, "
                                         "the tools or the first messages changed), and a sample's rows share the "
                                         "group's prompt")
        if len(ids) == len(prompt):
            raise broken(REPEATED, "the request is the session's first again")
        return ids[len(prompt):]

    def render(self, messages: list[dict], tools, continued: bool = False) -> str:
        """The template's text of a request; AgentError where the template refuses it (roles out of order)."""
        try:
            with self.lock:  # the turns' threads share the tokenizer
                return render(self.tokenizer, as_text(messages), tools, continued)
        except Exception as e:  # whatever the template raises is the request's problem, never the step's
            raise AgentError(400, f"the chat template cannot render these messages ({type(e).__name__}: {e})",
                             code="template") from None

    def ids_of(self, text: str) -> list[int]:
        """The text's tokens, special tokens as the template writes them (a request's own messages are the
        harness's: it may write them)."""
        with self.lock:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]


def check_not_reread(prompt: list[int], rows: list[list[int]], tokens: list[int]) -> None:
    """A new row's context (the prompt, then `tokens`) must not be what the model already read in one of the
    sample's rows (the prompt and a prefix of that row): the model would sample again what it sampled there, a
    re-roll of a turn (an earlier request sent again, a completions prompt cut back)."""
    context = prompt + tokens
    if any((prompt + row)[:len(context)] == context for row in rows):
        raise broken(REPEATED, "the request is a conversation the model already read in this session: a turn it "
                               "sampled would be sampled again")


def broken(reason: str, message: str) -> AgentError:
    return AgentError(400, f"{message}; a session is one conversation: start a new session for another",
                      code=reason)
