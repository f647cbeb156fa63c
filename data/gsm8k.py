"""GSM8K rows from the embedded copy (the default), the Hub (`openai/gsm8k`, config `main`) or a local folder.

`data.path: gsm8k-embedded` is the copy inside the project (data/embedded.py). A local folder
holds `<split>.jsonl` or `<split>.parquet` (or `<split>-*.parquet`, the Hub's layout) with the
fields `question` and `answer`; the final answer follows `####`.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from data.embedded import EMBEDDED_GSM8K, EmbeddedDataError, embedded_rows
from grpo.sources import HUB_ID_RE, SourceError, hub_offline_by_request, hub_unreachable_reason

log = logging.getLogger(__name__)

HUB_CONFIG = "main"


class DataError(SourceError, ValueError):
    """A dataset that cannot be loaded at all (missing, empty, damaged, offline)."""


@dataclass(frozen=True)
class Problem:
    id: str  # "<split>-<row index>", stable across runs
    question: str
    answer: str  # the final number, commas removed (e.g. "1234")
    reasoning: str = ""  # the worked solution before '####', calculator notes removed (few-shot examples)


@dataclass
class LoadStats:
    rows: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def parse_final_answer(solution: str) -> str | None:
    """The number after '####' with commas removed ('#### 1,234' -> '1234'), or None."""
    if not isinstance(solution, str) or "####" not in solution:
        return None
    text = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return text if _is_number(text) else None


def _is_number(text: str) -> bool:
    """One finite number, '$' and a closing period allowed (as the answer rewards read it)."""
    try:
        return Decimal(text.replace("$", "").rstrip(".")).is_finite()
    except InvalidOperation:
        return False


CALCULATOR_NOTE_RE = re.compile(r"<<[^<>]*>>")


def solution_reasoning(solution: str) -> str:
    """GSM8K's worked solution without its '#### N' line and its '<<48/2=24>>' calculator notes."""
    return CALCULATOR_NOTE_RE.sub("", solution.rsplit("####", 1)[0]).strip()


def parse_rows(raw_rows, split: str, stats: LoadStats) -> list[Problem]:
    """Turn raw dict rows into Problems; a bad row is skipped and counted by reason."""
    problems = []
    for i, row in enumerate(raw_rows):
        stats.rows += 1
        if not isinstance(row, dict):
            stats.skip("not an object")
            continue
        question, solution = row.get("question"), row.get("answer")
        if not isinstance(question, str) or not question.strip():
            stats.skip("missing question")
            continue
        if not isinstance(solution, str):
            stats.skip("missing answer")
            continue
        final = parse_final_answer(solution)
        if final is None:
            stats.skip("non-numeric answer")
            continue
        problems.append(Problem(f"{split}-{i}", question.strip(), final, solution_reasoning(solution)))
    return problems


def _read_jsonl(path: Path, stats: LoadStats) -> list:
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                rows.append(None)  # keeps row indices stable; counted as "not an object"
    return rows


def _local_files(folder: Path, split: str) -> list[Path]:
    for pattern in (f"{split}.jsonl", f"{split}.parquet", f"{split}-*.parquet", f"*/{split}-*.parquet"):
        found = sorted(folder.glob(pattern))
        if found:
            return found
    return []


def _require_local_files(folder: Path, split: str) -> list[Path]:
    files = _local_files(folder, split)
    if not files:
        raise DataError(f"{folder} has no {split}.jsonl or {split}.parquet; "
                        "a local GSM8K folder needs train.jsonl and test.jsonl (fields question, answer)")
    return files


def _read_local(folder: Path, split: str, stats: LoadStats) -> list:
    files = _require_local_files(folder, split)
    if files[0].suffix == ".jsonl":
        return _read_jsonl(files[0], stats)
    import datasets

    return list(datasets.load_dataset("parquet", data_files=[str(f) for f in files], split="train"))


def _hub_unreachable_error(name: str, reason: str) -> DataError:
    return DataError(f"data.path={name!r} is a Hugging Face Hub id and the Hub cannot be reached ({reason}); use the "
                     f"embedded copy (data.path={EMBEDDED_GSM8K}) or a local folder (data.path=/path/to/folder with "
                     "train.jsonl and test.jsonl)")


def check_hub_dataset(name: str) -> str | None:
    """A one-line `DataError` now, rather than a minute of retries, for a Hub id the Hub cannot serve.
    Returns why the Hub is unreachable when the user asked for offline mode (the cache may have it)."""
    if not HUB_ID_RE.match(name):
        raise DataError(f"data.path={name!r} is not a folder, a Hub dataset id (org/name) or {EMBEDDED_GSM8K}")
    reason = hub_unreachable_reason()
    if reason is not None and not hub_offline_by_request():
        raise _hub_unreachable_error(name, reason)
    return reason


def _read_hub(name: str, split: str) -> list:
    offline_reason = check_hub_dataset(name)
    import datasets

    try:
        return list(datasets.load_dataset(name, HUB_CONFIG, split=split))
    except Exception as e:
        if offline_reason is not None:  # HF_HUB_OFFLINE and not in the cache
            raise _hub_unreachable_error(name, f"{offline_reason} and it is not in the local cache") from None
        raise DataError(f"could not load data.path={name!r} (config '{HUB_CONFIG}', split '{split}') from the Hugging "
                        f"Face Hub: {type(e).__name__}: {str(e)[:200]}") from None


def _read_embedded(split: str) -> list:
    try:
        return embedded_rows(split)
    except EmbeddedDataError as e:
        raise DataError(str(e)) from None


def _read_rows(path: str, split: str, stats: LoadStats) -> list:
    if path == EMBEDDED_GSM8K:
        return _read_embedded(split)
    folder = Path(path).expanduser()
    return _read_local(folder, split, stats) if folder.is_dir() else _read_hub(path, split)


def check_source(path: str, split: str) -> None:
    """Fail now, in one line, if the data cannot be had (the launcher calls this before starting)."""
    if path == EMBEDDED_GSM8K:
        _read_embedded(split)
    elif Path(path).expanduser().is_dir():
        _require_local_files(Path(path).expanduser(), split)
    else:
        check_hub_dataset(path)


def load_problems(path: str, split: str) -> tuple[list[Problem], LoadStats]:
    """All usable problems of a split, and what was skipped."""
    stats = LoadStats()
    raw = _read_rows(path, split, stats)
    problems = parse_rows(raw, split, stats)
    if stats.skipped:
        log.warning("%s/%s: skipped %d of %d rows: %s", path, split, sum(stats.skipped.values()),
                    stats.rows, stats.skipped)
    if not problems:
        raise DataError(f"{path} split '{split}' has no usable rows ({stats.rows} read, skipped: {stats.skipped})")
    return problems, stats
