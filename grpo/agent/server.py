"""The sampler's OpenAI-compatible endpoint for agents in their own code: routes, keys, errors, streams.

One server per sampler, on loopback: `/s/<session>/v1/chat/completions` and `/s/<session>/v1/completions`
(streaming and not), `/v1/models` (also under a session), `/s/<session>/reward` and `/s/<session>/end`. The
session is an unguessable token in the path; a bearer key, when sent, must be the same token (an unknown one is
401, an ended session 409), and every error is OpenAI-shaped ({"error": {"message", "type", "code"}}), so the
`openai` SDK raises its own exceptions with our message.

What the model writes is the session's business (`Session.answer`): this module only checks what a request may
ask (grpo/agent/requests.py). A request the OpenAI SDK retries (its x-stainless-retry-count header) is handed to
the session as a retry: it gets the turn of the request it repeats, never a second sample. The run's sampling
settings are the behaviour policy's, so a request's temperature, top_p and the like are ignored, and the
`x-grpo-ignored` header names them; `n` above 1, `logit_bias`, `seed` and a JSON-schema `response_format` cannot
be honoured and are refused by name. A stream is generated whole, with keep-alive comments while it runs, then
written as a well-formed SSE stream (role, content, tool call deltas, the finish, usage when asked for, [DONE]).
"""

from __future__ import annotations

import json
import logging
import queue
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from grpo.agent.requests import AgentError, check_request

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20  # a request's JSON: a long agent history, far from what a sampler should hold
KEEPALIVE_S = 5.0  # an SSE comment this often while a streamed turn is generated
SOCKET_TIMEOUT_S = 120.0  # a connection that sends nothing this long is closed
ROUTE = re.compile(r"^/s/(?P<token>[A-Za-z0-9_-]{16,128})(?P<rest>/v1/chat/completions|/v1/completions|/v1/models|"
                   r"/reward|/end|/v1/reward|/v1/end)$")  # the last two: under the base URL too


REWARD_LOCK = threading.Lock()  # rewards are posted once a session, rarely: one lock for all


@dataclass
class Turn:
    """What the model wrote for one request."""

    text: str
    finish_reason: str  # stop, length, tool_calls
    prompt_tokens: int
    completion_tokens: int
    reasoning: str | None = None
    tool_calls: list[dict] = field(default_factory=list)  # OpenAI's shape: {id, type: function, function: {...}}

    def message(self) -> dict:
        """The assistant message the response carries, and the next request must repeat (bridge.py keeps it):
        the reasoning under both names clients read (vLLM's `reasoning`, the older `reasoning_content`)."""
        message = {"role": "assistant", "content": self.text or (None if self.tool_calls else "")}
        if self.reasoning is not None:
            message["reasoning"] = message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def retried(headers) -> bool:
    """The request says it is a retry of one sent before: the OpenAI SDKs' x-stainless-retry-count above 0."""
    count = headers.get("x-stainless-retry-count", "")
    return count.isdigit() and int(count) > 0


class Delivery:
    """Whether a response reached its client: set once by the request's handler (True after its last byte was
    written, False when a write failed: the client is gone), read by whoever produced the turn."""

    def __init__(self):
        self._done = threading.Event()
        self.ok = False

    def done(self, ok: bool) -> None:
        if not self._done.is_set():
            self.ok = ok
            self._done.set()

    def wait(self, timeout_s: float) -> bool:
        """True when the response was written whole within `timeout_s` (False: not yet, or it failed)."""
        return self._done.wait(timeout_s) and self.ok

    @property
    def failed(self) -> bool:
        return self._done.is_set() and not self.ok


@dataclass
class Session:
    """One harness's conversation: `answer(kind, body, delivery, retry) -> Turn` is given by the sampler (kind:
    "chat" or "completions"; blocks while the turn is generated; AgentError to refuse; `delivery`: a Delivery the
    handler sets once the response is written, or failed to be; `retry`: the request says it retries one)."""

    token: str
    answer: object
    on_end: object = None  # called once when the harness ends the session (POST /end): the conversation's end
    ended: bool = False
    reward: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # one request at a time per session


class Sessions:
    """The open sessions by token."""

    def __init__(self):
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()

    def open(self, answer, on_end=None) -> Session:
        session = Session(secrets.token_urlsafe(24), answer, on_end)
        with self._lock:
            self._sessions[session.token] = session
        return session

    def get(self, token: str) -> Session | None:
        with self._lock:
            return self._sessions.get(token)

    def forget(self, token: str) -> None:
        with self._lock:
            self._sessions.pop(token, None)


class _Server(ThreadingHTTPServer):
    request_queue_size = 1024  # a step's sessions connect at once (the stdlib's 5 would refuse some: the SDK retries)


class AgentServer:
    """The endpoint, served from a thread of its own until `close()`; `base_url(session)` is what a harness is
    given as OPENAI_BASE_URL."""

    def __init__(self, sessions: Sessions, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 keepalive_s: float = KEEPALIVE_S):
        self.sessions, self.model_name, self.keepalive_s = sessions, model_name, keepalive_s
        self._server = _Server((host, port), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="agent-endpoint", daemon=True)
        self._thread.start()
        self._ids = 0
        self._ids_lock = threading.Lock()

    def base_url(self, session: Session) -> str:
        return f"{self.url}/s/{session.token}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def next_id(self, prefix: str) -> str:
        with self._ids_lock:
            self._ids += 1
            return f"{prefix}-{self._ids}"

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "grpo"}]}


def chat_response(server: AgentServer, turn: Turn) -> dict:
    message = turn.message()
    return {"id": server.next_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": server.model_name, "choices": [{"index": 0, "message": message, "logprobs": None,
                                                     "finish_reason": turn.finish_reason}],
            "usage": _usage(turn)}


def completion_response(server: AgentServer, turn: Turn) -> dict:
    return {"id": server.next_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": server.model_name, "choices": [{"index": 0, "text": turn.text, "logprobs": None,
                                                     "finish_reason": turn.finish_reason}],
            "usage": _usage(turn)}


def chat_chunks(server: AgentServer, turn: Turn, usage: bool) -> list[dict]:
    """The turn as chat.completion.chunk events: the role, the reasoning, the content, each tool call (its
    id, name and arguments in one delta), the finish; then the usage when asked for."""
    head = {"id": server.next_id("chatcmpl"), "object": "chat.completion.chunk", "created": int(time.time()),
            "model": server.model_name}

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if turn.reasoning:
        chunks.append(chunk({"reasoning": turn.reasoning, "reasoning_content": turn.reasoning}))
    if turn.text:
        chunks.append(chunk({"content": turn.text}))
    for k, call in enumerate(turn.tool_calls):
        chunks.append(chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                             "function": dict(call["function"])}]}))
    chunks.append(chunk({}, turn.finish_reason))
    if usage:
        chunks.append({**head, "choices": [], "usage": _usage(turn)})
    return chunks


def completion_chunks(server: AgentServer, turn: Turn, usage: bool) -> list[dict]:
    head = {"id": server.next_id("cmpl"), "object": "text_completion", "created": int(time.time()),
            "model": server.model_name}
    chunks = [{**head, "choices": [{"index": 0, "text": turn.text, "logprobs": None, "finish_reason": None}]},
              {**head, "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": turn.finish_reason}]}]
    if usage:
        chunks.append({**head, "choices": [], "usage": _usage(turn)})
    return chunks


def _usage(turn: Turn) -> dict:
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": turn.completion_tokens,
            "total_tokens": turn.prompt_tokens + turn.completion_tokens}


class _Handler(BaseHTTPRequestHandler):
    """The endpoint's requests; `agent` is the AgentServer they are for (`_handler` sets it)."""

    agent: AgentServer
    protocol_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S  # an idle keep-alive connection, or a body that never comes, frees its thread

    def log_message(self, fmt, *args):
        log.debug("agent endpoint: " + fmt, *args)

    def do_GET(self):
        try:
            if self.path == "/v1/models":
                return self._json(200, self.agent.models())
            session, rest = self._session()
            if rest != "/v1/models":
                raise AgentError(405, f"GET {rest} is not served (POST it)")
            self._json(200, self.agent.models())
        except AgentError as e:
            self._json(e.status, e.body())

    def do_POST(self):
        try:
            session, rest = self._session()
            body = self._body()
            if rest == "/end":
                session.ended = True
                if session.on_end is not None:
                    session.on_end()
                return self._json(200, {"ended": True})
            if rest == "/reward":
                return self._json(200, self._reward(session, body))
            if rest == "/v1/models":
                raise AgentError(405, "POST /v1/models is not served (GET it)")
            kind = "chat" if rest == "/v1/chat/completions" else "completions"
            ignored = check_request(body, kind)
            retry = retried(self.headers)
            locked = session.lock.acquire(blocking=False)
            if not locked and not retry:  # a retry may join the request it retries (the conversation decides)
                raise AgentError(409, "this session is answering another request: one request at a time per "
                                      "session (each agent its own session)", kind="conflict")
            delivery = Delivery()
            if body.get("stream") is True:  # the answer's worker releases the session when it returns
                return self._stream(session, kind, body, ignored, delivery, retry, locked)
            try:
                turn = session.answer(kind, body, delivery, retry)
            finally:
                if locked:
                    session.lock.release()
            respond = chat_response if kind == "chat" else completion_response
            try:
                self._json(200, respond(self.agent, turn), ignored)
            except BaseException:  # the client is gone: the turn reached no one
                delivery.done(False)
                raise
            delivery.done(True)
        except AgentError as e:
            self.close_connection = True  # a body left unread must not be read as the next request
            self._json(e.status, e.body())

    def _session(self) -> tuple[Session, str]:
        match = ROUTE.match(self.path.split("?", 1)[0])
        if match is None:
            raise AgentError(404, f"no route {self.path}: a session's base URL is /s/<session>/v1",
                             kind="not_found_error")
        session = self.agent.sessions.get(match["token"])
        key = self.headers.get("Authorization", "")
        if session is None or (key and key.removeprefix("Bearer ").strip() != match["token"]):
            raise AgentError(401, "unknown session, or a key that is not the session's (the key is the "
                                  "session's token, as OPENAI_API_KEY gives it)", kind="authentication_error")
        rest = match["rest"]
        rest = rest.removeprefix("/v1") if rest in ("/v1/reward", "/v1/end") else rest
        if session.ended and rest != "/reward":  # a harness may end its session, then score it
            raise AgentError(409, "this session has ended", kind="conflict")
        return session, rest

    def _body(self):
        if self.headers.get("Transfer-Encoding"):
            raise AgentError(411, "send the request with a Content-Length, not chunked")
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit():
            raise AgentError(400, f"Content-Length {length!r} is not a byte count")
        if int(length) > MAX_BODY_BYTES:
            raise AgentError(413, f"the request is over {MAX_BODY_BYTES // 2**20} MiB")
        length = int(length)
        try:
            return json.loads(self.rfile.read(length) or b"{}")
        except (ValueError, RecursionError):
            raise AgentError(400, "the request body is not JSON") from None

    def _reward(self, session: Session, body) -> dict:
        reward = body.get("reward") if isinstance(body, dict) else None
        if type(reward) not in (int, float) or reward != reward or abs(reward) == float("inf"):
            raise AgentError(400, "reward must be a finite number: {\"reward\": 1.0}", code="reward")
        with REWARD_LOCK:  # two posts at once: one is first, the other sees it
            if session.reward is not None and session.reward != float(reward):  # the same again: a retried post
                raise AgentError(409, f"this session's reward was posted already ({session.reward:g}); a reward "
                                      "is posted once", kind="conflict", code="reward_posted")
            session.reward = float(reward)
        return {"reward": session.reward}

    def _stream(self, session: Session, kind: str, body: dict, ignored: list[str], delivery: Delivery, retry: bool,
                locked: bool) -> None:
        try:
            self._streamed(session, kind, body, ignored, delivery, retry, locked)
        except BaseException:  # the client is gone (mid-stream, or during a keep-alive): the turn reached no one
            delivery.done(False)
            raise
        delivery.done(True)

    def _streamed(self, session: Session, kind: str, body: dict, ignored: list[str], delivery: Delivery,
                  retry: bool, locked: bool) -> None:
        answers: queue.Queue = queue.Queue(maxsize=1)

        def work():
            try:
                answers.put((True, session.answer(kind, body, delivery, retry)))
            except BaseException as e:  # handed to the stream
                answers.put((False, e))
            finally:  # not before: a client gone mid-stream must not let a second request in meanwhile
                if locked:
                    session.lock.release()

        threading.Thread(target=work, name="agent-turn", daemon=True).start()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream's end is the connection's
        if ignored:
            self.send_header("x-grpo-ignored", ", ".join(ignored))
        self.end_headers()
        self.close_connection = True
        while True:
            try:
                ok, value = answers.get(timeout=self.agent.keepalive_s)
                break
            except queue.Empty:
                self._write(b": keep-alive\n\n")
        if not ok:
            error = value if isinstance(value, AgentError) else AgentError(500, f"{type(value).__name__}: {value}",
                                                                          kind="server_error")
            self._write(b"data: " + json.dumps(error.body()).encode() + b"\n\n")
        else:
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            chunks = (chat_chunks if kind == "chat" else completion_chunks)(self.agent, value, usage)
            for chunk in chunks:
                self._write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self._write(b"data: [DONE]\n\n")

    def _write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()

    def _json(self, status: int, payload, ignored: list[str] = ()) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if ignored:
            self.send_header("x-grpo-ignored", ", ".join(ignored))
        if status >= 400:  # the SDKs retry 409s and 5xx on their own: a refused turn is refused again
            self.send_header("x-should-retry", "false")
        self.end_headers()
        self.wfile.write(data)


def _handler(server: AgentServer) -> type:
    return type("Handler", (_Handler,), {"agent": server})
