"""One session's exchange between its harness and the sampler: the harness's HTTP requests in, the model's
turns out, each side waiting on the other with a time limit.

The HTTP side calls `answer(kind, body)` (grpo/agent/server.py's Session.answer): the request is queued with a
reply slot of its own, and the call waits for the model's turn in that slot. The sampler side takes the first
request (`first`), hands each turn back (`reply`: False when the request gave up waiting, so the turn reached no
one and must not be trained as served), and takes the next request as a continuation of what it served (`next`:
history.continuation), or learns that the harness went quiet (idle_timeout_s: the session ends) or ended it.
One request at a time: a second while one waits is refused, never queued for later.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter

from grpo.agent.history import CONTINUES, Continuation, continuation
from grpo.agent.server import AgentError, Turn

ENDED = "ended"  # the harness ended the session (or the sampler did: a limit, the step's end)
IDLE = "idle"  # the harness sent nothing for idle_timeout_s after a turn: the session ends
# how long a turn whose response could not be written waits for the client's retry to fetch it: the OpenAI SDK
# waits up to 8 s between tries
RETRY_GRACE_S = 10.0
MAX_RETRIES = 4  # of one request (the OpenAI SDK's default is 2)


class Pending:
    """One request's reply slot: the turn (or error) is given once, unless the request gave up first. Its retries
    (the same body again, marked as a retry) wait on the same slot, or read the turn it was given."""

    def __init__(self, kind: str = "", body: dict | None = None, delivery=None):
        self._lock = threading.Lock()
        self._given = threading.Event()
        self.kind, self.body = kind, body
        self.item = None
        self.cancelled = False
        self.retries = 0  # retries joined to it
        # server.Delivery of each response that carries the turn (the request's, its retries'): whether it reached
        # its client whole
        self.deliveries = [delivery] if delivery is not None else []

    def give(self, item) -> bool:
        with self._lock:
            if self.cancelled or self._given.is_set():
                return False
            self.item = item
            self._given.set()
            return True

    def wait(self, timeout_s: float, expired: AgentError) -> bool:
        """True once given; False when `timeout_s` passed first: the slot is then closed with `expired` (a later
        turn is not given to anyone; its retries waiting with it get `expired` too)."""
        if self._given.wait(timeout_s):
            return True
        with self._lock:
            if self._given.is_set():
                return True
            self.cancelled, self.item = True, expired
            self._given.set()
            return False

    @property
    def open(self) -> bool:
        return not self.cancelled and not self._given.is_set()


class Conversation:
    """`idle_timeout_s`: how long the sampler waits for the harness's next request after a turn;
    `turn_timeout_s`: how long a request waits for its turn (the generation, queued behind others)."""

    def __init__(self, idle_timeout_s: float, turn_timeout_s: float):
        self.idle_timeout_s, self.turn_timeout_s = idle_timeout_s, turn_timeout_s
        self._requests: queue.Queue = queue.Queue()  # harness -> sampler: (kind, body, Pending)
        self._lock = threading.Lock()
        self._waiting: Pending | None = None  # the request waiting for its turn, if any
        self._serving: Pending | None = None  # the one the sampler took and answers next
        self._ended = threading.Event()
        self.served: list[dict] = []  # the messages of the last request answered
        self.returned: dict | None = None  # the assistant message returned to it
        self.breaks: Counter = Counter()  # requests that did not continue the conversation, by reason
        self.requests = 0
        self.undelivered = 0  # turns whose request had given up waiting
        self.retries = 0  # requests answered with the turn of the request they retried

    # ------------------------------------------------------------------ the harness's side (HTTP threads)

    def answer(self, kind: str, body: dict, delivery=None, retry: bool = False) -> Turn:
        """The turn for this request (waits while it is generated); `retry`: the client says it sent this request
        before (the OpenAI SDK's retry header): with the same body as the last request, it waits for that
        request's turn, or is answered with it, and nothing is sampled for it."""
        with self._lock:
            if self._ended.is_set():
                raise AgentError(409, "this session has ended", kind="conflict")
            last = self._waiting
            if retry and last is not None and not last.cancelled and (last.kind, last.body) == (kind, body):
                if last.retries >= MAX_RETRIES:  # each waits on a thread of the sampler's: a few, not a flood
                    raise AgentError(409, f"this request was retried {MAX_RETRIES} times already", kind="conflict")
                last.retries += 1
                if delivery is not None:
                    last.deliveries.append(delivery)  # a retry: the same turn, on its own response
                self.retries += 1
                pending = last
            elif last is not None and last.open:
                raise AgentError(409, "this session has a request waiting already: one at a time",
                                 kind="conflict")
            else:
                pending = self._waiting = Pending(kind, body, delivery)
                self._requests.put((kind, body, pending))
        pending.wait(self.turn_timeout_s, AgentError(504, f"no turn within {self.turn_timeout_s:g} s "
                                                          "(agent.session_timeout_s)", kind="timeout"))
        if isinstance(pending.item, AgentError):
            raise pending.item
        return pending.item

    def end(self) -> None:
        """No further turn: a request waiting for one is refused (the harness's /end, a limit, the step's end)."""
        with self._lock:
            self._ended.set()
            waiting = self._waiting
        if waiting is not None:
            waiting.give(AgentError(409, "this session has ended", kind="conflict"))

    @property
    def ended(self) -> bool:
        return self._ended.is_set()

    # ------------------------------------------------------------------ the sampler's side

    def first(self, timeout_s: float, gone=None) -> tuple[str, dict] | str:
        """The harness's first request (kind, body), or ENDED / IDLE (`gone()` true: the harness returned)."""
        return self._take(timeout_s, gone)

    def reply(self, turn: Turn, served: list[dict], returned: dict) -> bool:
        """The model's turn for the request taken last, whose messages were `served`; `returned`: the assistant
        message as the response carries it (what the next request must repeat). False: that request had given
        up (or the session ended), the turn reached no one, and nothing is recorded as served."""
        if self._serving is None or not self._serving.give(turn):
            self.undelivered += 1
            return False
        self.served, self.returned = list(served), returned
        return True

    def delivered(self, timeout_s: float) -> bool:
        """Whether a response with the turn given last (`reply`) reached its client whole: the request's, or a
        retry's (waits for the writes, at most `timeout_s`; after every write failed, RETRY_GRACE_S more for a
        retry); True where the request came without a way to tell."""
        pending = self._serving
        if pending is None or not pending.deliveries:
            return True
        deadline, failed_since = time.monotonic() + timeout_s, None
        while True:
            deliveries = list(pending.deliveries)
            if any(d.ok for d in deliveries):
                return True
            now = time.monotonic()
            if self._ended.is_set():  # the harness's /end may come before its handler is done: a second more
                deadline = min(deadline, now + 1.0)
            failed_since = (failed_since or now) if all(d.failed for d in deliveries) else None
            if now >= deadline or (failed_since is not None and now - failed_since >= RETRY_GRACE_S):
                self.undelivered += 1
                return False
            deliveries[-1].wait(0.05)  # the write takes a moment

    def refuse(self, error: AgentError) -> None:
        """The request taken last gets `error` instead of a turn (its messages cannot be continued, say)."""
        if self._serving is not None:
            self._serving.give(error)

    def next(self, gone=None) -> tuple[str, dict, Continuation] | str:
        """The harness's next request (kind, body, how it continues what was served), or ENDED / IDLE when none
        comes within idle_timeout_s, or once `gone()` (the harness returned). A request that does not continue
        it is counted in `breaks`."""
        taken = self._take(self.idle_timeout_s, gone)
        if isinstance(taken, str):
            return taken
        kind, body = taken
        found = continuation(self.served, self.returned or {}, history_of(body))
        if found.kind != CONTINUES:
            self.breaks[found.kind] += 1
        return kind, body, found

    def _take(self, timeout_s: float, gone=None):
        deadline = time.monotonic() + timeout_s
        while not self._ended.is_set():
            over = gone is not None and gone()  # read before the queue: a request it made before returning is taken
            try:
                kind, body, pending = self._requests.get(timeout=min(0.02, max(deadline - time.monotonic(), 0.0)))
            except queue.Empty:
                if over:
                    self.end()
                    return ENDED
                if time.monotonic() >= deadline:
                    self.end()  # a request that comes later is told the session ended, not left to time out
                    return IDLE
                continue
            if not pending.open:  # it gave up before the sampler came to it
                continue
            self._serving = pending
            self.requests += 1
            return kind, body
        return ENDED


def continues_final(body: dict) -> bool:
    """The request asks the model to go on with its last message, an assistant turn begun by the harness (vLLM's
    continue_final_message): a prefill, which is not part of the history to compare."""
    return body.get("continue_final_message") is True and isinstance(body.get("messages"), list)


def history_of(body: dict) -> list[dict]:
    """The request's messages as the history to compare with what was served: less a final assistant prefill."""
    messages = body.get("messages") or []
    return messages[:-1] if continues_final(body) else messages
