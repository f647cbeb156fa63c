"""An LLM judge behind any OpenAI-compatible chat completions endpoint (vLLM, SGLang, llama.cpp's
server, Ollama, OpenAI itself): `rewards.names: [judge]` with the `rewards.judge` settings.

Each completion is one request to `<rewards.judge.url>/chat/completions`: a single user message,
`rewards.judge.prompt` with {question} (the prompt's last user turn), {completion} and {answer}
(the row's reference_answer) filled in. The reward is the last match of `rewards.judge.pattern`'s
one group in the judge's reply, as a float. A request that fails after its retries
(rewards/http_json.py), or a reply the pattern does not find a number in, fails that sample alone:
it gets rewards.fallback and is counted in rewards/judge/failures.
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from rewards.http_json import ServiceError, post_json

PLACEHOLDERS = ("question", "completion", "answer")
_PLACEHOLDER_RE = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


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
        self.settings, self.timeout_s, self.retries = settings, timeout_s, retries  # services.JudgeSettings
        self.endpoint = settings.url.rstrip("/") + "/chat/completions"
        self.pattern = re.compile(settings.pattern)

    def __call__(self, completions: list[str], rows: list[dict], prompts: list) -> list:
        with ThreadPoolExecutor(self.settings.concurrency) as pool:  # the server batches concurrent requests
            return list(pool.map(self.score, completions, rows, prompts))

    def request(self, completion: str, row: dict, turns) -> dict:
        """The chat completions request that judges one completion."""
        s = self.settings
        text = fill(s.prompt, {"question": question_of(turns), "completion": completion,
                               "answer": str(row.get("reference_answer") or "")})
        return {"model": s.model, "messages": [{"role": "user", "content": text}], "max_tokens": s.max_tokens,
                "temperature": s.temperature}

    def score(self, completion: str, row: dict, turns) -> float | ServiceError:
        """One completion's score, or the ServiceError that says why there is none (returned, not
        raised: the other samples of the batch keep theirs)."""
        try:
            answer = post_json(self.endpoint, self.request(completion, row, turns), self.timeout_s, self.retries,
                               self._headers())
        except ServiceError as e:
            return e
        except Exception as e:  # anything else of one request is that sample's failure, not the batch's
            return ServiceError(f"{type(e).__name__}: {e}")
        reply = _reply(answer)
        if reply is None:
            return ServiceError(f"{self.endpoint} answered {str(answer)[:120]!r}, not a chat completion")
        found = self.pattern.findall(reply)
        try:
            return float(found[-1])
        except (IndexError, ValueError):
            return ServiceError(f"the judge's reply {reply[:120]!r} has no number where rewards.judge.pattern "
                                f"{self.settings.pattern!r} looks")

    def _headers(self) -> dict:
        key = os.environ.get(self.settings.api_key_env, "") if self.settings.api_key_env else ""
        return {"Authorization": f"Bearer {key}"} if key else {}


def _reply(answer) -> str | None:
    """The text of a chat completion's first choice (None: not that shape)."""
    try:
        content = answer["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None
