"""POST JSON, get JSON: the one HTTP path of the remote rewards (rewards/remote.py) and the judge
(rewards/judge.py), with a time limit, retries with exponential backoff, and an error that says why.

stdlib urllib (it honours http_proxy / https_proxy / no_proxy as requests does). The answer is
parsed as JSON, nothing else: a service can send numbers, never code.
"""

from __future__ import annotations

import http.client
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request

log = logging.getLogger(__name__)

BACKOFF_S = 0.5  # the first retry waits this long, each later one twice as long as the one before
MAX_ANSWER_BYTES = 16 * 2**20  # 16 MiB: far more than a batch of scores or a judge's verdict
RETRIED_STATUSES = {408, 425, 429, 500, 502, 503, 504}  # the server may answer next time; other 4xx will not


class ServiceError(RuntimeError):
    """A service that gave no usable answer (after its retries, where a retry could help)."""


class _Transient(ServiceError):
    """A failure that a retry may cure: no connection, no answer in time, a 5xx or 429."""


def post_json(url: str, payload, timeout_s: float, retries: int, headers: dict | None = None):
    """The JSON answer to POSTing `payload` to `url`. Each attempt must connect and answer whole
    within `timeout_s` (a server that trickles its answer is cut off);
    a transient failure is tried again `retries` times, waiting BACKOFF_S, 2 x BACKOFF_S, ...
    between attempts. ServiceError when no attempt gave a JSON answer."""
    body = json.dumps(payload).encode()
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        try:
            return _within(timeout_s, _post_once, url, body, timeout_s, headers or {})
        except _Transient as e:
            if attempt == retries:
                raise ServiceError(f"{e} ({retries + 1} attempt{'s' if retries else ''})") from None
            log.info("%s; retrying", e)


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


def _post_once(url: str, body: bytes, timeout_s: float, headers: dict):
    request = urllib.request.Request(url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", **headers})
    deadline = time.monotonic() + timeout_s
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            raw = _read_until(response, deadline, url, timeout_s)
    except urllib.error.HTTPError as e:
        error = f"{url} answered HTTP {e.code}: {_excerpt(e)}"
        raise (_Transient if e.code in RETRIED_STATUSES else ServiceError)(error) from None
    except urllib.error.URLError as e:  # refused, unknown host, a timeout while connecting
        raise _Transient(f"{url} cannot be reached: {e.reason}") from None
    except (OSError, http.client.HTTPException) as e:  # a timeout, a reset, a TLS error while reading
        raise _Transient(f"{url} gave no whole answer within {timeout_s:g} s ({type(e).__name__}: {e})") from None
    try:
        return json.loads(raw)
    except ValueError:
        raise ServiceError(f"{url} answered with something that is not JSON: {raw[:120]!r}") from None


def _read_until(response, deadline: float, url: str, timeout_s: float) -> bytes:
    chunks, size = [], 0
    while chunk := response.read(65536):
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise ServiceError(f"{url} answered more than {MAX_ANSWER_BYTES // 2**20} MiB")
        if time.monotonic() > deadline:
            raise _Transient(f"{url} gave no whole answer within {timeout_s:g} s")
    return b"".join(chunks)


def _excerpt(error: urllib.error.HTTPError) -> str:
    try:
        return error.read(200).decode(errors="replace").strip() or error.reason
    except Exception:  # the body of an error page is only for the message
        return str(error.reason)
