"""End to end: a recipe trained for the same wall-clock budget with the HF engine's continuous decode
loop and with the block loop (`sampling.continuous_batching=false`), one run after the other on the
whole machine, each evaluated at the same marks.

    .venv/bin/python scripts/benchmarks/bench_continuous_learn.py --config configs/needle_haystack.yaml \\
        --minutes 8 --marks 4,8 [key=value ...]

Each run is scripts/benchmarks/bench_learn.py's run of ours (launch.max_minutes, every version kept);
a mark at minute m evaluates the last version published by m with the same greedy evaluation
(scripts/evaluate.py, the first --eval-problems problems of eval.split), after both runs. Printed:
held-out accuracy at each mark, and trained steps per minute (the versions published over the budget).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "benchmarks"))

VARIANTS = {"continuous": [], "blocks": ["sampling.continuous_batching=false"]}


def main(argv: list[str]) -> int:
    from bench_learn import evaluate_marks, run_ours, weights_at_marks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "needle_haystack.yaml")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--marks", default="4,8", help="minutes to evaluate at, comma-separated")
    parser.add_argument("--eval-problems", type=int, default=300)
    parser.add_argument("--eval-batch-size", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "continuous-learn")
    args, overrides = parser.parse_known_args(argv)
    marks = [0.0] + [float(m) for m in args.marks.split(",")]
    at_marks, rates = {}, {}
    for name, extra in VARIANTS.items():
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        versions = run_ours(args.config, args.minutes, [*overrides, *extra], folder)
        at_marks[name] = weights_at_marks(versions, marks)
        rates[name] = sum(minute <= args.minutes for minute, _ in versions) / args.minutes
        print(f"{name}: {len(versions)} versions published, {rates[name]:.2f} steps per minute", flush=True)
    curves = evaluate_marks(args.config, overrides, at_marks, args.eval_problems, args.eval_batch_size, args.out)
    print("| minute | " + " | ".join(f"{name} accuracy" for name in VARIANTS) + " |")
    print("| --- | " + " | ".join("---" for _ in VARIANTS) + " |")
    for i, mark in enumerate(marks):
        cells = [f"{100 * c[i]['answer_accuracy']:.1f}% ± {100 * c[i]['answer_accuracy_stderr']:.1f}"
                 for c in (curves[name] for name in VARIANTS)]
        print(f"| {mark:g} | " + " | ".join(cells) + " |")
    print("steps per minute: " + ", ".join(f"{name} {rates[name]:.2f}" for name in VARIANTS)
          + f" ({rates['continuous'] / max(rates['blocks'], 1e-9):.2f}x)")
    (args.out / "result.json").write_text(json.dumps({"curves": curves, "steps_per_minute": rates,
                                                      "overrides": overrides, "minutes": args.minutes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
