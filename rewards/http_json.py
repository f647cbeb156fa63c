"""POST JSON, get JSON: the one HTTP path of the remote rewards (rewards/remote.py) and the judge
(rewards/judge.py), with a time limit, retries with exponential backoff (or the wait a 429/503's
Retry-After asks for, up to the time limit), a circuit breaker, and an error that says why.

The breaker is what bounds a dead service: a judge scores each sample with its own request, so
retries alone would let a hung judge cost each sample its time limit (512 samples, 8 at a time,
3 attempts of 30 s: 98 minutes a step). After enough failures in a row (each request in flight
failing twice) it opens: every call fails at once for BREAKER_COOLDOWN_S, then the next calls try again.

stdlib urllib (it honours http_proxy / https_proxy / no_proxy as requests does). The answer is
parsed as JSON, nothing else: a service can send numbers, never code.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import math
import queue
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

BACKOFF_S = 0.5  # the first retry waits this long, each later one twice as long as the one before
MAX_ANSWER_BYTES = 16 * 2**20  # 16 MiB: far more than a batch of scores or a judge's verdict
RETRIED_STATUSES = {408, 425, 429, 500, 502, 503, 504}  # the server may answer next time; other 4xx will not
# the server is up and asks us to slow down: honoured; a failure for the breaker only once retries are spent
RATE_LIMITED = 429
BREAKER_COOLDOWN_S = 30.0  # an open breaker fails calls at once this long: the rest of a batch, not the next step


class ServiceError(RuntimeError):
    """A service that gave no usable answer (after its retries, where a retry could help)."""


class Unreachable(ServiceError):
    """The service could not be asked: no connection, no answer in time, an HTTP 5xx, an answer that
    is not JSON, its breaker open. For a whole batch not the completions' doing: they are left out;
    for one sample while others were answered, that sample's failure (rewards/registry.py)."""


class BreakerOpen(Unreachable):
    """The service failed often enough in a row that it is not called for a while: nobody was asked."""


class _Transient(Unreachable):
    """A failure that a retry may cure: no connection, no answer in time, a 5xx or 429 (with the
    seconds its Retry-After header asked to wait, if any)."""

    def __init__(self, message: str, retry_after_s: float | None = None, status: int | None = None):
        super().__init__(message)
        self.retry_after_s, self.status = retry_after_s, status


class Breaker:
    """A circuit breaker over one service's calls, shared by the threads that call it: after
    `failures_to_open` failed attempts in a row (no answer in time, no connection, a 5xx) it is open
    for `cooldown_s`, and calls fail at once; then it lets calls through again, and one more failure
    opens it again. Any answer closes it."""

    def __init__(self, failures_to_open: int, cooldown_s: float = BREAKER_COOLDOWN_S):
        self.failures_to_open, self.cooldown_s = failures_to_open, cooldown_s
        self._lock = threading.Lock()
        self._failures, self._open_until, self._why = 0, 0.0, ""

    def check(self, url: str) -> None:
        """Unreachable, at once, while the breaker is open."""
        with self._lock:
            wait = self._open_until - time.monotonic()
            if wait > 0:
                raise BreakerOpen(f"{url} failed {self._failures} times in a row ({self._why}); not called again "
                                  f"for {wait:.0f} s")

    def failed(self, why: str) -> None:
        with self._lock:
            self._failures += 1
            self._why = why
            if self._failures >= self.failures_to_open:
                self._open_until = time.monotonic() + self.cooldown_s

    def answered(self) -> None:
        with self._lock:
            self._failures, self._open_until = 0, 0.0


def post_json(url: str, payload, timeout_s: float, retries: int, headers: dict | None = None,
              breaker: Breaker | None = None):
    """The JSON answer to POSTing `payload` to `url` (a GET with payload None). Each attempt must
    connect and answer whole within `timeout_s` (a server that trickles its answer is cut off);
    a transient failure is tried again `retries` times, waiting BACKOFF_S, 2 x BACKOFF_S, ...
    between attempts, or what a Retry-After header asks for when longer (up to `timeout_s`: a
    server that wants a longer pause is down for this batch). With `breaker`, no attempt is made
    while it is open. Unreachable when no attempt gave a JSON answer; ServiceError when the server
    refused the request (HTTP 4xx: what it carried, not the server, is at fault)."""
    body = None if payload is None else json.dumps(payload).encode()
    breaker = breaker or Breaker(math.inf)  # a breaker of its own never opens: only this call's retries
    wait_s = 0.0
    for attempt in range(retries + 1):
        time.sleep(wait_s)
        breaker.check(url)
        try:
            answer = _within(timeout_s, _post_once, url, body, timeout_s, headers or {})
        except _Transient as e:
            if e.status == RATE_LIMITED and attempt < retries:  # it answered: up, and busy
                breaker.answered()
            else:  # down, or still busy after every retry: a batch of such calls opens the breaker
                breaker.failed(str(e))
            if attempt == retries:
                raise Unreachable(f"{e} ({retries + 1} attempt{'s' if retries else ''})") from None
            wait_s = max(BACKOFF_S * 2 ** attempt, min(e.retry_after_s or 0.0, timeout_s))
            log.info("%s; retrying in %.1f s", e, wait_s)
            continue
        except ServiceError:  # it answered, wrongly: the service is there
            breaker.answered()
            raise
        breaker.answered()
        return answer


def _within(timeout_s: float, fn, *args):
    """fn(*args) in a thread of its own, waited for `timeout_s` (and a second): a socket's timeout
    bounds each read, not a server that trickles its headers or body a byte at a time; such an
    attempt is left behind (its thread dies with its socket's next timeout) and counted as one that
    timed out."""
    answers: queue.Queue = queue.Queue(maxsize=1)

    def run():
        try:
            answers.put((True, fn(*args)))
        except BaseException as e:  # handed to the caller
            answers.put((False, e))

    threading.Thread(target=run, name="reward-service-call", daemon=True).start()
    try:
        ok, value = answers.get(timeout=timeout_s + 1.0)
    except queue.Empty:
        raise _Transient(f"{args[0]} gave no whole answer within {timeout_s:g} s") from None
    if not ok:
        raise value
    return value


def _post_once(url: str, body: bytes | None, timeout_s: float, headers: dict):
    request = urllib.request.Request(url, data=body, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json", **headers})
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = _read_until(response, deadline, url, timeout_s)
    except urllib.error.HTTPError as e:
        error = f"{url} answered HTTP {e.code}: {_excerpt(e)}"
        if e.code in RETRIED_STATUSES:
            raise _Transient(error, retry_after(e.headers.get("Retry-After")), e.code) from None
        if 400 <= e.code < 500:  # the request, the completion in it, was refused (too long, not allowed)
            raise ServiceError(error) from None
        raise Unreachable(error) from None
    except urllib.error.URLError as e:  # refused, unknown host, a timeout while connecting
        raise _Transient(f"{url} cannot be reached: {e.reason}") from None
    except (OSError, http.client.HTTPException) as e:  # a timeout, a reset, a TLS error while reading
        raise _Transient(f"{url} gave no whole answer within {timeout_s:g} s ({type(e).__name__}: {e})") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: JSON nested deeper than Python's stack
        raise Unreachable(f"{url} answered with something that is not JSON: {raw[:120]!r}") from None


def _read_until(response, deadline: float, url: str, timeout_s: float) -> bytes:
    chunks, size = [], 0
    while chunk := response.read(65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise Unreachable(f"{url} answered more than {MAX_ANSWER_BYTES // 2**20} MiB")
        if time.monotonic() > deadline:
            raise _Transient(f"{url} gave no whole answer within {timeout_s:g} s")
    return b"".join(chunks)


def retry_after(value: str | None, now: float | None = None) -> float | None:
    """The seconds a Retry-After header asks to wait: a number of seconds or an HTTP date (None: no
    header, or one that is neither)."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _excerpt(error: urllib.error.HTTPError) -> str:
    try:
        return error.read(200).decode(errors="replace").strip() or error.reason
    except Exception:  # the body of an error page is only for the message
        return str(error.reason)
