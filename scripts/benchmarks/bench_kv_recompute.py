"""The HF engine's KV recompute after an in-flight weight load: each group's prompt computed once (its
sequences go on from its KV) against every sequence's whole history computed again; and the continuous
loop's attention mask grown in place against concatenated whole each decode step.

    .venv/bin/python scripts/benchmarks/bench_kv_recompute.py                      # 8 prompts x G=8, prompt 512
    .venv/bin/python scripts/benchmarks/bench_kv_recompute.py --prompt 1024 --tokens 128 --rounds 3

A random Qwen2-shaped model (`--layers` layers, hidden `--hidden`), `--prompts` prompts of `--prompt` tokens, G
completions each of `--tokens` tokens (the EOS id is past the vocabulary: every row decodes to the end), all
rows in one batch. At decode step `--load-at` the engine is told a new version is loaded (the weights stay the
same, so both variants must draw the same tokens: checked) and recomputes every cached column. The variants
alternate in each round, in one process, under one seed. Printed: the recompute's seconds each way and their
ratio, the tokens its forwards computed, and the mask's milliseconds a decode step each way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

VOCAB = 4096


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512, help="prompt length")
    parser.add_argument("--tokens", type=int, default=64, help="completion length")
    parser.add_argument("--load-at", type=int, default=48, help="the decode step at which the load happens")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


class Tokens:
    """What the engine reads of a tokenizer: ids only; its EOS is past the vocabulary, never drawn."""
    pad_token_id, eos_token_id = 0, VOCAB + 1


def engine_of(args):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.config import load_config
    from grpo.sampler.rollout.hf_engine import HFEngine

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                         num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=8192, eos_token_id=None, pad_token_id=0, bos_token_id=1,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config).eval()
    rows = args.prompts * args.group_size
    cfg = load_config(None, [f"sampling.max_new_tokens={args.tokens}", f"sampling.generation_batch_size={rows}",
                             "sampling.temperature=1.0", "sampling.in_flight_updates=true",
                             "sampling.old_logps=generation"]).sampling
    engine = HFEngine(model, Tokens(), cfg)
    steps = []

    def poll() -> bool:  # a load at one decode step of each generate call; the weights stay the same
        steps.append(engine.decode_rows.steps)
        return len(steps) == args.load_at
    engine.poll_weights, engine.polls = poll, steps
    return engine


def timed(engine, prompts, args, variant):
    """(the recompute's seconds, the tokens its forwards computed, the mask's ms a decode step, completions)."""
    import torch

    import grpo.sampler.rollout.continuous as continuous
    import grpo.sampler.rollout.loop_cache as loop_cache

    shipped_length, shipped_append = loop_cache.prompt_length, continuous.append_columns
    fed, mask_s = [], [0.0]

    def count(_, __, kwargs):
        mask = kwargs["attention_mask"]
        fed.append(int(mask[:, mask.shape[1] - kwargs["input_ids"].shape[1]:].sum()))

    def concatenated(mask, new):
        return torch.cat([mask, new], dim=1)
    append = shipped_append if variant == "shared" else concatenated

    def timed_append(mask, new):
        t = time.perf_counter()
        out = append(mask, new)
        mask_s[0] += time.perf_counter() - t
        return out
    if variant != "shared":
        loop_cache.prompt_length = lambda s: 0  # every history computed whole
    continuous.append_columns = timed_append
    recompute, counting = loop_cache.LoopCache._recompute_kv, [False]

    def counted(loop):
        counting[0] = True
        try:
            recompute(loop)
        finally:
            counting[0] = False
    hook = engine.model.register_forward_pre_hook(lambda m, a, k: count(m, a, k) if counting[0] else None,
                                                  with_kwargs=True)
    loop_cache.LoopCache._recompute_kv = counted
    try:
        engine.polls.clear()
        engine.decode_rows.take()
        got = engine.generate(prompts, args.group_size, seed=5)
    finally:
        hook.remove()
        loop_cache.LoopCache._recompute_kv = recompute
        loop_cache.prompt_length, continuous.append_columns = shipped_length, shipped_append
    metrics = engine.decode_rows.take()
    steps = metrics["sampler/decode_steps"]
    return (metrics["timing/kv_recompute_s"], sum(fed), mask_s[0] / steps * 1000,
            [c.tolist() for c in got.completion_ids], got.logps)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    engine = engine_of(args)
    prompts = [[2 + (7 * i + 13 * p) % (VOCAB - 10) for i in range(args.prompt)] for p in range(args.prompts)]
    print(f"{args.prompts} prompts of {args.prompt} tokens x G={args.group_size}, {args.tokens} tokens each, the "
          f"load at decode step {args.load_at}; Qwen2-shaped, {args.layers} layers, hidden {args.hidden}, "
          f"{args.threads} threads")
    timed(engine, prompts, args, "shared")  # warm-up
    measured, drawn, logps = {"whole": [], "shared": []}, {}, {}
    for r in range(args.rounds):
        for variant in ("whole", "shared") if r % 2 == 0 else ("shared", "whole"):
            seconds, tokens, mask_ms, drawn[variant], logps[variant] = timed(engine, prompts, args, variant)
            measured[variant].append((seconds, tokens, mask_ms))
    if drawn["whole"] != drawn["shared"]:
        raise SystemExit("the two variants drew different tokens")
    gap = max(float((a - b).abs().max()) for a, b in zip(logps["whole"], logps["shared"]))
    (before, before_tokens, before_mask), (after, after_tokens, after_mask) = (
        (statistics.median(m[0] for m in measured[v]), measured[v][0][1], statistics.median(m[2] for m in measured[v]))
        for v in ("whole", "shared"))
    print("| | every history whole, mask concatenated | each prompt once, mask in place | ratio |")
    print("|---|---:|---:|---:|")
    print(f"| KV recompute (s) | {before:.3f} | {after:.3f} | {before / after:.2f}x |")
    print(f"| tokens it computed | {before_tokens} | {after_tokens} | {before_tokens / after_tokens:.2f}x |")
    print(f"| attention mask (ms a decode step) | {before_mask:.3f} | {after_mask:.3f} | "
          f"{before_mask / after_mask:.1f}x |")
    print(f"largest log-prob gap between the variants: {gap:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
