"""distill.teacher_url: the teacher behind an OpenAI-compatible server that returns prompt log-probs, as vLLM's
`/v1/completions` does with `prompt_logprobs` (a field vLLM adds to OpenAI's API; `vllm serve <teacher>`).

Each completion goes to the server after its prompt, as token ids (no text is re-tokenized), with max_tokens 1,
and the teacher's log-prob of every completion token is read off the answer's `prompt_logprobs`. vLLM computes
those from its raw logits, at temperature 1, so the config asks for sampling.temperature 1.0 with a served
teacher (the teacher loaded in the sampler is scored at the sampling temperature instead).

At start the server must serve the teacher's name with room for the longest row, and answer log-probs (not the
logits a server started with --logprobs-mode raw_logits sends). Every answer is checked, never trusted: one entry
per completion token holding that token's id and a log-prob in [LOGPROB_FLOOR, 0]. A server that gives no usable
answer after its retries stops the run with the reason: a batch cannot train without the teacher's log-probs.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
from collections.abc import Sequence

import torch

from grpo.rewards.http_json import ServiceError, post_json

log = logging.getLogger(__name__)

REQUEST_TOKENS = 16384  # token ids per request (a longer row alone): vLLM answers about 70 bytes a token
IN_FLIGHT = 4  # requests at once (the server batches them)
RETRIES = 8  # a refused connection or a 5xx is asked again after 0.5, 1, 2, ... 64 s: about 2 minutes
WAIT_NOTE_S = 10.0  # a longer wait is logged, naming the server
LOGPROB_SLACK = 1e-4  # a log-prob may round a little above 0; more is not a log-prob
# no model gives a token it can write a log-prob near this (logits span tens of nats); vLLM writes -9999 for -inf
LOGPROB_FLOOR = -1000.0
TOP_CHECKED = 5  # at start: the top 5 of each position, whose probabilities cannot sum past 1


class TeacherServerError(RuntimeError):
    """The teacher's server gave no usable answer: what it said, or what was wrong with the answer."""


class RemoteTeacher:
    """distill.teacher as served at distill.teacher_url under `model`: `completion_logprobs` gives the teacher's
    log-prob of each completion token, as the in-process teacher's forward does (at temperature 1)."""

    def __init__(self, url: str, model: str, timeout_s: float, api_key_env: str = ""):
        self.url, self.model, self.timeout_s = url.rstrip("/"), model, timeout_s
        self.endpoint = f"{self.url}/completions"
        key = os.environ.get(api_key_env, "") if api_key_env else ""
        if api_key_env and not key:
            raise TeacherServerError(f"distill.api_key_env={api_key_env}, but that environment variable is unset or "
                                     "empty: export the server's API key in it, or set distill.api_key_env ''")
        if not all(" " <= c <= "~" for c in key):  # what an HTTP header carries
            raise TeacherServerError(f"the API key in {api_key_env} holds a character an HTTP header cannot carry "
                                     "(a newline, a non-ASCII letter): copy it again")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def check(self, token_ids: Sequence[int], longest_row: int, decode=None) -> None:
        """Refused at start, naming the problem, unless the server serves self.model with room for `longest_row`
        tokens (and the one it must generate), and answers log-probs of `token_ids` (a few of the model's ids):
        not logits, and not nothing (a server that ignores `prompt_logprobs`: OpenAI's, most others). With
        `decode` (id -> text, the model's tokenizer), the server's text of each id it names must be the same."""
        answer = self._ask(f"{self.url}/models", None, "its model list")
        cards = answer.get("data") if isinstance(answer, dict) else None
        served = {c["id"]: c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)} \
            if isinstance(cards, list) else {}
        if self.model not in served:
            raise TeacherServerError(f"distill.teacher_url={self.url} serves {sorted(served)[:10] or 'no model'}, "
                                     f"not {self.model}: set distill.served_name to the name it serves the teacher "
                                     "under (vllm serve <path> serves it as <path>, or as --served-model-name)")
        room = served[self.model].get("max_model_len")
        if type(room) is int and room <= longest_row:
            raise TeacherServerError(f"distill.teacher_url={self.url} serves {self.model} with max_model_len={room}, "
                                     f"but a row (the longest prompt, data.max_prompt_tokens, and "
                                     f"sampling.max_new_tokens) may be {longest_row} tokens: start it with "
                                     f"--max-model-len {longest_row + 1} or more")
        answer = self._ask(self.endpoint, self._request([list(token_ids)], TOP_CHECKED), "a check of its log-probs")
        try:
            entries = [e for e in _choices(answer, 1)[0].get("prompt_logprobs") or [] if isinstance(e, dict)]
        except ValueError as e:
            raise TeacherServerError(f"distill.teacher_url={self.url}: {e}") from None
        for entry in entries:  # each the token's own and the top 5: no probabilities past 1 together
            values = [_logprob(v) for v in entry.values()]
            mass = sum(math.exp(min(v, 0.0)) for v in values if v is not None)
            if any(v is not None and v > LOGPROB_SLACK for v in values) or mass > 1 + 1e-3:
                raise TeacherServerError(f"distill.teacher_url={self.url} answers numbers that are not log-probs "
                                         f"(at one position {str(entry)[:200]}): start it without "
                                         "--logprobs-mode raw_logits or processed_logits")
        self._read(answer, [1], [list(token_ids[1:])])
        if decode is not None:
            self._check_tokens(entries, decode)

    def _check_tokens(self, entries: list[dict], decode) -> None:
        """The server's text of each token id it answered (vLLM's decoded_token) is the model tokenizer's: else
        it serves a model of another tokenizer, and its log-probs would be of other text."""
        for entry in entries:
            for token, value in entry.items():
                theirs = value.get("decoded_token") if isinstance(value, dict) else None
                if not isinstance(theirs, str) or not theirs.strip() or not token.isdigit():
                    continue  # a server that names no text: nothing to compare
                ours = decode(int(token))
                if "\ufffd" not in ours + theirs and ours.strip() != theirs.strip():
                    raise TeacherServerError(f"distill.teacher_url={self.url} serves {self.model} with another "
                                             f"tokenizer than the model's: token id {token} is {theirs!r} there, "
                                             f"{ours!r} here; serve a teacher of the model's tokenizer")

    def completion_logprobs(self, prompt_ids: Sequence[torch.Tensor], completion_ids: Sequence[torch.Tensor],
                            group_sizes: Sequence[int]) -> list[torch.Tensor]:
        """The teacher's log-prob of c_j[t] after prompt_i and c_j[:t], one float32 tensor [C_j] per completion
        (prompt-major, group_sizes[i] completions after prompt i, as completion_logprobs takes them)."""
        prompts = [p.tolist() for p, size in zip(prompt_ids, group_sizes) for _ in range(size)]
        completions = [c.tolist() for c in completion_ids]
        if len(prompts) != len(completions):
            raise ValueError(f"{len(completions)} completions for group sizes {list(group_sizes)}")
        pieces = _requests([len(p) + len(c) for p, c in zip(prompts, completions)], REQUEST_TOKENS)
        jobs = [([prompts[j] + completions[j] for j in rows], [len(prompts[j]) for j in rows],
                 [completions[j] for j in rows]) for rows in pieces]
        what = f"to score {len(completions)} completions ({sum(map(len, completions))} tokens)"
        scored = [logps for answer in self._in_flight(jobs, what) for logps in answer]
        out: list[torch.Tensor] = [torch.empty(0)] * len(completions)
        for j, logps in zip([j for rows in pieces for j in rows], scored):
            out[j] = torch.tensor(logps, dtype=torch.float32)
        return out

    def _in_flight(self, jobs: list[tuple], what: str) -> list[list[list[float]]]:
        """Each job's log-probs, IN_FLIGHT requests at a time. The first failure is raised at once: no further
        request starts, and those in flight are left to their daemon threads (each ends with its time limit)."""
        done: queue.Queue = queue.Queue()
        waiting, answers = iter(enumerate(jobs)), {}

        def work(i: int, job: tuple) -> None:
            try:
                done.put((i, True, self._score(*job)))
            except BaseException as e:  # handed to the caller
                done.put((i, False, e))

        def start_next() -> int:
            job = next(waiting, None)
            if job is not None:
                threading.Thread(target=work, args=job, name="teacher-server", daemon=True).start()
            return job is not None

        running = sum(start_next() for _ in range(IN_FLIGHT))
        noted = False
        while running:
            try:
                i, ok, value = done.get(timeout=None if noted else WAIT_NOTE_S)
            except queue.Empty:
                log.info("waiting for the teacher at %s %s (distill.timeout_s=%g a request)", self.url, what,
                         self.timeout_s)
                noted = True
                continue
            if not ok:
                raise value
            answers[i] = value
            running += start_next() - 1
        return [answers[i] for i in range(len(jobs))]

    def _request(self, sequences: list[list[int]], top: int = 0) -> dict:
        return {"model": self.model, "prompt": sequences, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": top}

    def _score(self, sequences: list[list[int]], prompt_lengths: list[int],
               completions: list[list[int]]) -> list[list[float]]:
        answer = self._ask(self.endpoint, self._request(sequences), f"the log-probs of {len(sequences)} sequences")
        return self._read(answer, prompt_lengths, completions)

    def _ask(self, url: str, payload, what: str):
        try:
            return post_json(url, payload, self.timeout_s, RETRIES, self.headers)
        except ServiceError as e:
            text = str(e)
            hint = ("; set distill.served_name to the name it serves the teacher under" if "does not exist" in text
                    else "; is it a vLLM server (vllm serve <teacher>), its URL ending in /v1?" if "HTTP 404" in text
                    else "")
            raise TeacherServerError(f"distill.teacher_url={self.url} gave {what} no answer: {e}{hint}") from None

    def _read(self, answer, prompt_lengths: list[int], completions: list[list[int]]) -> list[list[float]]:
        try:
            return answer_logprobs(answer, prompt_lengths, completions)
        except ValueError as e:
            raise TeacherServerError(f"distill.teacher_url={self.url}: {e}") from None


def answer_logprobs(answer, prompt_lengths: Sequence[int], completions: Sequence[Sequence[int]]) -> list[list[float]]:
    """Each completion's log-probs read off a `/v1/completions` answer with `prompt_logprobs` (vLLM's shape:
    per choice, one entry per prompt token, None for the first, else {"<token id>": {"logprob": x, ...}}).
    ValueError naming the first thing that is not so."""
    choices = _choices(answer, len(completions))
    return [_choice_logprobs(choices[i], prompt_lengths[i], completions[i], i) for i in range(len(completions))]


def _choices(answer, n: int) -> list[dict]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or len(choices) != n:
        raise ValueError(f"the answer has {len(choices) if isinstance(choices, list) else 'no'} choices for {n} "
                         "sequences")
    indices = [c.get("index") if isinstance(c, dict) else None for c in choices]
    if sorted(i for i in indices if type(i) is int) != list(range(n)):
        raise ValueError(f"the answer's choices are not indexed 0 .. {n - 1}")
    return [choices[indices.index(i)] for i in range(n)]


def _logprob(value) -> float | None:
    """An entry's {"logprob": x} as a float when x is a finite number (not a bool), else None."""
    logp = value.get("logprob") if isinstance(value, dict) else None
    if type(logp) not in (int, float):
        return None
    try:
        logp = float(logp)
    except OverflowError:  # an integer past a float's range
        return None
    return logp if math.isfinite(logp) else None


def _choice_logprobs(choice: dict, prompt_length: int, completion: Sequence[int], i: int) -> list[float]:
    entries = choice.get("prompt_logprobs")
    if not isinstance(entries, list):
        raise ValueError("the answer has no prompt_logprobs: the server does not return prompt log-probs (vLLM "
                         "does, with its OpenAI-compatible server)")
    if len(entries) != prompt_length + len(completion):
        raise ValueError(f"sequence {i}: {len(entries)} prompt log-probs for {prompt_length + len(completion)} tokens")
    logps = []
    for t, token in enumerate(completion):
        entry = entries[prompt_length + t]
        logp = _logprob(entry.get(str(token))) if isinstance(entry, dict) else None
        if logp is None or not LOGPROB_FLOOR <= logp <= LOGPROB_SLACK:
            raise ValueError(f"sequence {i}, completion token {t} (id {token}): no log-prob of that token in its "
                             f"entry, or not a number in [{LOGPROB_FLOOR:g}, 0] (vLLM writes -9999 for a token the "
                             f"teacher cannot produce): {str(entry)[:120]}")
        logps.append(min(logp, 0.0))
    return logps


def _requests(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """The rows in order, cut into requests of at most `budget` tokens (a longer row alone)."""
    pieces: list[list[int]] = []
    total = 0
    for j, n in enumerate(lengths):
        if not pieces or total + n > budget:
            pieces.append([])
            total = 0
        pieces[-1].append(j)
        total += n
    return pieces
