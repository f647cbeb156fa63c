"""The HF engine's decode step by rows per step: why generation's MFU depends on the batch.

    .venv/bin/python scripts/benchmarks/bench_decode_rows.py                        # 1 thread, 16, 32, 64 rows
    .venv/bin/python scripts/benchmarks/bench_decode_rows.py --rows 8,16,32,64,128 --threads 2
    .venv/bin/python scripts/benchmarks/bench_decode_rows.py --rows 16,64 --compile  # eager and compiled, side by side

The default config's model with its LoRA adapter and the default workload's first 2 prompts
(2 solved examples, ~330 tokens), prefilled once and repeated rows / 2 ways into the engine's
in-place KV cache, then `--steps` decode steps of the engine's own loop (sampling at the config's
temperature), all row counts alternating over `--rounds`. Per row count: ms per decode step, the
model GFLOP of a step (every linear map, the adapters and the LM head on each row, attention over
the keys so far: grpo/model/flops.py), GFLOP/s, MFU against the fp32 matmul ceiling measured first on the
same threads, and the rate at which a step reads the model's weights (all weight matrices once a
step / step time: far below the memory's rate here, so a few-row step is bound by small-batch
matmul efficiency and per-op overhead, not by memory bandwidth; docs/notes/generation.md).
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="16,32,64", help="rows per decode step, comma-separated (even: 2 prompts)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also time the forward under torch.compile")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model.dtype=bfloat16")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    bench = DecodeBench(args)
    counts = [int(r) for r in args.rows.split(",")]
    variants = ["eager", "compiled"] if args.compile else ["eager"]
    runs = [(variant, rows) for rows in counts for variant in variants]
    measured = {run: [] for run in runs}
    for run in runs if args.compile else runs[:1]:  # warm-up: the compile, and a recompile per new shape
        bench.decode(run[1], run[0])
    for r in range(args.rounds):
        for variant, rows in runs if r % 2 == 0 else runs[::-1]:
            measured[variant, rows].append(bench.decode(rows, variant))
    report(bench, args, runs, measured)
    return 0


class DecodeBench:
    """The engine's decode loop on two prompts of the default data, at any number of rows."""

    def __init__(self, args):
        import torch

        from grpo.config import load_config
        from grpo.data.problems import load_split
        from grpo.data.prompts import build_prompts
        from grpo.model.flops import ModelShape, measure_matmul_rate
        from grpo.model.loading import add_lora, load_model, load_tokenizer
        from grpo.sampler.rollout.decoding import left_pad
        from grpo.sampler.rollout.hf_engine import HFEngine

        self.args, self.cfg = args, load_config(ROOT / "config.yaml", args.overrides)
        tokenizer = load_tokenizer(self.cfg.model)
        self.model = add_lora(load_model(self.cfg.model), self.cfg.lora).eval()
        self.shape = ModelShape.of(self.model)
        self.ceiling = measure_matmul_rate(self.shape) / 1e9
        prompts, _ = build_prompts(tokenizer, self.cfg.data, load_split(self.cfg.data, self.cfg.data.split)[0][:64])
        self.prompts = prompts[:2]
        self.engine = HFEngine(self.model, tokenizer, self.cfg.sampling)
        self.ids, self.mask = left_pad([p.token_ids for p in self.prompts], tokenizer.pad_token_id)
        self.prefill = self.engine._prefill(self.ids, self.mask)
        s = self.shape
        self.weight_bytes = (s.matmul_params + s.adapter_params + s.hidden * s.vocab) * self.model.dtype.itemsize
        self.eager_forward = self.model.forward
        self.compiled_forward = torch.compile(self.eager_forward, dynamic=True) if args.compile else None

    def decode(self, rows: int, variant: str = "eager") -> tuple[float, float]:
        """(seconds, GFLOP) per decode step of one run at `rows` rows."""
        import torch

        from grpo.sampler.rollout.decoding import TokenSampler
        from grpo.sampler.rollout.hf_engine import repeat_in_place

        self.model.forward = self.compiled_forward if variant == "compiled" else self.eager_forward
        k, shape = rows // len(self.prompts), self.shape
        cache = repeat_in_place(self.prefill, k)
        limits = torch.full((rows,), self.args.steps)
        start = time.perf_counter()
        out = self.engine._decode(self.ids.repeat_interleave(k, 0), self.mask.repeat_interleave(k, 0), cache,
                                  TokenSampler(self.cfg.sampling.temperature), limits)
        seconds = time.perf_counter() - start
        first = self.ids.shape[1] - 1  # keys before the first decoded token: the prompt but its last token
        steps = out.shape[1]
        flops = steps * rows * (2 * (shape.matmul_params + shape.adapter_params) + shape.head_flops(1))
        flops += rows * shape.attention_flops(first, steps)
        return seconds / steps, flops / steps / 1e9


def report(bench: DecodeBench, args, runs: list, measured: dict) -> None:
    def median_seconds(variant: str, rows: int) -> float:
        return statistics.median(s for s, _ in measured[variant, rows])

    print(f"# {args.threads} thread(s), {bench.model.dtype}; ceiling (fp32 matmuls of the model's shapes) "
          f"{bench.ceiling:.1f} GFLOP/s; prompts of {bench.ids.shape[1]} tokens (padded), {args.steps} decode steps, "
          f"median of {args.rounds}; weights read per step {bench.weight_bytes / 2**20:.0f} MiB")
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
              f"{gflop / seconds / bench.ceiling:.0%} | {bench.weight_bytes / seconds / 1e9:.1f} | {rate:.0f}, "
              f"{rate / base:.2f}x |")
    if args.compile:
        for rows in sorted({rows for _, rows in runs}):
            ratio = median_seconds("eager", rows) / median_seconds("compiled", rows)
            print(f"compiled / eager at {rows} rows: {ratio:.2f}x tokens/s")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
