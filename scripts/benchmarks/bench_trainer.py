"""The trainer's own work per step, with each optimisation on and off, against the matmul ceiling.

    .venv/bin/python scripts/benchmarks/bench_trainer.py [--repeats 2] [--threads 1] [key=value ...]
    .venv/bin/python scripts/benchmarks/bench_trainer.py --guard   # "as configured" against the recorded MFU

One default sampler step on the embedded SmolLM2 (2 prompts x 8 completions, up to 200
tokens) is generated once and written to a file in the wire format; then each variant runs in a
fresh process (so that its peak RSS is its own): it loads the policy as the trainer does and
runs a trainer step's compute twice, the reference pass (adapter off, no grad; none at beta 0) and the loss
forward + backward of each micro-batch (`grpo.trainer.training_step.micro_batch_loss`, as `train_step` packs
them; DeepSpeed's ZeRO-0 wrapper adds no compute), timing the second. The variants alternate,
so drift hits them alike. Printed per variant: the median time, its kernel time and minor page faults, model GFLOP/s
(`grpo.model.flops.batch_step_flops`), MFU against the fp32 matmul rate of the model's shapes
measured first with the same threads, peak RSS, and the ratios to the first variant.

`--guard` runs "as configured" alone and compares its MFU with the figure docs/performance.md records for it
(its headline row `trainer's step MFU`): below GUARD_FRACTION of it, it says so and exits 1. MFU is against
the ceiling measured in the same run, so the figure holds across machine speeds better than seconds do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # default_batch: bench_importance_sampling.py's

# glibc malloc keeping freed memory instead of returning it (trim) and mapping it afresh, with
# and without transparent huge pages: measured against the page faults of the trainer's step
# (no gain once the LM-head chunks fit the heap, grpo/model/logprobs.py; docs/notes/optimisations.md)
MALLOC_KEEP = "glibc.malloc.trim_threshold=4294967296:glibc.malloc.mmap_threshold=33554432"

GUARD_FRACTION = 0.9  # a step's MFU below this share of the recorded one is a regression
RECORDED = ROOT / "docs" / "performance.md"

VARIANTS = {  # name: (config overrides on top of the command line's, environment)
    "as configured": ([], {}),  # training.max_tokens_per_micro_batch 2048: one default group per micro-batch
    "the whole step in one micro-batch (8192 tokens)": (["training.max_tokens_per_micro_batch=8192"], {}),
    "gradient checkpointing": (["model.gradient_checkpointing=true"], {}),
    "no KL term (beta 0: no reference pass)": (["training.beta=0"], {}),
    "bfloat16 weights": (["model.dtype=bfloat16"], {}),
    "malloc: keep freed memory": ([], {"GLIBC_TUNABLES": MALLOC_KEEP}),
    "malloc: keep freed memory + huge pages": ([], {"GLIBC_TUNABLES": MALLOC_KEEP + ":glibc.malloc.hugetlb=1"}),
}


def worker(batch_path: Path, overrides: list[str]) -> dict:
    """In its own process: load the policy, run the step's compute twice, time the second."""
    from grpo.config import load_config
    from grpo.model.flops import ModelShape, batch_step_flops
    from grpo.model.loading import load_policy
    from grpo.model.sharding import pack_micro_batches
    from grpo.trainer.groups import group_costs, select_groups
    from grpo.trainer.training_step import micro_batch_loss
    from grpo.wire.codec import decode_batch

    cfg = load_config(ROOT / "config.yaml", overrides)
    batch = decode_batch([bytes.fromhex(f) for f in json.loads(batch_path.read_text())])
    batch.ref_logps = None  # the trainer computes them (training.reference_on=trainer)
    model = load_policy(cfg).train()
    costs = group_costs(batch)
    micro = pack_micro_batches(list(range(len(costs))), costs, cfg.training.max_tokens_per_micro_batch)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        for groups in micro:  # each computes its reference log-probs first, as in the trainer
            micro_batch_loss(model, select_groups(batch, groups), cfg)[0].backward()
        seconds, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    flops = batch_step_flops(ModelShape.of(model), batch, cfg)
    return {"seconds": seconds, "model_flops": flops["model"], "micro_batches": len(micro),
            "kernel_s": after.ru_stime - before.ru_stime, "page_faults": after.ru_minflt - before.ru_minflt,
            "peak_rss": after.ru_maxrss * 1024}


def recorded_mfu(text: str) -> tuple[float, str]:
    """(MFU, date) of the headline row `| trainer's step MFU ... | 71% | 2026-11-24 |` in docs/performance.md."""
    match = re.search(r"^\| trainer's step MFU[^|]*\| (\d+(?:\.\d+)?)% \| (\d{4}-\d\d-\d\d) \|", text, re.MULTILINE)
    if match is None:
        raise SystemExit(f"{RECORDED} has no headline row \"trainer's step MFU\" to guard against")
    return float(match.group(1)) / 100, match.group(2)


def guard(mfu: float) -> int:
    """0 when `mfu` is at least GUARD_FRACTION of the recorded figure; else 1, saying so."""
    recorded, date = recorded_mfu(RECORDED.read_text())
    print(f"trainer's step MFU {mfu:.0%} against {recorded:.0%} recorded on {date} ({mfu / recorded:.2f}x)")
    if mfu < GUARD_FRACTION * recorded:
        print(f"below {GUARD_FRACTION:.0%} of the recorded figure: the trainer's step is slower than it was; "
              "compare this commit's step with an earlier one's (this script in a worktree of each)")
        return 1
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the trainer's share of the cores)")
    parser.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    parser.add_argument("--guard", action="store_true", help="as configured only, against the recorded MFU")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        print(json.dumps(worker(args.worker, overrides)))
        return 0
    from bench_importance_sampling import default_batch

    from grpo.config import load_config
    from grpo.model.flops import ModelShape, measure_matmul_rate
    from grpo.model.loading import load_policy
    from grpo.wire.codec import encode_batch

    cfg = load_config(ROOT / "config.yaml", overrides)
    torch.manual_seed(cfg.seed)
    model = load_policy(cfg).eval()
    ceiling = measure_matmul_rate(ModelShape.of(model)) / 1e9  # before anything else runs
    batch_path = Path(tempfile.mkdtemp(prefix="bench_trainer_")) / "batch.json"
    batch_path.write_text(json.dumps([frame.hex() for frame in encode_batch(default_batch(cfg, model))]))
    del model  # the variants load their own
    chosen = ["as configured"] if args.guard else args.only.split(",") if args.only else list(VARIANTS)
    variants = {name: v for name, v in VARIANTS.items() if name in chosen}
    results: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, (extra, env) in variants.items():
            out = subprocess.run([sys.executable, __file__, "--worker", str(batch_path), "--threads", str(args.threads),
                                  *overrides, *extra], capture_output=True, text=True, check=True, cwd=ROOT,
                                 env={**os.environ, **env})
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = next(iter(variants))
    base_s = statistics.median(r["seconds"] for r in results[first])
    base_rss = max(r["peak_rss"] for r in results[first])
    print(f"# {args.threads} thread(s); fp32 matmul ceiling on the model's shapes {ceiling:.1f} GFLOP/s; "
          f"step model FLOPs {results[first][0]['model_flops'] / 1e9:.0f} G; {args.repeats} repeats, alternating")
    print("| variant | micro-batches | step s (median) | kernel s | page faults | model GFLOP/s | MFU | peak RSS MiB "
          "| time / first | RSS / first |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        s = statistics.median(r["seconds"] for r in runs)
        rate = runs[0]["model_flops"] / 1e9 / s
        rss = max(r["peak_rss"] for r in runs)
        kernel = statistics.median(r["kernel_s"] for r in runs)
        faults = statistics.median(r["page_faults"] for r in runs)
        print(f"| {name} | {runs[0]['micro_batches']} | {s:.2f} | {kernel:.2f} | {faults:,.0f} | "
              f"{rate:.1f} | {rate / ceiling:.0%} | "
              f"{rss / 2**20:.0f} | {s / base_s:.2f} | {rss / base_rss:.2f} |")
    if args.guard:
        return guard(results[first][0]["model_flops"] / 1e9 / base_s / ceiling)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
