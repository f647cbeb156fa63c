"""What the launcher shows while a run goes: the start-up milestones of the workers' logs, one line
per trained step (reward, strict rates, KL, step time, ETA) and one per evaluation."""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path

from grpo.run.rows import is_evaluation_row


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


class StepProgress:
    """Prints a progress line for each new metrics.jsonl row (a resumed run's old rows are skipped)."""

    def __init__(self, metrics_path: Path, total_steps: int):
        self.path, self.total_steps = metrics_path, total_steps
        self.seen = len(metrics_path.read_text().splitlines()) if metrics_path.is_file() else 0
        self.step_times, self.last = deque(maxlen=10), time.monotonic()

    def print_new(self) -> None:
        if not self.path.is_file():
            return
        for line in self.path.read_text().splitlines()[self.seen:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return  # a line being written: read it next time
            self.seen += 1
            if is_evaluation_row(row):
                print(eval_line(row), flush=True)
                continue
            now = time.monotonic()
            self.step_times.append(now - self.last)
            self.last = now
            print(progress_line(row, self.total_steps, self.step_times), flush=True)


def format_duration(seconds: float) -> str:
    """1:02:03 for 3723 s; hours are not wrapped at a day."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def progress_line(row: dict, total_steps: int, step_times: deque) -> str:
    done = row["step"]
    per_step = sum(step_times) / len(step_times) if step_times else float("nan")
    eta = per_step * (total_steps - done)
    eta_text = format_duration(eta) if eta == eta else "?"
    return (f"step {done}/{total_steps} | reward {row.get('reward', float('nan')):+.3f} | "
            f"answer {100 * row.get('strict/answer_accuracy', float('nan')):5.1f}% | "
            f"format {100 * row.get('strict/format_rate', float('nan')):5.1f}% | "
            f"kl {row.get('kl', 0.0):.4f} | {per_step:6.1f} s/step | ETA {eta_text}")


def eval_line(row: dict) -> str:
    return (f"eval at step {row['step']} | answer {100 * row['eval/answer_accuracy']:5.1f}% "
            f"± {100 * row['eval/answer_accuracy_stderr']:.1f} | format {100 * row['eval/format_rate']:5.1f}% | "
            f"{row['eval/problems']:.0f} problems in {row['eval/seconds']:.0f} s")


# start-up lines worth showing before the first step (which takes a few minutes on a CPU)
MILESTONES = {"sampler": ("converting ", "prompts from", "resuming at step"),
              "trainer": ("trainable parameters", "resumed from")}


class LogMilestones:
    """Prints the start-up milestones of the two logs as they appear (read from where it left off)."""

    def __init__(self, logs: dict[str, Path]):
        self.logs, self.offsets = logs, {name: _size(path) for name, path in logs.items()}  # a resumed run appends

    def print_new(self) -> None:
        for name, path in self.logs.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[name])
                    data = f.read()
            except OSError:
                continue
            complete = data[:data.rfind(b"\n") + 1]  # a line being written: read it next time
            self.offsets[name] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if any(pattern in line for pattern in MILESTONES[name.rstrip("0123456789")]) and " INFO " in line:
                    print(f"  {name}: {line.split(' INFO ', 1)[1]}", flush=True)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0
