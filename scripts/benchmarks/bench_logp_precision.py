"""How far the sampler's recorded log-probs are from the trainer's recompute, by model dtype, and what
the float32 log-softmax buys in bfloat16.

    .venv/bin/python scripts/benchmarks/bench_logp_precision.py [key=value ...]

On the configured model and the first `sampling.prompts_per_step` prompts: the HF engine generates
G completions and records each token's log-prob; the shared-prefix forward (the trainer's) recomputes
them. Printed per dtype: max and mean |recorded - recomputed| over the completion tokens; for
bfloat16 also the same logits through a bfloat16 log-softmax (what the fp32 upcast avoids).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from grpo.config import help_requested, parse_cli  # noqa: E402
from grpo.data.problems import load_split  # noqa: E402
from grpo.data.prompts import build_prompts  # noqa: E402
from grpo.model.loading import load_model, load_tokenizer  # noqa: E402
from grpo.model.logprobs import completion_logprobs  # noqa: E402
from grpo.sampler.rollout.hf_engine import HFEngine  # noqa: E402


def gaps(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    diff = torch.cat([(x.double() - y.double()).abs() for x, y in zip(a, b)])
    return diff.max().item(), diff.mean().item()


def main(argv: list[str]) -> int:
    if help_requested(argv, __doc__):
        return 0
    cfg = parse_cli(["--config", str(ROOT / "config.yaml"), *argv])
    sampling = cfg.sampling
    tokenizer = load_tokenizer(cfg.model)
    problems, _ = load_split(cfg.data, cfg.data.split)
    # shots: not asked
    prompts, _ = build_prompts(tokenizer, cfg.data, problems[:cfg.data.few_shot + sampling.prompts_per_step])
    ids = [p.token_ids for p in prompts]
    print(f"{len(ids)} prompts x G {sampling.group_size}, up to {sampling.max_new_tokens} tokens, "
          f"temperature {sampling.temperature}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype in ("float32", "bfloat16"):
        cfg.model.dtype = dtype
        model = load_model(cfg.model).eval()
        rollouts = HFEngine(model, tokenizer, sampling).generate(ids, sampling.group_size, seed=0)
        args = ([torch.tensor(p) for p in ids], rollouts.completion_ids, [sampling.group_size] * len(ids))
        with torch.no_grad():
            recomputed = completion_logprobs(model, *args, temperature=sampling.temperature)
        largest, mean = gaps(rollouts.logps, recomputed)
        print(f"{dtype}: recorded vs recomputed (float32 log-softmax in both): max {largest:.2e}, mean {mean:.2e}")
        if dtype == "bfloat16":
            with torch.no_grad():
                full = model(torch.tensor([ids[0] + rollouts.completion_ids[0].tolist()])).logits[0]
                full = full / sampling.temperature
            fp32 = torch.log_softmax(full.float(), -1)
            bf16 = torch.log_softmax(full.to(torch.bfloat16), -1).float()
            print(f"bfloat16: the same logits through a bfloat16 log-softmax instead of float32: max "
                  f"{(fp32 - bf16).abs().max().item():.2e}, mean {(fp32 - bf16).abs().mean().item():.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
