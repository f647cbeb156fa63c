"""The repetition penalty's seen tokens in the HF engine's continuous loop: kept with the batch (built at a
regroup, each step's feed set in) against read from every row's whole history each decode step.

    .venv/bin/python scripts/benchmarks/bench_penalty_seen.py                     # 64 rows, contexts of 512 and 4096
    .venv/bin/python scripts/benchmarks/bench_penalty_seen.py --contexts 1024,8192 --tokens 32 --rounds 3

A random 2-layer model (hidden 64) with Qwen2.5's vocabulary size (151,936); `--rows` completions of one prompt
of each `--contexts` length, `--tokens` long (the EOS id is past the vocabulary: every row decodes to the end),
`sampling.repetition_penalty=1.1`. The two variants alternate in each round, in one process on the same
threads, under the same seed: they draw the same tokens (checked). Printed per context: the milliseconds a
decode step spends on the seen tokens each way (timed inside the loop), the whole step's, and the ratios.
On a CPU the whole step is mostly sampling over the vocabulary; on a GPU, where a step takes milliseconds, the
bookkeeping's CPU time is what it adds to every step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VOCAB = 151_936


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--contexts", default="512,4096", help="prompt lengths, comma-separated")
    parser.add_argument("--tokens", type=int, default=24, help="completion length")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def model_and_engine(rows: int, tokens: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo.config import load_config
    from grpo.sampler.rollout.hf_engine import HFEngine

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         eos_token_id=None, pad_token_id=0, bos_token_id=1, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    cfg = load_config(None, [f"sampling.max_new_tokens={tokens}", f"sampling.generation_batch_size={rows}",
                             "sampling.temperature=1.0", "sampling.repetition_penalty=1.1"]).sampling
    return HFEngine(model, Tokens(), cfg)


class Tokens:
    """What the engine reads of a tokenizer: ids only (no text is decoded without sampling.stop); its EOS is
    past the vocabulary, never drawn: every row decodes to the end."""
    pad_token_id, eos_token_id = 0, VOCAB + 1


def rebuilt_every_step(loop, fed, vocab):
    """The variant before: every row's seen tokens read from its whole history at each decode step."""
    from grpo.sampler.rollout.decoding import seen_tokens

    loop.seen, loop.seen_for = seen_tokens([s.history for s in loop.rows], vocab, loop.device), loop.rows


def timed(engine, prompt, rows, variant):
    """(ms a decode step spends on the seen tokens, ms a decode step in all, the completions)."""
    from grpo.sampler.rollout.continuous import ContinuousLoop

    shipped, spent = ContinuousLoop._see, [0.0]
    chosen = shipped if variant == "kept" else rebuilt_every_step

    def see(loop, fed, vocab):
        t = time.perf_counter()
        chosen(loop, fed, vocab)
        spent[0] += time.perf_counter() - t
    ContinuousLoop._see = see
    try:
        engine.decode_rows.take()
        t = time.perf_counter()
        got = engine.generate([prompt], rows, seed=5)
        seconds = time.perf_counter() - t
    finally:
        ContinuousLoop._see = shipped
    steps = engine.decode_rows.take()["sampler/decode_steps"]
    return spent[0] / steps * 1000, seconds / steps * 1000, [c.tolist() for c in got.completion_ids]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    print(f"{args.rows} rows, {args.tokens} tokens each, vocabulary {VOCAB}, {args.threads} threads")
    print("| context | seen tokens, rebuilt (ms/step) | kept (ms/step) | ratio | step, rebuilt (ms) | kept (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    engine = model_and_engine(args.rows, args.tokens)
    for context in (int(c) for c in args.contexts.split(",")):
        prompt = [2 + (7 * i) % (VOCAB - 10) for i in range(context)]
        timed(engine, prompt, args.rows, "kept")  # warm-up
        measured = {"rebuilt": [], "kept": []}
        drawn = {}
        for r in range(args.rounds):
            for variant in ("rebuilt", "kept") if r % 2 == 0 else ("kept", "rebuilt"):
                seen_ms, step_ms, drawn[variant] = timed(engine, prompt, args.rows, variant)
                measured[variant].append((seen_ms, step_ms))
        if drawn["rebuilt"] != drawn["kept"]:
            raise SystemExit("the two variants drew different tokens")
        (before, before_step), (after, after_step) = (
            (statistics.median(m[0] for m in measured[v]), statistics.median(m[1] for m in measured[v]))
            for v in ("rebuilt", "kept"))
        print(f"| {context} | {before:.2f} | {after:.3f} | {before / after:.0f}x | {before_step:.0f} | "
              f"{after_step:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
