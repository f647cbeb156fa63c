"""The GSM8K copy that ships with the project: the default data, loaded offline.

`data.path: gsm8k-embedded` names it (as `smollm2-135m-instruct` names the embedded model). The
rows are openai/gsm8k (config `main`, MIT, license in data/embedded/gsm8k/LICENSE), stored as
gzip JSONL. Each split's decompressed bytes are checked against a sha256 and its row count, so a
damaged or truncated copy is an error, not a silently shorter dataset.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import zlib
from pathlib import Path

EMBEDDED_GSM8K = "gsm8k-embedded"
EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded" / "gsm8k"
# split -> (sha256 of the decompressed JSONL, rows), as copied from openai/gsm8k
EMBEDDED_SPLITS = {
    "train": ("17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465", 7473),
    "test": ("3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14", 1319),
}


class EmbeddedDataError(ValueError):
    """The embedded copy is missing or damaged."""


def read_embedded_jsonl(split: str, folder: Path = EMBEDDED_DIR) -> bytes:
    """The verified JSONL bytes of one embedded split."""
    if split not in EMBEDDED_SPLITS:
        raise EmbeddedDataError(f"the embedded GSM8K has the splits {', '.join(EMBEDDED_SPLITS)}; "
                                f"got data.split={split!r}")
    path = folder / f"{split}.jsonl.gz"
    try:
        raw = gzip.decompress(path.read_bytes())
    except (OSError, EOFError, zlib.error) as e:
        raise EmbeddedDataError(f"the embedded GSM8K file {path} cannot be read ({e}); restore it with "
                                f"git checkout -- {path.name} or use data.path=/path/to/gsm8k") from None
    expected_sha, expected_rows = EMBEDDED_SPLITS[split]
    sha, rows = hashlib.sha256(raw).hexdigest(), raw.count(b"\n")
    if sha != expected_sha:
        raise EmbeddedDataError(f"the embedded GSM8K file {path} is damaged: sha256 {sha[:12]}..., expected "
                                f"{expected_sha[:12]}... ({rows} rows, expected {expected_rows}); restore it with "
                                f"git checkout or use data.path=/path/to/gsm8k")
    return raw


def embedded_rows(split: str, folder: Path = EMBEDDED_DIR) -> list[dict]:
    """The rows of one embedded split, in the dataset's order."""
    return [json.loads(line) for line in read_embedded_jsonl(split, folder).splitlines() if line.strip()]
