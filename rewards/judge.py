"""An LLM judge behind any OpenAI-compatible chat completions endpoint (vLLM, SGLang, llama.cpp's
server, Ollama, OpenAI itself): `rewards.names: [judge]` with the `rewards.judge` settings.

Each completion is one request to `<rewards.judge.url>/chat/completions`: a single user message,
`rewards.judge.prompt` with {question} (the prompt's last user turn), {completion} and {answer}
(the row's reference_answer) filled in. The reward is the last match of `rewards.judge.pattern`'s
one group in the judge's reply, as a float.

The completion is the policy's own text, and a policy under RL learns whatever raises its reward,
talking the judge into a score included. So it is filled in inside a fence it cannot close, a tag
keyed by a secret drawn at start (<completion-N> ... </completion-N>: `fenced`; a tag like it in the
completion is escaped), and a verdict is only believed when the reply ended on its own (not cut at
max_tokens, where it may end in a quoted "Score: 1" meant as 10) and lies within rewards.judge.range.
A reply without such a verdict is the completion's doing as far as anyone can tell (an injection
can make the judge ramble or answer 1000): that sample fails and scores the batch's worst
(rewards.on_failure), as does a request with no answer after its retries (a time limit, an HTTP
5xx) while the judge answered the batch's other samples. A judge that could not be asked at all
(it answered none of the batch, or its breaker is open: rewards/http_json.py Unreachable) leaves
the samples out instead. Both are counted
in rewards/judge/failures. The judge's breaker fails the rest of a batch at once when every
request in flight failed twice in a row.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import unicodedata
from concurrent.futures import ThreadPoolExecutor

from grpo.rewards.http_json import Breaker, ServiceError, Unreachable, post_json

PLACEHOLDERS = ("question", "completion", "answer")
_PLACEHOLDER_RE = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
NONCE_BYTES = 8  # 64 unguessable bits: a completion cannot write its fence's closing tag
FAILURES_PER_REQUEST = 2  # the breaker opens once each request in flight failed this many times in a row


FENCE_KEY = secrets.token_bytes(16)  # drawn when the sampler starts: the model never sees it
# the finish reasons of a reply that ended by itself (OpenAI and vLLM "stop", TGI "eos_token" or
# "stop_sequence", Anthropic-style "end_turn"); any other ("length", "content_filter", "abort",
# "tool_calls", none at all) is not a verdict
ENDED = ("stop", "eos_token", "stop_sequence", "end_turn")
# what a tag like the fence's may be written with instead of "<", "/" and the letters, once NFKC has
# folded the fullwidth and small forms: angle brackets and slashes of other blocks, and the Cyrillic,
# Greek and Latin letters drawn like those of "completion"
CONFUSABLES = {**dict.fromkeys("\u2039\u3008\u27e8\u1438\u02c2", "<"),
               **dict.fromkeys("\u2044\u2215\u29f8\u2571", "/"),
               **dict(zip("\u0441\u043e\u0440\u0435\u0456\u04cf\u0442\u043c\u043f\u03bf\u03b9\u0131\u217c",
                          "coepiltmnoiil")),
               **dict(zip("\u1d04\u1d0f\u1d0d\u1d18\u029f\u1d07\u1d1b\u026a\u0274", "completin"))}  # small capitals
FENCE_LIKE = re.compile(r"<\s*/?\s*completion")


def _skeleton(text: str) -> tuple[str, list[int]]:
    """`text` as the judge reads it, for finding look-alike tags: each character NFKC-folded, format
    characters (zero-width spaces and joiners, soft hyphens) and combining marks (U+034F) dropped,
    confusables mapped, lowercased;
    and for each character of it, the index in `text` it came from."""
    folded, where = [], []
    for i, char in enumerate(text):
        if unicodedata.category(char) in ("Cf", "Mn", "Me"):  # format characters, combining marks
            continue
        for c in unicodedata.normalize("NFKC", char).lower():
            folded.append(CONFUSABLES.get(c, c))
            where.append(i)
    return "".join(folded), where


def _escape_fence_like(completion: str) -> str:
    """Every tag of the fence's form, however written (look-alikes, format characters inside), has
    the character that opens it written "&lt;"."""
    skeleton, where = _skeleton(completion)
    opening = sorted({where[m.start()] for m in FENCE_LIKE.finditer(skeleton)}, reverse=True)
    for i in opening:
        completion = completion[:i] + "&lt;" + completion[i + 1:]
    return completion


def fenced(completion: str) -> str:
    """The completion between a tag pair it cannot close: the tag is a keyed hash of the completion
    under a key drawn at start, which the model never sees, so it cannot be guessed; the same
    completion gets the same request within a run (a greedy judge answers it alike). A tag of the
    fence's form (or a look-alike: _escape_fence_like) in the completion has its "<" written "&lt;"; the rest of the
    text is left as the model wrote it. In the 2^-64 case that the completion holds its tag, the
    next one is taken."""
    completion = _escape_fence_like(completion)
    counter = 0
    while True:
        nonce = hmac.new(FENCE_KEY, f"{counter}:{completion}".encode(), hashlib.sha256).hexdigest()[:2 * NONCE_BYTES]
        if nonce not in completion:
            return f"<completion-{nonce}>\n{completion}\n</completion-{nonce}>"
        counter += 1


def fill(template: str, values: dict[str, str]) -> str:
    """The template with each {question} / {completion} / {answer} replaced, in one pass: a
    completion that itself holds "{answer}" is not filled in, and other braces (JSON) stay as they are."""
    return _PLACEHOLDER_RE.sub(lambda m: values[m.group(1)], template)


def question_of(turns) -> str:
    """The question a prompt asks: its last user turn (earlier ones are few-shot examples)."""
    users = [t.get("content") or "" for t in turns if t.get("role") == "user"]
    return users[-1] if users else ""


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` cannot read a score out of a reply, or None."""
    try:
        groups = re.compile(pattern).groups
    except re.error as e:
        return f"rewards.judge.pattern {pattern!r} is not a regular expression: {e}"
    if groups != 1:
        return (f"rewards.judge.pattern {pattern!r} has {groups} groups; it needs exactly one, around the number "
                r"(e.g. 'Score: (\d+)')")
    return None


class Judge:
    """fn(completions, rows, prompts) -> the judge's score of each, or a ServiceError where it failed."""

    service = True  # rewards/services.py: runs in the sampler, gets the prompts, scores the batch at once

    def __init__(self, settings, timeout_s: float, retries: int):
        self.settings, self.timeout_s, self.retries = settings, timeout_s, retries  # the config's rewards.judge
        self.endpoint = settings.url.rstrip("/") + "/chat/completions"
        self.pattern = re.compile(settings.pattern)
        self.breaker = Breaker(FAILURES_PER_REQUEST * settings.concurrency)  # a dead judge costs a batch ~2 time limits

    def __call__(self, completions: list[str], rows: list[dict], prompts: list) -> list:
        with ThreadPoolExecutor(self.settings.concurrency) as pool:  # the server batches concurrent requests
            return list(pool.map(self.score, completions, rows, prompts))

    def request(self, completion: str, row: dict, turns) -> dict:
        """The chat completions request that judges one completion."""
        s = self.settings
        text = fill(s.prompt, {"question": question_of(turns), "completion": fenced(completion),
                               "answer": str(row.get("reference_answer") or "")})
        return {"model": s.model, "messages": [{"role": "user", "content": text}], "max_tokens": s.max_tokens,
                "temperature": s.temperature}

    def score(self, completion: str, row: dict, turns) -> float | ServiceError:
        """One completion's score, or the ServiceError that says why there is none (returned, not
        raised: the other samples of the batch keep theirs)."""
        try:
            answer = post_json(self.endpoint, self.request(completion, row, turns), self.timeout_s, self.retries,
                               self._headers(), self.breaker)
        except ServiceError as e:
            return e
        except Exception as e:  # anything else of one request is that sample's failure, not the batch's
            return Unreachable(f"{type(e).__name__}: {e}")
        return self.verdict(answer)

    def verdict(self, answer) -> float | ServiceError:
        """The score a chat completion gives, or why it gives none: not a chat completion, cut short,
        no number where the pattern looks, or a number outside rewards.judge.range."""
        reply, finish = _reply(answer)
        if finish is not None and finish not in ENDED:  # before the text: a filtered reply may have none
            hint = " (rewards.judge.max_tokens is too few for its verdict)" if finish == "length" else ""
            return ServiceError(f"the judge's reply ended with finish_reason {finish!r}, not by itself{hint}: "
                                f"{(reply or '')[-120:]!r}")
        if reply is None:
            return Unreachable(f"{self.endpoint} answered {str(answer)[:120]!r}, not a chat completion")
        if finish is None:
            return ServiceError(f"the judge's reply has no finish_reason, so it may have been cut short: "
                                f"{reply[-120:]!r}")
        found = self.pattern.findall(reply)
        try:
            score = float(found[-1])
        except (IndexError, ValueError):
            return ServiceError(f"the judge's reply {reply[-120:]!r} has no number where rewards.judge.pattern "
                                f"{self.settings.pattern!r} looks")
        low, high = self.settings.range
        if not low <= score <= high:
            return ServiceError(f"the judge's verdict {score:g} is outside rewards.judge.range [{low:g}, {high:g}]")
        return score

    def _headers(self) -> dict:
        key = os.environ.get(self.settings.api_key_env, "") if self.settings.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}


def _reply(answer) -> tuple[str | None, object]:
    """(the text of a chat completion's first choice, its finish_reason), each None where absent."""
    try:
        choice = answer["choices"][0]
        content, finish = choice["message"].get("content"), choice.get("finish_reason")
    except (KeyError, IndexError, TypeError, AttributeError):
        return None, None
    return content if isinstance(content, str) else None, finish if isinstance(finish, str) else None
