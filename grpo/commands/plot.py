"""PNG figures of one or more runs' metrics against the step, runs overlaid (e.g. GRPO vs GSPO).

    grpo plot runs/grpo runs/gspo [--labels GRPO,GSPO] [--out docs/figures]
                                             [--smooth 5]

Writes <out>/metrics.png (all panels) and one <out>/<panel>.png per panel. The panels follow what the
runs' metrics.jsonl rows hold: accuracy and format rate (the share of completions that
rewards.accuracy_reward / rewards.format_reward give at least 1), the total reward and each reward by
its name, entropy, KL, completion length, step time, and the held-out evaluation; a panel that no run
has values for (KL with training.beta=0, evaluation with eval.every=0) is left out.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from grpo.common.run_folder import RunFolder


@dataclass(frozen=True)
class Panel:
    name: str  # its PNG's file name, without .png
    title: str
    keys: tuple[str, ...]  # metric keys, summed
    ylabel: str


# accuracy and format rate: the share of completions that rewards.accuracy_reward / rewards.format_reward
# give at least 1 (whatever the task); each reward of the run gets a panel of its own after the total
HEAD = [Panel("answer_accuracy", "Answer accuracy (accuracy reward >= 1)", ("strict/answer_accuracy",),
              "share of completions"),
        Panel("format_rate", "Format rate (format reward >= 1)", ("strict/format_rate",), "share of completions"),
        Panel("reward", "Total reward (weighted sum)", ("reward",), "mean per completion")]
TAIL = [Panel("entropy", "Entropy", ("entropy",), "nats per token"),
        Panel("kl", "KL to the reference", ("kl",), "per token"),
        Panel("completion_length", "Completion length", ("completions/mean_length",), "tokens"),
        Panel("step_time", "Step time (trainer wait + train)", ("timing/wait_s", "timing/train_s"), "seconds"),
        Panel("eval_answer_accuracy", "Held-out answer accuracy (greedy; ±1 s.e.)", ("eval/answer_accuracy",),
              "share of problems"),
        Panel("eval_format_rate", "Held-out format rate (greedy)", ("eval/format_rate",), "share of problems")]
ERROR_BARS = {"eval/answer_accuracy": "eval/answer_accuracy_stderr"}  # eval rows: points, not smoothed


def read_metrics(run: Path) -> list[dict]:
    path = RunFolder(run).metrics if run.is_dir() else run
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written while we read
    return rows


def reward_names(rows: list[dict]) -> list[str]:
    """The run's reward names, in the order its rows first carry them (`rewards/<name>/mean`)."""
    names: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key.startswith("rewards/") and key.endswith("/mean"):
                names.setdefault(key[len("rewards/"):-len("/mean")], None)
    return list(names)


def panels(runs: list[list[dict]]) -> list[Panel]:
    """The panels to draw for these runs' rows: the fixed ones and one per reward name, each only
    where some run has a value for it (no evaluation panels for runs that never evaluated)."""
    names = dict.fromkeys(name for rows in runs for name in reward_names(rows))
    rewards = [Panel(f"reward_{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}", f"Reward: {name}",
                     (f"rewards/{name}/mean",), "mean where it applies") for name in names]
    return [panel for panel in [*HEAD, *rewards, *TAIL] if any(series(rows, panel.keys)[0] for rows in runs)]


def series(rows: list[dict], keys) -> tuple[list[int], list[float]]:
    """(steps, values) in step order (evaluation rows are written when their batch arrives)."""
    points = sorted((row["step"], sum(row[k] for k in keys)) for row in rows if all(k in row for k in keys))
    return [p[0] for p in points], [p[1] for p in points]


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (window 1 = raw)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1): i + 1]
        out.append(sum(part) / len(part))
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (or metrics.jsonl files)")
    parser.add_argument("--labels", help="comma-separated legend labels, one per run")
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--smooth", type=int, default=1, help="moving-average window in steps")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else [r.name for r in args.runs]
    if len(labels) != len(args.runs):
        parser.error(f"{len(labels)} labels for {len(args.runs)} runs")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [(label, read_metrics(run)) for label, run in zip(labels, args.runs)]
    chosen = panels([rows for _, rows in data])
    if not chosen:
        print(f"no metrics to plot in {', '.join(map(str, args.runs))}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    cols = min(3, len(chosen))
    lines = math.ceil(len(chosen) / cols)
    grid, axes = plt.subplots(lines, cols, figsize=(16 * cols / 3, 4 * lines), squeeze=False)
    for panel, grid_ax in zip(chosen, axes.flat):
        single, ax = plt.subplots(figsize=(6, 4))
        for target in (grid_ax, ax):
            for label, rows in data:
                steps, values = series(rows, panel.keys)
                if panel.keys[0] in ERROR_BARS:
                    _, errors = series(rows, [ERROR_BARS[panel.keys[0]]])
                    target.errorbar(steps, values, yerr=errors, marker="o", capsize=3, label=label)
                elif panel.keys[0].startswith("eval/"):
                    target.plot(steps, values, marker="o", label=label)
                else:
                    target.plot(steps, smooth(values, args.smooth), label=label)
            target.set_title(panel.title)
            target.set_xlabel("step")
            target.set_ylabel(panel.ylabel)
            target.grid(alpha=0.3)
            target.legend()
        single.tight_layout()
        single.savefig(args.out / f"{panel.name}.png", dpi=80)
        plt.close(single)
    for unused in list(axes.flat)[len(chosen):]:
        unused.remove()
    grid.tight_layout()
    grid.savefig(args.out / "metrics.png", dpi=80)
    print(f"wrote {len(chosen) + 1} figures to {args.out}: {', '.join(panel.name for panel in chosen)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
