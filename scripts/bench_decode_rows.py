"""The HF engine's decode step by rows per step: why generation's MFU depends on the batch.

    .venv/bin/python scripts/bench_decode_rows.py                        # 1 thread, 16, 32, 64 rows
    .venv/bin/python scripts/bench_decode_rows.py --rows 8,16,32,64,128 --threads 2
    .venv/bin/python scripts/bench_decode_rows.py --rows 16,64 --compile  # eager and compiled, side by side

The default config's model with its LoRA adapter and the default workload's first 2 prompts
(2 solved examples, ~330 tokens), prefilled once and repeated rows / 2 ways into the engine's
in-place KV cache, then `--steps` decode steps of the engine's own loop (sampling at the config's
temperature), all row counts alternating over `--rounds`. Per row count: ms per decode step, the
model GFLOP of a step (every linear map, the adapters and the LM head on each row, attention over
the keys so far: grpo/flops.py), GFLOP/s, MFU against the fp32 matmul ceiling measured first on the
same threads, and the rate at which a step reads the model's weights (all weight matrices once a
step / step time: far below the memory's rate here, so a few-row step is bound by small-batch
matmul efficiency and per-op overhead, not by memory bandwidth; docs/performance.md).
`--compile` also runs each row count with the model's forward under `torch.compile` (dynamic
shapes: the cache grows every token), alternating with the eager forward, and prints the ratio;
the compile itself (minutes on the CPU) is in the untimed warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32,64", help="rows per decode step, comma-separated (even: 2 prompts)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also time the forward under torch.compile")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model.dtype=bfloat16")
    args = parser.parse_args(argv)

    import torch

    from data.problems import load_split
    from data.prompts import build_prompts
    from grpo.config import load_config
    from grpo.flops import ModelShape, measure_matmul_rate
    from grpo.models import add_lora, load_model, load_tokenizer
    from grpo.rollout.hf_engine import HFEngine, TokenSampler, left_pad, repeat_in_place

    torch.set_num_threads(args.threads)
    cfg = load_config(ROOT / "config.yaml", args.overrides)
    tokenizer = load_tokenizer(cfg.model)
    model = add_lora(load_model(cfg.model), cfg.lora).eval()
    shape = ModelShape.of(model)
    ceiling = measure_matmul_rate(shape) / 1e9
    prompts, _ = build_prompts(tokenizer, cfg.data, load_split(cfg.data, cfg.data.split)[0][:64])
    prompts = prompts[:2]
    engine = HFEngine(model, tokenizer, cfg.sampling)
    ids, mask = left_pad([p.token_ids for p in prompts], tokenizer.pad_token_id)
    prefill = engine._prefill(ids, mask)
    weight_bytes = (shape.matmul_params + shape.adapter_params + shape.hidden * shape.vocab) * model.dtype.itemsize

    eager_forward = model.forward
    compiled_forward = torch.compile(eager_forward, dynamic=True) if args.compile else None

    def decode(rows: int, variant: str = "eager") -> tuple[float, int]:
        """(seconds, GFLOP) of the decode steps of one run at `rows` rows."""
        model.forward = compiled_forward if variant == "compiled" else eager_forward
        k = rows // len(prompts)
        cache = repeat_in_place(prefill, k)
        limits = torch.full((rows,), args.steps)
        sampler = TokenSampler(cfg.sampling.temperature)
        start = time.perf_counter()
        out = engine._decode(ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0), cache, sampler, limits)
        seconds = time.perf_counter() - start
        first = ids.shape[1] - 1  # keys before the first decoded token: the prompt but its last token
        steps = out.shape[1]
        flops = steps * rows * (2 * (shape.matmul_params + shape.adapter_params) + shape.head_flops(1))
        flops += rows * shape.attention_flops(first, steps)
        return seconds / steps, flops / steps / 1e9

    counts = [int(r) for r in args.rows.split(",")]
    variants = ["eager", "compiled"] if args.compile else ["eager"]
    runs = [(variant, rows) for rows in counts for variant in variants]
    measured = {run: [] for run in runs}
    for run in runs if args.compile else runs[:1]:  # warm-up: the compile, and a recompile per new shape
        decode(run[1], run[0])
    for r in range(args.rounds):
        for variant, rows in runs if r % 2 == 0 else runs[::-1]:
            measured[variant, rows].append(decode(rows, variant))

    def median_seconds(variant: str, rows: int) -> float:
        return statistics.median(s for s, _ in measured[variant, rows])

    print(f"# {args.threads} thread(s), {model.dtype}; ceiling (fp32 matmuls of the model's shapes) {ceiling:.1f} "
          f"GFLOP/s; prompts of {ids.shape[1]} tokens (padded), {args.steps} decode steps, median of {args.rounds}; "
          f"weights read per step {weight_bytes / 2**20:.0f} MiB")
    print("| rows per step | forward | ms per step | GFLOP per step | GFLOP/s | MFU | weights read GB/s | "
          "tokens/s, / the first |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for variant, rows in runs:
        seconds = median_seconds(variant, rows)
        gflop = statistics.median(g for _, g in measured[variant, rows])
        rate = rows / seconds
        base = base or rate
        print(f"| {rows} | {variant} | {seconds * 1e3:.1f} | {gflop:.2f} | {gflop / seconds:.1f} | "
              f"{gflop / seconds / ceiling:.0%} | {weight_bytes / seconds / 1e9:.1f} | {rate:.0f}, {rate / base:.2f}x |")
    if args.compile:
        for rows in counts:
            ratio = median_seconds("eager", rows) / median_seconds("compiled", rows)
            print(f"compiled / eager at {rows} rows: {ratio:.2f}x tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
