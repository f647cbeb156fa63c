"""What importance-sampling correction costs the trainer: one training forward + backward of a
real batch with `training.importance_sampling=none` and with each correction, side by side.

    .venv/bin/python scripts/benchmarks/bench_importance_sampling.py [--repeats 3] [key=value ...]

The batch is one default sampler step on the embedded SmolLM2 (2 prompts x 8 completions, up to
200 tokens, HF engine, old log-probs as recorded). The decoupled objective takes the proximal
log-probs from the trainer's own forward of the step (`training.num_iterations` must be 1), so
a correction adds no forward pass, only elementwise work on the [completions, tokens] tensors;
the ratios printed here measure that. The variants alternate, so drift hits them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from grpo.config import Config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def default_batch(cfg: Config, model):
    """One sampler step of `model` (HF engine) on the first prompts_per_step train problems after
    the few-shot ones: the real batch the trainer benchmarks here work on."""
    from grpo.data.problems import load_split
    from grpo.data.prompts import build_prompts
    from grpo.model.loading import load_tokenizer
    from grpo.sampler.batches import SamplerModels, make_batch
    from grpo.sampler.rollout.hf_engine import HFEngine

    tokenizer = load_tokenizer(cfg.model)
    problems = load_split(cfg.data, cfg.data.split)[0][:cfg.data.few_shot + cfg.sampling.prompts_per_step]
    prompts, _ = build_prompts(tokenizer, cfg.data, problems)  # the shots themselves are not asked
    policy = SamplerModels.of(cfg, HFEngine(model, tokenizer, cfg.sampling), model, None, tokenizer, {})
    with torch.no_grad():
        return make_batch(cfg, policy, prompts, step=0, metrics_so_far={},
                          measure_logp_gap=False)


def main(argv: list[str]) -> int:
    from grpo.config import load_config
    from grpo.model.loading import load_policy
    from grpo.trainer.training_step import micro_batch_loss

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(ROOT / "config.yaml", overrides)
    torch.manual_seed(cfg.seed)
    model = load_policy(cfg).train()
    batch = default_batch(cfg, model)
    tokens = sum(len(c) for c in batch.completion_ids)
    print(f"# {torch.get_num_threads()} threads; batch: {len(batch.completion_ids)} completions, {tokens} tokens")

    micro_batch_loss(model, batch, cfg)[0].backward()  # warm-up, not timed
    model.zero_grad(set_to_none=True)
    seconds: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            variant = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, importance_sampling=mode))
            t = time.perf_counter()
            loss, _, _ = micro_batch_loss(model, batch, variant)
            loss.backward()
            seconds[mode].append(time.perf_counter() - t)
            model.zero_grad(set_to_none=True)
    base = statistics.median(seconds["none"])
    print("| training.importance_sampling | forward + backward s (median) | / none |")
    print("|---|---|---|")
    for mode in MODES:
        median = statistics.median(seconds[mode])
        print(f"| {mode} | {median:.2f} | {median / base:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
