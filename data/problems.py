"""Prompt/answer rows: GSM8K from the embedded copy (the default), or any dataset from the Hub or a local folder.

`data.path: gsm8k-embedded` is the copy inside the project (data/embedded.py). A local folder
holds `<split>.jsonl` or `<split>.parquet` (or `<split>-*.parquet`, the Hub's layout). The
columns are configurable (`Columns`): the prompt is plain text or a list of chat messages; the
reference answer is GSM8K's (the number after `####`) or the column's text as it is. A row
without a usable prompt or answer is skipped and counted; a column no row has is an error.
Every row keeps its JSON columns (`Problem.row`), which user reward functions receive.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from grpo.common.sources import HUB_ID_RE, SourceError, hub_offline_by_request, hub_unreachable_reason
from grpo.common.verifiers_bridge import VerifiersError, env_of, env_rows, is_verifiers
from grpo.data.code_tasks import code_task_rows, is_code_tasks
from grpo.data.embedded import EMBEDDED_GSM8K, EmbeddedDataError, embedded_rows
from grpo.data.images import image_sizes, read_images
from grpo.data.procedural import TaskError, check_task, is_procedural, task_rows
from grpo.data.shapes import is_shapes, shape_rows

log = logging.getLogger(__name__)

HUB_CONFIG = "main"


class DataError(SourceError, ValueError):
    """A dataset that cannot be loaded at all (missing, empty, damaged, offline)."""


ANSWER_FORMATS = ("gsm8k", "text")  # the number after '####' | the column's text, stripped


@dataclass(frozen=True)
class Columns:
    prompt: str = "question"
    answer: str = "answer"
    answer_format: str = "gsm8k"
    hub_config: str | None = None  # None: 'main' for openai/gsm8k, else the dataset's default
    image: str | None = None  # the column with each prompt's images (data.image_column)

    @classmethod
    def of(cls, data_cfg) -> "Columns":
        return cls(data_cfg.prompt_column, data_cfg.answer_column, data_cfg.answer_format, data_cfg.hub_config,
                   data_cfg.image_column)


GSM8K_COLUMNS = Columns()
PROCEDURAL_COLUMNS = Columns("question", "answer", "text")  # the rows data/procedural.py makes
SHAPES_COLUMNS = Columns("question", "answer", "text", image="image")  # data/shapes.py's
VERIFIERS_COLUMNS = Columns("prompt", "answer", "text")  # a verifiers environment's dataset: chat messages


@dataclass(frozen=True)
class Problem:
    id: str  # "<split>-<row index>", stable across runs
    question: str  # the user's question (the last user turn when the prompt is chat messages)
    answer: str  # the reference answer: GSM8K's final number with commas removed (e.g. "1234"), or the text
    reasoning: str = ""  # the worked solution before '####', calculator notes removed (few-shot examples)
    # the prompt as chat messages ({"role", "content"}), when the dataset gives them
    messages: tuple = field(default=(), hash=False)
    row: dict = field(default_factory=dict, compare=False, hash=False)  # the row's JSON columns, for rewards
    images: tuple = field(default=(), compare=False, hash=False)  # its images' encoded bytes (PNG, JPEG, ...)


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


def _chat_messages(value) -> tuple | None:
    """A list of {"role", "content"} strings ending in a user turn, or None."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):
        return None
    if value[-1]["role"] != "user":
        return None
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def _json_columns(row: dict) -> dict:
    """The row's columns that are JSON values (they cross to the reward process as JSON)."""
    kept = {}
    for key, value in row.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kept[str(key)] = value
    return kept


def _reference(value, answer_format: str) -> tuple[str | None, str]:
    """(the reference answer or None, the reasoning) of an answer cell."""
    if answer_format == "gsm8k":
        return (parse_final_answer(value), solution_reasoning(value)) if isinstance(value, str) else (None, "")
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None, ""
    text = str(value).strip()
    return (text or None), ""


def parse_rows(raw_rows, split: str, stats: LoadStats, columns: Columns = GSM8K_COLUMNS,
               folder: Path | None = None) -> list[Problem]:
    """Turn raw dict rows into Problems; a bad row is skipped and counted by reason. `folder`: where an image
    column's relative paths are read from."""
    problems = []
    for i, row in enumerate(raw_rows):
        stats.rows += 1
        if not isinstance(row, dict):
            stats.skip("not an object")
            continue
        prompt, solution = row.get(columns.prompt), row.get(columns.answer)
        messages = _chat_messages(prompt)
        if messages is None and (not isinstance(prompt, str) or not prompt.strip()):
            stats.skip(f"missing {columns.prompt}")
            continue
        if solution is None or (columns.answer_format == "gsm8k" and not isinstance(solution, str)):
            stats.skip(f"missing {columns.answer}")
            continue
        final, reasoning = _reference(solution, columns.answer_format)
        if final is None:
            stats.skip("non-numeric answer" if columns.answer_format == "gsm8k" else f"empty {columns.answer}")
            continue
        images = ()
        if columns.image is not None:
            images, problem = read_images(row.get(columns.image), folder)
            if problem:
                stats.skip(problem)
                continue
        question = messages[-1]["content"] if messages else prompt.strip()
        columns_kept = _json_columns(row) | ({"image_sizes": image_sizes(images)} if images else {})
        problems.append(Problem(f"{split}-{i}", question, final, reasoning, messages or (), columns_kept, images))
    return problems


# column names that usually hold the prompt / the reference answer, for naming the setting that fixes a column
PROMPT_NAMES = ("question", "problem", "prompt", "query", "input", "instruction", "messages", "text")
ANSWER_NAMES = ("answer", "solution", "output", "target", "label", "response", "ground_truth", "final_answer")


def check_columns(raw_rows: list, columns: Columns, where: str) -> None:
    """A column that no row has is a config mistake, not bad rows: say so, with the columns there
    are and the setting that names the likely one."""
    dicts = [r for r in raw_rows if isinstance(r, dict)]
    present = {key for r in dicts for key in r}
    missing = [c for c in (columns.prompt, columns.answer) if c not in present]
    if dicts and missing:
        raise DataError(f"{where} has no column {' or '.join(repr(c) for c in missing)} (data.prompt_column="
                        f"{columns.prompt!r}, data.answer_column={columns.answer!r}); its columns: "
                        f"{', '.join(sorted(present))}{_column_fix(columns, present)}")


def _column_fix(columns: Columns, present: set) -> str:
    """'; set data.prompt_column=problem data.answer_column=solution' for the columns that look right."""
    fixes = []
    for key, current, names in (("data.prompt_column", columns.prompt, PROMPT_NAMES),
                                ("data.answer_column", columns.answer, ANSWER_NAMES)):
        likely = next((name for name in names if name in present), None)
        if current not in present and likely is not None:
            fixes.append(f"{key}={likely}")
    return f"; set {' '.join(fixes)}" if fixes else ""


def format_fix(stats: LoadStats, columns: Columns) -> str:
    """The setting to try when most rows were skipped because their answer is not GSM8K's '#### N'."""
    non_numeric = stats.skipped.get("non-numeric answer", 0)
    if columns.answer_format != "gsm8k" or 2 * non_numeric <= stats.rows:
        return ""
    return (f"; {non_numeric} of {stats.rows} rows have no number after '####' in column {columns.answer!r} "
            "(data.answer_format=gsm8k reads GSM8K's '#### 42'): data.answer_format=text takes the column as it is")


def _read_jsonl(path: Path, limit: int | None = None) -> list:
    """The rows of a JSON-lines file (the first `limit` of them)."""
    rows = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            if limit is not None and len(rows) >= limit:
                break
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
        raise DataError(f"{folder} has no {split}.jsonl or {split}.parquet; a local data folder needs "
                        "<split>.jsonl or <split>.parquet for each split it is asked for (data.split, eval.split)")
    return files


def _read_local(folder: Path, split: str, stats: LoadStats) -> list:
    files = _require_local_files(folder, split)
    if files[0].suffix == ".jsonl":
        return _read_jsonl(files[0])
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


def _read_hub(name: str, split: str, hub_config: str | None, image_column: str | None = None) -> list:
    offline_reason = check_hub_dataset(name)
    import datasets

    config = hub_config if hub_config is not None else (HUB_CONFIG if name == "openai/gsm8k" else None)
    try:
        rows = datasets.load_dataset(name, config, split=split)
        return list(_undecoded(rows, image_column) if image_column in rows.features else rows)
    except Exception as e:
        if offline_reason is not None:  # HF_HUB_OFFLINE and not in the cache
            raise _hub_unreachable_error(name, f"{offline_reason} and it is not in the local cache") from None
        raise DataError(f"could not load data.path={name!r} (config {config!r}, split '{split}') from the Hugging "
                        f"Face Hub: {type(e).__name__}: {str(e)[:200]}") from None


def _undecoded(rows, column: str):
    """`rows` with the image column's images left as their encoded bytes: decoded, a split's pixels would all be held
    at once (data/images.py reads the bytes)."""
    import datasets

    feature = rows.features[column]
    if isinstance(feature, datasets.Image):
        return rows.cast_column(column, datasets.Image(decode=False))
    if isinstance(getattr(feature, "feature", None), datasets.Image):  # a list of images a row
        return rows.cast_column(column, type(feature)(datasets.Image(decode=False)))
    return rows


def _read_embedded(split: str) -> list:
    try:
        return embedded_rows(split)
    except EmbeddedDataError as e:
        raise DataError(str(e)) from None


def _read_procedural(path: str, split: str, task_args: dict) -> list:
    try:
        return task_rows(path, split, task_args)
    except TaskError as e:
        raise DataError(str(e)) from None


def _read_shapes(split: str, task_args: dict) -> list:
    try:
        return shape_rows(split, task_args)
    except ValueError as e:
        raise DataError(str(e)) from None


def _read_code_tasks(split: str, task_args: dict) -> list:
    try:
        return code_task_rows(split, task_args)
    except ValueError as e:
        raise DataError(str(e)) from None


def _read_verifiers(path: str, split: str, args: dict) -> list:
    try:
        return env_rows(env_of(path), args, split)
    except VerifiersError as e:
        raise DataError(str(e)) from None


def _read_rows(path: str, split: str, stats: LoadStats, hub_config: str | None = None,
               task_args: dict | None = None, image_column: str | None = None) -> list:
    if path == EMBEDDED_GSM8K:
        return _read_embedded(split)
    if is_code_tasks(path):
        return _read_code_tasks(split, task_args or {})
    if is_shapes(path):
        return _read_shapes(split, task_args or {})
    if is_procedural(path):
        return _read_procedural(path, split, task_args or {})
    if is_verifiers(path):
        return _read_verifiers(path, split, task_args or {})
    folder = Path(path).expanduser()
    return _read_local(folder, split, stats) if folder.is_dir() else _read_hub(path, split, hub_config, image_column)


def check_source(path: str, split: str, task_args: dict | None = None) -> None:
    """Fail now, in one line, if the data cannot be had (the launcher calls this before starting)."""
    if path == EMBEDDED_GSM8K:
        _read_embedded(split)
    elif is_code_tasks(path):
        _read_code_tasks(split, task_args or {})
    elif is_shapes(path):
        _read_shapes(split, {**(task_args or {}), "size": 1, "test_size": 1})
    elif is_procedural(path):
        try:
            check_task(path, task_args or {})
        except TaskError as e:
            raise DataError(str(e)) from None
    elif is_verifiers(path):
        _read_verifiers(path, split, task_args or {})
    elif Path(path).expanduser().is_dir():
        _require_local_files(Path(path).expanduser(), split)
    else:
        check_hub_dataset(path)


def load_problems(path: str, split: str, columns: Columns = GSM8K_COLUMNS,
                  task_args: dict | None = None) -> tuple[list[Problem], LoadStats]:
    """All usable problems of a split, and what was skipped. A reasoning-gym task's rows have
    their own columns (`task_args` are its settings)."""
    stats = LoadStats()
    columns = PROCEDURAL_COLUMNS if is_procedural(path) or is_code_tasks(path) else columns
    columns = SHAPES_COLUMNS if is_shapes(path) else VERIFIERS_COLUMNS if is_verifiers(path) else columns
    raw = _read_rows(path, split, stats, columns.hub_config, task_args, columns.image)
    check_columns(raw, columns, f"{path} split '{split}'")
    folder = Path(path).expanduser()
    problems = parse_rows(raw, split, stats, columns, folder if folder.is_dir() else None)
    if stats.skipped:
        log.warning("%s/%s: skipped %d of %d rows: %s%s", path, split, sum(stats.skipped.values()),
                    stats.rows, stats.skipped, format_fix(stats, columns))
    if not problems:
        raise DataError(f"{path} split '{split}' has no usable rows ({stats.rows} read, skipped: {stats.skipped})"
                        f"{format_fix(stats, columns)}")
    return problems, stats


CHECKED_ROWS = 200  # rows the launcher parses before anything starts: enough to see a wrong column or format


def check_rows(data_cfg, split: str, rows: int = CHECKED_ROWS) -> str | None:
    """The first rows of a split parsed as the sampler will, before anything starts: DataError when a
    column is missing or none is usable (naming the setting that fixes it); a warning when most are
    skipped; None when they parse. Embedded and local files only (a Hub dataset is checked as it loads)."""
    columns, path = Columns.of(data_cfg), data_cfg.path
    if is_procedural(path) or is_code_tasks(path) or is_shapes(path) or is_verifiers(path):
        return None  # rows of our own making, or an environment's
    folder = Path(path).expanduser()
    if path == EMBEDDED_GSM8K:
        raw = _read_embedded(split)[:rows]
    elif folder.is_dir():
        raw = _first_rows(_require_local_files(folder, split), rows)
    else:
        return None
    where, stats = f"{path} split '{split}'", LoadStats()
    check_columns(raw, columns, where)
    if not parse_rows(raw, split, stats, columns) and raw:
        raise DataError(f"{where}: none of its first {stats.rows} rows is usable (skipped: {stats.skipped})"
                        f"{format_fix(stats, columns)}")
    fix = format_fix(stats, columns)
    return f"{where}: {fix.removeprefix('; ')}" if fix else None


def _first_rows(files: list[Path], rows: int) -> list:
    """Up to `rows` rows of a split's first file, read as the loader reads them; a file that is not a
    regular one (a pipe) is not read here."""
    first = files[0]
    if not first.is_file():
        return []
    if first.suffix == ".jsonl":
        return _read_jsonl(first, rows)
    import pyarrow.parquet as pq

    batch = next(pq.ParquetFile(first).iter_batches(batch_size=rows), None)
    return batch.to_pylist() if batch is not None else []


def load_split(data_cfg, split: str) -> tuple[list[Problem], LoadStats]:
    """A split of the configured dataset (data.path and its columns, or a task's settings)."""
    return load_problems(data_cfg.path, split, Columns.of(data_cfg), data_cfg.task_args)
