"""A reward served over HTTP, named by its URL in `rewards.names` (`http://host:port/score`).

One POST per batch (all B x G completions of a round), as JSON:

    {"prompts": [[{"role": ..., "content": ...}, ...], ...],   # each sample's prompt, as chat turns
     "completions": ["...", ...],
     "rows": [{"reference_answer": ..., <the dataset row's columns>}, ...]}

and the answer is a JSON list with one number (or null: does not apply) per completion, or an
object holding that list under "rewards" (OpenRLHF's `remote_rm_url` answer). Failures are
rewards/http_json.py's: a time limit, retries with backoff, a breaker; then the whole batch fails
(rewards.on_failure). A service that answers null for every sample of a batch gives no signal:
that is warned of once. scripts/reward_server.py is an example server.
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from grpo.rewards.http_json import Breaker, ServiceError, post_json

log = logging.getLogger(__name__)

SCHEMES = ("http://", "https://")


def is_url(name: str) -> bool:
    """A name that means a URL: it starts with a scheme of ours, or says it is one and is mistyped."""
    return name.startswith(SCHEMES) or name.split("/", 1)[0].lower() in ("http:", "https:") or "://" in name


def url_problem(url: str) -> str | None:
    """Why `url` cannot be a reward service's address, or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not url.startswith(SCHEMES):
        return f"{url!r} is not an http:// or https:// URL"
    try:
        port = parts.port
    except ValueError:
        return f"{url!r} has a port that is not a number in 0-65535"
    if not parts.hostname:
        return f"{url!r} names no host (http://host:port/path)"
    return None if port != 0 else f"{url!r} has port 0"


class RemoteReward:
    """fn(completions, rows, prompts) -> one float or None per completion, from the service at `url`."""

    service = True  # rewards/services.py: runs in the sampler, gets the prompts, scores the batch at once

    def __init__(self, url: str, timeout_s: float, retries: int):
        self.url, self.timeout_s, self.retries = url, timeout_s, retries
        # one request per batch: once every attempt of one failed (twice at least), it rests
        self.breaker = Breaker(max(2, retries + 1))
        self.warned_all_null = False

    def __call__(self, completions: list[str], rows: list[dict], prompts: list) -> list[float | None]:
        answer = post_json(self.url, {"prompts": [list(p) for p in prompts], "completions": list(completions),
                                      "rows": list(rows)}, self.timeout_s, self.retries, breaker=self.breaker)
        values = answer.get("rewards") if isinstance(answer, dict) else answer
        if not isinstance(values, list):
            raise ServiceError(f"{self.url} answered {_shown(answer)}; "
                               "expected a JSON list of numbers, one per completion")
        if len(values) != len(completions):
            raise ServiceError(f"{self.url} answered {len(values)} values for {len(completions)} completions")
        wrong = [v for v in values if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))]
        if wrong:
            raise ServiceError(f"{self.url} answered {_shown(wrong[0])} among its values; expected numbers or null")
        if values and all(v is None for v in values):
            self.warn_all_null(len(values))
        return values

    def warn_all_null(self, count: int) -> None:
        """Once per run: a service that says "does not apply" to every sample trains nothing."""
        if not self.warned_all_null:
            self.warned_all_null = True
            log.warning("reward %s answered null (does not apply) for all %d samples of a batch: it gives no "
                        "signal. Check that it reads the request's fields (prompts, completions, rows) and that "
                        "its rows are the ones it scores (said once per run)", self.url, count)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
