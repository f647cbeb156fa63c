"""The sampler's generate + old log-probs, three ways side by side.

    .venv/bin/python scripts/benchmarks/bench_old_logps.py [--repeats 2] [key=value ...]

On the configured model (the embedded SmolLM2-135M with a LoRA adapter that looks trained),
the first `sampling.prompts_per_step` prompts of the configured data, G and completion limit
as configured:
- `multinomial + recompute`: transformers' sampling (torch.multinomial), then the shared-prefix
  forward over the completions (what the sampler did before);
- `inverse-CDF + recompute`: our TokenSampler, then the same forward (sampling.old_logps=recompute);
- `inverse-CDF + recorded`: our TokenSampler recording each drawn token's log-prob
  (sampling.old_logps=generation).
The last two draw the same completions (same seed). Variants alternate; medians are printed
with ratios and the largest log-prob difference between recorded and recomputed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from grpo.config import parse_cli  # noqa: E402
from grpo.data.problems import load_split  # noqa: E402
from grpo.data.prompts import build_prompts  # noqa: E402
from grpo.model.completions import cut_at_eos  # noqa: E402
from grpo.model.loading import load_policy, load_tokenizer  # noqa: E402
from grpo.model.logprobs import completion_logprobs  # noqa: E402
from grpo.sampler.rollout.decoding import left_pad  # noqa: E402
from grpo.sampler.rollout.hf_engine import HFEngine  # noqa: E402

if TYPE_CHECKING:
    from grpo.config import Config

VARIANTS = ("multinomial + recompute", "inverse-CDF + recompute", "inverse-CDF + recorded")


def setup(cfg: Config) -> tuple:
    """The policy with a trained-looking adapter, its tokenizer, and the first prompts' token ids."""
    torch.manual_seed(0)
    model = load_policy(cfg).eval()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    tokenizer = load_tokenizer(cfg.model)
    problems, _ = load_split(cfg.data, cfg.data.split)
    # the few-shot examples are never asked: take enough rows to keep prompts_per_step
    prompts, _ = build_prompts(tokenizer, cfg.data, problems[:cfg.data.few_shot + cfg.sampling.prompts_per_step])
    return model, tokenizer, [p.token_ids for p in prompts]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--config", default=str(ROOT / "config.yaml"))
    args, overrides = parser.parse_known_args(argv)

    cfg = parse_cli(["--config", args.config, *overrides])
    sampling = cfg.sampling
    model, tokenizer, prompt_ids = setup(cfg)
    engine = HFEngine(model, tokenizer, sampling)

    def multinomial_generate():
        """The engine's prefill-once generation with transformers' own sampling."""
        ids, mask = left_pad(prompt_ids, tokenizer.pad_token_id)
        cache = engine._prefill(ids, mask)
        cache.batch_repeat_interleave(sampling.group_size)
        torch.manual_seed(0)
        with torch.no_grad():
            out = model.generate(input_ids=ids.repeat_interleave(sampling.group_size, 0),
                                 attention_mask=mask.repeat_interleave(sampling.group_size, 0), past_key_values=cache,
                                 max_new_tokens=sampling.max_new_tokens, do_sample=True,
                                 temperature=sampling.temperature,
                                 top_p=sampling.top_p, top_k=sampling.top_k or None, eos_token_id=engine.eos_ids,
                                 pad_token_id=tokenizer.pad_token_id)
        return [cut_at_eos(row, engine.eos_ids)[0] for row in out[:, ids.shape[1]:]]

    def step(variant: str):
        t = time.perf_counter()
        if variant == VARIANTS[0]:
            completions = multinomial_generate()
        else:
            rollouts = engine.generate(prompt_ids, sampling.group_size, seed=0)  # always records; the variant decides
            completions = rollouts.completion_ids
        generated = time.perf_counter()
        if variant == VARIANTS[2]:
            logps = rollouts.logps
        else:
            with torch.no_grad():
                logps = completion_logprobs(model, [torch.tensor(p) for p in prompt_ids], completions,
                                            [sampling.group_size] * len(prompt_ids), temperature=sampling.temperature)
        tokens = sum(len(c) for c in completions)
        return time.perf_counter() - t, generated - t, tokens, completions, logps

    times = {v: [] for v in VARIANTS}
    results = {}
    for r in range(args.repeats):
        for variant in VARIANTS if r % 2 == 0 else VARIANTS[::-1]:
            total, generate_s, tokens, completions, logps = step(variant)
            times[variant].append((total, generate_s, tokens))
            results[variant] = (completions, logps)
    ours_recompute, ours_recorded = results[VARIANTS[1]], results[VARIANTS[2]]
    same = all(torch.equal(a, b) for a, b in zip(ours_recompute[0], ours_recorded[0]))
    diff = max((a - b).abs().max().item() for a, b in zip(ours_recompute[1], ours_recorded[1]))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(prompt_ids)} prompts x G "
          f"{sampling.group_size}, up to {sampling.max_new_tokens} tokens, median of {args.repeats}; "
          "recorded vs recomputed: same "
          f"completions {same}, max |log-prob difference| {diff:.1e}")
    print_table(times)
    return 0


def print_table(times: dict[str, list[tuple[float, float, int]]]) -> None:
    """Medians per variant of (seconds, of which generating, completion tokens), with the speed-up."""
    print("| sampling + old log-probs | seconds | of which generate | completion tokens | tokens/s | speed-up |")
    print("| --- | --- | --- | --- | --- | --- |")
    rate = {v: statistics.median(n / t for t, _, n in x) for v, x in times.items()}
    for variant, x in times.items():
        print(f"| {variant} | {statistics.median(t for t, _, _ in x):.2f} "
              f"| {statistics.median(g for _, g, _ in x):.2f} "
              f"| {statistics.median(n for _, _, n in x):.0f} | {rate[variant]:.1f} "
              f"| {rate[variant] / rate[VARIANTS[0]]:.2f}x |")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
