"""Old-policy log-probs read off generation vs recomputed after it, side by side.

    .venv/bin/python scripts/bench_old_logps.py [--repeats 2] [key=value ...]

The sampler's generate + old log-probs on the configured model (the embedded SmolLM2-135M
with a LoRA adapter that looks trained), the first `sampling.prompts_per_step` prompts of the
configured data, G and completion limit as configured. `recompute`: `generate`, then the
shared-prefix forward over the completions; `generation`: `generate` recording the log-prob of
each token it draws. Both draw the same completions (same seed); the variants alternate and
the medians are printed with their ratio and the largest log-prob difference.
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", default=str(ROOT / "config.yaml"))
    args, overrides = parser.parse_known_args(argv)

    import torch

    from data.gsm8k import load_problems
    from data.prompts import build_prompts
    from grpo.config import parse_cli
    from grpo.logprobs import completion_logprobs
    from grpo.models import load_policy, load_tokenizer
    from grpo.rollout.hf_engine import HFEngine

    cfg = parse_cli(["--config", args.config, *overrides])
    s = cfg.sampling
    torch.manual_seed(0)
    model = load_policy(cfg).eval()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)  # a trained-looking adapter
    tokenizer = load_tokenizer(cfg.model)
    problems, _ = load_problems(cfg.data.path, cfg.data.split)
    prompts, _ = build_prompts(tokenizer, cfg.data, problems[:s.prompts_per_step])
    prompt_ids = [p.token_ids for p in prompts]
    engine = HFEngine(model, tokenizer, s)

    def step(variant: str):
        t = time.perf_counter()
        rollouts = engine.generate(prompt_ids, s.group_size, seed=0, record_logps=variant == "generation")
        generated = time.perf_counter()
        if variant == "generation":
            logps = rollouts.engine_logps
        else:
            with torch.no_grad():
                logps = completion_logprobs(model, [torch.tensor(p) for p in prompt_ids], rollouts.completion_ids,
                                            [s.group_size] * len(prompt_ids), temperature=s.temperature)
        return time.perf_counter() - t, generated - t, rollouts.completion_ids, logps

    times = {"recompute": [], "generation": []}
    results = {}
    for r in range(args.repeats):
        for variant in ("generation", "recompute") if r % 2 else ("recompute", "generation"):
            total, generate_s, completions, logps = step(variant)
            times[variant].append((total, generate_s))
            results[variant] = (completions, logps)
    same = all(torch.equal(a, b) for a, b in zip(results["recompute"][0], results["generation"][0]))
    diff = max((a - b).abs().max().item() for a, b in zip(results["recompute"][1], results["generation"][1]))
    tokens = sum(len(c) for c in results["recompute"][0])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(prompt_ids)} prompts x G {s.group_size}, "
          f"{tokens} completion tokens, median of {args.repeats}; same completions: {same}; "
          f"max |log-prob difference| {diff:.1e}")
    print("| old log-probs | generate + old log-probs s | of which generate s | completion tokens/s |")
    print("| --- | --- | --- | --- |")
    median = {v: (statistics.median(t for t, _ in x), statistics.median(g for _, g in x)) for v, x in times.items()}
    for variant, (total, generate_s) in median.items():
        print(f"| {variant} | {total:.2f} | {generate_s:.2f} | {tokens / total:.1f} |")
    print(f"speed-up of generation over recompute: {median['recompute'][0] / median['generation'][0]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
