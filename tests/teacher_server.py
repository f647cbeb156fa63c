"""A teacher server for the tests without vLLM: a real HTTP server on loopback that answers `GET /v1/models` and
`POST /v1/completions` with `prompt_logprobs` in vLLM's shape (tests/test_vllm_server.py checks the same client
against vLLM itself), from a real model's one-sequence forward at temperature 1. `answer(reply, n)` replaces the
n-th completions answer (n from 1) to make it hostile; `delay_s` makes the server slow; `fail_first` answers its
first requests 503, `fail_after` every request after that many; `decode(id)` is each token's decoded_token;
`models` replaces the model list."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def prompt_logprobs(model, ids: list[int], top: int = 0, decode=None) -> list:
    """vLLM's prompt_logprobs of one sequence: None, then per token {"<id>": {"logprob", "rank",
    "decoded_token"}} for the token itself and the `top` likeliest (decoded_token: `decode(id)`, or "")."""
    with torch.no_grad():
        logps = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [L, V]
    entries: list = [None]
    for t in range(1, len(ids)):
        row = logps[t - 1]
        ranks = row.argsort(descending=True)
        chosen = [ids[t], *ranks[:top].tolist()]
        entries.append({str(k): {"logprob": row[k].item(), "rank": int((row > row[k]).sum()) + 1,
                                 "decoded_token": decode(k) if decode else ""} for k in chosen})
    return entries


@contextlib.contextmanager
def serve_teacher(model, name: str = "teacher", answer=None, delay_s: float = 0.0, fail_first: int = 0,
                  fail_after: int | None = None, max_model_len: int = 2048, decode=None, models=None):
    """(the server's base URL, ending in /v1; the list of the completions request bodies it was sent) while the
    block runs."""
    requests: list[dict] = []
    failures = {"left": fail_first}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            if self.path != "/v1/models":
                return self._send(404, {"detail": "Not Found"})
            self._send(200, models if models is not None else
                       {"object": "list", "data": [{"id": name, "object": "model", "max_model_len": max_model_len}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                requests.append(body)
                n = len(requests)
                failing = failures["left"] > 0 or (fail_after is not None and n > fail_after)
                failures["left"] -= failures["left"] > 0
            time.sleep(delay_s)
            if failing:
                return self._send(503, {"error": {"message": "overloaded", "type": "ServiceUnavailable"}})
            if self.path != "/v1/completions":
                return self._send(404, {"detail": "Not Found"})
            if body.get("model") != name:
                return self._send(404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                  "type": "NotFoundError", "code": 404}})
            with lock:  # one forward at a time: the model is shared
                choices = [{"index": i, "text": "",
                            "prompt_logprobs": prompt_logprobs(model, ids, body["prompt_logprobs"], decode)}
                           for i, ids in enumerate(body["prompt"])]
            reply = {"object": "text_completion", "model": name, "choices": choices}
            self._send(200, answer(reply, n) if answer else reply)

        def _send(self, status: int, payload) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1", requests
    finally:
        server.shutdown()
        server.server_close()
