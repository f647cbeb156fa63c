"""What the launcher shows while a run goes: the start-up milestones of the workers' logs, one line
per trained step (reward, strict rates, KL, the step's own time, elapsed time, ETA), one per
evaluation, a warning when steps give nothing to learn from, and what the run left when it stops."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from pathlib import Path

from grpo.common.files import CHECKPOINT_MARK
from grpo.common.run_folder import RunFolder
from grpo.run.rows import is_evaluation_row

ZERO_SPREAD = "sampling/zero_spread_fraction"  # the share of a step's groups whose rewards are all equal
# episodes: of the model messages that called a tool, the share that parsed
CALL_RATE = "env/tool_messages/well_formed_rate"
FLAT_STEPS_WARNING = 3  # steps in a row with every group scored alike before the console says so


def tail(path: Path, lines: int = 25, start: int = 0) -> str:
    """The last `lines` lines of `path` after byte `start` (this launch's part of a log)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


class StepProgress:
    """Prints a progress line for each metrics.jsonl row this launch's trainer writes. A resumed
    trainer first rewrites the file without the rows after its checkpoint (a new file): it is then
    read again from its start, and rows older than the launch are skipped by their wall_time."""

    def __init__(self, metrics_path: Path, total_steps: int, clock=time.monotonic):
        self.path, self.total_steps, self.clock = metrics_path, total_steps, clock
        self.seen, self.file = (len(metrics_path.read_text().splitlines()), _inode(metrics_path)) \
            if metrics_path.is_file() else (0, None)
        self.started, self.started_wall = clock(), time.time()
        self.step_times: deque = deque(maxlen=10)  # the last steps' own times (wall_time between rows)
        self.last_wall: float | None = None  # the previous step row's wall_time, in this launch
        self.flat_steps = 0  # step rows in a row whose groups all scored alike

    def print_new(self) -> None:
        if not self.path.is_file():
            return
        if _inode(self.path) != self.file:  # rewritten (a resume dropped the rows after its checkpoint)
            self.seen, self.file = 0, _inode(self.path)
        for line in self.path.read_text().splitlines()[self.seen:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return  # a line being written: read it next time
            self.seen += 1
            if row.get("wall_time", self.started_wall) < self.started_wall:
                continue  # an earlier launch's row
            if is_evaluation_row(row):
                print(eval_line(row), flush=True)
                continue
            print(progress_line(row, self.total_steps, self._own_time(row), self._per_step(),
                                self.clock() - self.started), flush=True)
            self._watch_spread(row)

    def _own_time(self, row: dict) -> float:
        """The step's own time: since the previous step's row; the launch's first step, whose wait
        holds the start-up, counts its training and publishing only."""
        if self.last_wall is None:
            own = row.get("timing/train_s", float("nan")) + row.get("timing/publish_s", 0.0)
        else:
            own = row["wall_time"] - self.last_wall
            self.step_times.append(own)
        self.last_wall = row.get("wall_time")
        return own

    def _per_step(self) -> float:
        return sum(self.step_times) / len(self.step_times) if self.step_times else float("nan")

    def _watch_spread(self, row: dict) -> None:
        self.flat_steps = self.flat_steps + 1 if row.get(ZERO_SPREAD) == 1.0 else 0
        if self.flat_steps == FLAT_STEPS_WARNING:
            print(f"warning: nothing to learn from: every group scored alike in the last {FLAT_STEPS_WARNING} steps "
                  "(all completions of each prompt got the same reward, so the loss and the update are 0). Raise "
                  "sampling.temperature or sampling.group_size, give the rewards partial credit, or use prompts the "
                  "model sometimes solves; rewards/<name>/mean in metrics.jsonl shows what each reward gives",
                  flush=True)


def format_duration(seconds: float) -> str:
    """1:02:03 for 3723 s; hours are not wrapped at a day."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def progress_line(row: dict, total_steps: int, own_s: float, per_step_s: float, elapsed_s: float) -> str:
    """One step's line: `own_s` the step's own time, `per_step_s` the recent mean (the ETA's rate;
    NaN: not known yet, the step's own time stands in), `elapsed_s` since the launch."""
    done = row["step"]
    rate = per_step_s if per_step_s == per_step_s else own_s
    eta = rate * (total_steps - done)
    calls = f" | calls ok {100 * row[CALL_RATE]:5.1f}%" if CALL_RATE in row else ""
    return (f"step {done}/{total_steps} | reward {row.get('reward', float('nan')):+.3f} | "
            f"answer {100 * row.get('strict/answer_accuracy', float('nan')):5.1f}% | "
            f"format {100 * row.get('strict/format_rate', float('nan')):5.1f}%{calls} | "
            f"kl {row.get('kl', 0.0):.4f} | {own_s:6.1f} s/step | elapsed {format_duration(elapsed_s)} | "
            f"ETA {format_duration(eta) if eta == eta else '?'}")


def eval_line(row: dict) -> str:
    return (f"eval at step {row['step']} | answer {100 * row['eval/answer_accuracy']:5.1f}% "
            f"± {100 * row['eval/answer_accuracy_stderr']:.1f} | format {100 * row['eval/format_rate']:5.1f}% | "
            f"{row['eval/problems']:.0f} problems in {row['eval/seconds']:.0f} s")


def last_trained_and_saved(run_dir: Path) -> tuple[int, int]:
    """(the last step in metrics.jsonl, the step of the last whole checkpoint), 0 where none."""
    trained = 0
    metrics = RunFolder(run_dir).metrics
    if metrics.is_file():
        for line in metrics.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not is_evaluation_row(row):
                trained = max(trained, int(row.get("step", 0)))
    mark = RunFolder(run_dir).checkpoints / CHECKPOINT_MARK
    saved = int("".join(filter(str.isdigit, mark.read_text()))) if mark.is_file() else 0
    return trained, saved


def stop_summary(run_dir: Path, weights_dir: Path, total_steps: int) -> str:
    """What a stopped run left: its last trained step, published version and checkpoint."""
    trained, saved = last_trained_and_saved(run_dir)
    if trained == 0:
        return "no step was trained; the same command starts the run afresh"
    done = f"the last step trained was {trained} of {total_steps} (weights in {weights_dir})"
    if saved == 0:
        return (f"{done}; no checkpoint was saved, so the same command would be refused as a fresh start into a used "
                "run folder: add checkpoint.resume=never run.overwrite=true to start over (the old outputs are "
                "moved aside)")
    return f"{done}; the checkpoint of step {saved} is saved; the same command resumes from it"


def log_milestone(logger: logging.Logger, message: str, *args) -> None:
    """An INFO line written whatever logging.level is: the launcher reads a worker's milestones off
    its log, and READY's line ends the start-up it watches (grpo/run/watchdog.py)."""
    logger.handle(logger.makeRecord(logger.name, logging.INFO, "(milestone)", 0, message, args, None))


# start-up lines worth showing before the first step (which takes a few minutes on a CPU), and the
# line after which a worker's start-up is over (the sampler holds its prompts, the trainer its engine)
MILESTONES = {"sampler": ("converting ", "prompts from", "resuming at step"),
              "trainer": ("trainable parameters", "resumed from", "removed the build lock",
                          "waiting for the build lock")}
READY = {"sampler": "prompts from", "trainer": "trainable parameters"}


class WorkerLogs:
    """The workers' logs as this launch wrote them (each from its size when the launch began):
    prints their start-up milestones as they appear, and keeps when each last wrote anything and
    whether its start-up is over (`last_output`, `ready`)."""

    def __init__(self, logs: dict[str, Path], clock=time.monotonic):
        self.logs, self.clock = logs, clock
        self.starts = {name: _size(path) for name, path in logs.items()}  # a resumed run appends
        self.offsets = dict(self.starts)
        self.last_output = {name: clock() for name in logs}
        self.ready = {name: False for name in logs}

    def print_new(self) -> None:
        for name, path in self.logs.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[name])
                    data = f.read()
            except OSError:
                continue
            if data:
                self.last_output[name] = self.clock()
            complete = data[:data.rfind(b"\n") + 1]  # a line being written: read it next time
            self.offsets[name] += len(complete)
            kind = name.rstrip("0123456789")
            for line in complete.decode(errors="replace").splitlines():
                message = line.split(" INFO ", 1)[1] if " INFO " in line else line.split(" WARNING ", 1)[-1]
                if READY[kind] in line:
                    self.ready[name] = True
                if any(pattern in line for pattern in MILESTONES[kind]) and (" INFO " in line or " WARNING " in line):
                    print(f"  {name}: {message}", flush=True)

    def skip_to_end(self, name: str) -> None:
        """Read on from the end of `name`'s log, leaving `last_output` as it is (text the launcher
        had the worker write, its stacks, is not the worker's progress)."""
        self.offsets[name] = max(self.offsets[name], _size(self.logs[name]))

    def tail(self, name: str, lines: int = 25) -> str:
        """The end of `name`'s log, this launch's lines only."""
        return tail(self.logs[name], lines, self.starts[name])


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0
