"""PNG figures of one or more runs' metrics against the step, runs overlaid (e.g. GRPO vs GSPO).

    .venv/bin/python scripts/plot_metrics.py runs/grpo runs/gspo [--labels GRPO,GSPO] [--out docs/figures]
                                             [--smooth 5]

Writes <out>/metrics.png (all panels) and one <out>/<panel>.png per panel.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = [  # (file name, title, metric keys summed, y label)
    ("answer_accuracy", "Answer accuracy (strict)", ["strict/answer_accuracy"], "share of completions"),
    ("format_rate", "Exact <think>/<answer> format", ["strict/format_rate"], "share of completions"),
    ("reward", "Total reward", ["reward"], "mean per completion"),
    ("entropy", "Entropy", ["entropy"], "nats per token"),
    ("kl", "KL to the reference", ["kl"], "per token"),
    ("completion_length", "Completion length", ["completions/mean_length"], "tokens"),
    ("step_time", "Step time (trainer wait + train)", ["timing/wait_s", "timing/train_s"], "seconds"),
    ("eval_answer_accuracy", "Held-out answer accuracy (greedy, strict; ±1 s.e.)", ["eval/answer_accuracy"],
     "share of problems"),
    ("eval_format_rate", "Held-out exact format (greedy)", ["eval/format_rate"], "share of problems"),
]
ERROR_BARS = {"eval/answer_accuracy": "eval/answer_accuracy_stderr"}  # eval rows: points, not smoothed


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written while we read
    return rows


def series(rows: list[dict], keys: list[str]) -> tuple[list[int], list[float]]:
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
    args.out.mkdir(parents=True, exist_ok=True)
    grid, axes = plt.subplots(3, 3, figsize=(16, 12))
    for (name, title, keys, ylabel), grid_ax in zip(PANELS, axes.flat):
        single, ax = plt.subplots(figsize=(6, 4))
        for target in (grid_ax, ax):
            for label, rows in data:
                steps, values = series(rows, keys)
                if keys[0] in ERROR_BARS:
                    _, errors = series(rows, [ERROR_BARS[keys[0]]])
                    target.errorbar(steps, values, yerr=errors, marker="o", capsize=3, label=label)
                elif keys[0].startswith("eval/"):
                    target.plot(steps, values, marker="o", label=label)
                else:
                    target.plot(steps, smooth(values, args.smooth), label=label)
            target.set_title(title)
            target.set_xlabel("step")
            target.set_ylabel(ylabel)
            target.grid(alpha=0.3)
            target.legend()
        single.tight_layout()
        single.savefig(args.out / f"{name}.png", dpi=80)
        plt.close(single)
    grid.tight_layout()
    grid.savefig(args.out / "metrics.png", dpi=80)
    print(f"wrote {len(PANELS) + 1} figures to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
