"""End to end: a recipe trained for the same wall-clock budget with the HF engine's continuous decode
loop and with the block loop (`sampling.continuous_batching=false`), or (`--variants in-flight`) with
new weights loaded between steps, between decode steps with the KV computed again, and between decode
steps on the KV before, or (`--variants token-age`) with in-flight loads and tokens more than a version
old out of the loss (training.max_token_age) against the whole-sequence bound, or (`--variants objectives`)
with each advantage estimator and policy loss, or (`--variants distillation --teacher DIR`) distilled from a
teacher against GRPO, or (`--variants agent`) through the agent endpoint (an openai-client harness) against
the sampler's own generation; one run after the other on the whole machine, each evaluated at the same marks.

    .venv/bin/python scripts/benchmarks/bench_continuous_learn.py --config configs/needle_haystack.yaml \\
        --minutes 8 --marks 4,8 [--variants in-flight] [key=value ...]

Each run is scripts/benchmarks/bench_learn.py's run of ours (launch.max_minutes, every version kept);
a mark at minute m evaluates the last version published by m with the same greedy evaluation
(grpo evaluate, the first --eval-problems problems of eval.split), after both runs. Printed:
held-out accuracy at each mark, trained steps per minute (the versions published over the budget), and
from each run's metrics.jsonl the share of the trainer's step time it waited for a batch, the share of
the sampler's generation it waited for weights, and (in-flight) the loads and their KV recompute time.
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

VARIANT_SETS = {
    "continuous": {"continuous": [], "blocks": ["sampling.continuous_batching=false"]},
    "in-flight": {"in-flight, KV recomputed": ["sampling.in_flight_updates=true"],
                  "in-flight, KV kept": ["sampling.in_flight_updates=true", "sampling.in_flight_kv=keep"],
                  "between steps": []},
    "in-flight-exact": {"in-flight, KV recomputed": ["sampling.in_flight_updates=true"], "between steps": []},
    # in-flight both: the oldest token bounded at 2 versions and tokens older than 1 out of the loss,
    # against every token bounded at 1
    "token-age": {"per-token age bound": ["sampling.in_flight_updates=true", "sampling.max_staleness=2",
                                          "training.max_token_age=1"],
                  "whole-sequence bound": ["sampling.in_flight_updates=true", "sampling.max_staleness=1"]},
    # the advantage estimators and policy losses side by side, GRPO's (the default) the base
    "objectives": {"rloo": ["training.advantage=rloo"], "reinforce_pp": ["training.advantage=reinforce_pp"],
                   "dr_grpo": ["training.advantage=dr_grpo", "training.aggregation=dr_grpo"],
                   "cispo": ["training.loss=cispo"], "grpo": []},
    # on-policy distillation from --teacher, the teacher's signal alone, against the recipe's GRPO
    "distillation": {"distillation": ["distill.teacher={teacher}"], "grpo": []},
    "distillation-only": {"distillation": ["distill.teacher={teacher}"]},
    # the needle recipe through the agent endpoint (a plain openai-client harness, one turn begun with the
    # recipe's prefill) against the sampler's own generation
    "agent": {"agent endpoint": ["agent.entrypoint=scripts/benchmarks/bench_agent_endpoint.py:answer_begun",
                                 "data.prefill="], "native": []},
}


def idle_shares(run_dir: Path) -> dict[str, float]:
    """From a run's metrics rows: the trainer's wait for batches over its step time, the sampler's wait
    for weights over its generation time, in-flight loads per step and their KV recompute over generation."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "timing/train_s" in r]
    wait, train = sum(r["timing/wait_s"] for r in rows), sum(r["timing/train_s"] for r in rows)
    weights, generate = sum(r.get("timing/weights_wait_s", 0) for r in rows), sum(r["timing/generate_s"] for r in rows)

    def per_step(key: str) -> float:
        return sum(r.get(key, 0) for r in rows) / max(len(rows), 1)
    return {"trainer idle": wait / max(wait + train, 1e-9), "sampler idle": weights / max(weights + generate, 1e-9),
            "loads per step": per_step("sampler/in_flight_loads"),
            "KV recompute / generation": sum(r.get("timing/kv_recompute_s", 0) for r in rows) / max(generate, 1e-9),
            "requests moved per step (vLLM)": per_step("sampler/in_flight_resumed"),
            "completions spanning versions": per_step("staleness/multi_version_fraction"),
            "tokens aged out of the loss": per_step("staleness/aged_out_token_fraction")}


def main(argv: list[str]) -> int:
    from bench_learn import evaluate_marks, run_ours, weights_at_marks

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "needle_haystack.yaml")
    parser.add_argument("--minutes", type=float, default=8.0)
    parser.add_argument("--marks", default="4,8", help="minutes to evaluate at, comma-separated ('' = no evaluation)")
    parser.add_argument("--eval-problems", type=int, default=300)
    parser.add_argument("--eval-batch-size", type=int, default=100)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "continuous-learn")
    parser.add_argument("--variants", choices=list(VARIANT_SETS), default="continuous")
    parser.add_argument("--teacher", help="--variants distillation: the teacher's model folder (grpo export --merge)")
    args, overrides = parser.parse_known_args(argv)
    variants = {name: [setting.format(teacher=args.teacher) for setting in extra]
                for name, extra in VARIANT_SETS[args.variants].items()}
    if args.variants.startswith("distillation") and not args.teacher:
        parser.error("--variants distillation needs --teacher (a model folder: grpo export --merge of a trained run)")
    base = list(variants)[-1]
    marks = [0.0] + [float(m) for m in args.marks.split(",") if m]
    at_marks, rates, shares = {}, {}, {}
    for name, extra in variants.items():
        folder = args.out / name.replace(" ", "-").replace(",", "")
        folder.mkdir(parents=True, exist_ok=True)
        versions = run_ours(args.config, args.minutes, [*overrides, *extra], folder)
        at_marks[name] = weights_at_marks(versions, marks)
        rates[name] = sum(minute <= args.minutes for minute, _ in versions) / args.minutes
        shares[name] = idle_shares(folder / "ours")
        print(f"{name}: {len(versions)} versions published, {rates[name]:.2f} steps per minute; "
              + ", ".join(f"{k} {v:.3g}" for k, v in shares[name].items()), flush=True)
    print("steps per minute: " + ", ".join(f"{name} {rates[name]:.2f} ({rates[name] / max(rates[base], 1e-9):.2f}x)"
                                           for name in variants))
    if len(marks) == 1:  # no marks: the rates and shares only
        return 0
    curves = evaluate_marks(args.config, overrides, at_marks, args.eval_problems, args.eval_batch_size, args.out)
    print("| minute | " + " | ".join(f"{name} accuracy" for name in variants) + " |")
    print("| --- | " + " | ".join("---" for _ in variants) + " |")
    for i, mark in enumerate(marks):
        cells = [f"{100 * c[i]['answer_accuracy']:.1f}% ± {100 * c[i]['answer_accuracy_stderr']:.1f}"
                 for c in (curves[name] for name in variants)]
        print(f"| {mark:g} | " + " | ".join(cells) + " |")
    (args.out / "result.json").write_text(json.dumps({"curves": curves, "steps_per_minute": rates, "shares": shares,
                                                      "overrides": overrides, "minutes": args.minutes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
