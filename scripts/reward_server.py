"""An example reward service: scores completions with the built-in gsm8k_answer over HTTP (stdlib
only; what a remote reward must answer is in rewards/remote.py).

    .venv/bin/python scripts/reward_server.py --port 8123 &
    make train ARGS="rewards.names=[http://127.0.0.1:8123/score,think_answer_format_partial]"

POST /score  {"prompts": [...], "completions": [...], "rows": [{"reference_answer": ...}, ...]}
          -> [1.0, -1.0, ...]  (null for a row without a reference answer)
GET /health -> "ok" (for a script that waits for the server to be up)

It listens on 127.0.0.1 unless told otherwise (--host): it runs math-verify on whatever it is
sent, so it is not for the open internet.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.rewards.gsm8k_answer import gsm8k_answer  # noqa: E402

MAX_REQUEST_BYTES = 64 * 2**20  # a batch of completions is megabytes at most


def scores(request: dict) -> list[float | None]:
    """gsm8k_answer of each completion against its row's reference answer."""
    completions, rows = request["completions"], request["rows"]
    if len(completions) != len(rows):
        raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
    return [gsm8k_answer(c, str(r["reference_answer"])) if "reference_answer" in r else None
            for c, r in zip(completions, rows)]


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self._answer(200, "ok")
        else:
            self._answer(404, {"error": f"no {self.path}; POST /score"})

    def do_POST(self):
        if self.path != "/score":
            return self._answer(404, {"error": f"no {self.path}; POST /score"})
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_REQUEST_BYTES:
            return self._answer(413, {"error": f"more than {MAX_REQUEST_BYTES} bytes"})
        try:
            self._answer(200, scores(json.loads(self.rfile.read(length))))
        except (ValueError, KeyError, TypeError) as e:  # a bad request is the client's error, not the server's end
            self._answer(400, {"error": f"{type(e).__name__}: {e}"})

    def _answer(self, status: int, body) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):  # one line per request at INFO, not stderr noise
        logging.getLogger("reward_server").info(format, *args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8123)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # math-verify warns on every call outside the main thread that its alarm timeout is off
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    logging.info("scoring with gsm8k_answer on http://%s:%d/score", args.host, server.server_port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
