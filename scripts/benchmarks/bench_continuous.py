"""Continuous batching against the loops before it, side by side in one run, on either engine.

    .venv/bin/python scripts/benchmarks/bench_continuous.py long-tail [--steps 2] [overrides ...]
    python3 scripts/benchmarks/bench_continuous.py long-tail --config configs/qwen2.5-0.5b-gsm8k-1gpu.yaml \
        --steps 4 --eos-probability 0.02 model.name_or_path=DIR sampling.engine=hf sampling.max_new_tokens=200
    .venv/bin/python scripts/benchmarks/bench_continuous.py slow-env [--delay 1.0] [overrides ...]
    .venv-vllm/bin/python scripts/benchmarks/bench_continuous.py long-tail|slow-env sampling.engine=vllm

long-tail: the default config (the embedded model with its LoRA adapter, GSM8K prompts,
max_new_tokens 200) with B x G = 8 x 8 = 64 completions a step and generation_batch_size 32, `--steps`
steps in a row, three ways: `generate_in_blocks` (blocks: two blocks of 32 rows, each decoded until
its longest completion ends), `generate` (continuous: a finished row refilled at once with the
step's next completion), and `generate(then=the next step)` (across steps: the next step's completions
also fill the rows a step leaves free at its end, as the sampler does where sampling.max_staleness
lets the weights serve both). Generation tokens/s of each, and the ratios to blocks. `--eos-probability
P` gives the EOS token probability P at every position (its logit set from the others' logsumexp):
geometric lengths with a long tail, for a model with random weights (on a GPU, where no trained
model can be fetched).

slow-env: 16 episodes (4 prompts x 4) of an environment that answers each message after `--delay`
seconds and ends the episode after 1 to 5 messages (by prompt), on the same model, each episode at
most 256 tokens: continuous (16 environment calls at once, off the decode loop) against blocks (the
environment called in the loop, one call at a time), alternating. Episodes per second, and the ratio.

With sampling.engine=vllm (in .venv-vllm): long-tail's base is one call of vLLM's synchronous engine
(`vllm.LLM.generate`, a step's requests at once: vLLM refills within a step by itself) against the
async engine's requests, and across steps; slow-env's base is turn by turn (a step's turn of every
live episode as one `generate`, the environment called between turns, one call at a time) against
one task per episode. --eos-probability needs the HF engine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


class SlowTurns:
    """An environment answering each message after `delay` seconds, done after 1-5 messages (by the question)."""

    def __init__(self, row, delay: float = 1.0):
        self.delay, self.seen = delay, 0
        self.turns = 1 + zlib.crc32(str(row.get("question", "")).encode()) % 5

    def step(self, message: str):
        from grpo.environments import Reply

        time.sleep(self.delay)
        self.seen += 1
        if self.seen >= self.turns:
            return Reply(done=True, reward=1.0)
        return Reply(text="Check the arithmetic once more and give the answer again.")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["long-tail", "slow-env"])
    parser.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    parser.add_argument("--eos-probability", type=float, default=0.0, help="long-tail: EOS this likely at every token")
    parser.add_argument("--steps", type=int, default=2, help="steps per variant")
    parser.add_argument("--delay", type=float, default=1.0, help="slow-env: seconds per environment step")
    parser.add_argument("overrides", nargs="*", help="config overrides")
    return parser.parse_intermixed_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    from grpo.common.model_files import resolve_device
    from grpo.config import load_config
    from grpo.data.problems import load_split
    from grpo.data.prompts import build_prompts
    from grpo.model.loading import add_lora, load_model, load_tokenizer

    slow = args.workload == "slow-env"
    overrides = ["sampling.generation_batch_size=32", "sampling.group_size=4" if slow else "sampling.group_size=8",
                 *(["sampling.max_new_tokens=256", f"env.name={Path(__file__).resolve()}:SlowTurns",
                    f"env.args={{delay: {args.delay}}}", "env.max_turns=5", "env.timeout_s=30"] if slow else []),
                 *args.overrides]
    cfg = load_config(args.config, overrides)
    vllm = cfg.sampling.engine == "vllm"
    if vllm and args.eos_probability:
        raise SystemExit("--eos-probability needs sampling.engine=hf (it hooks the HF model's output layer)")
    tokenizer = load_tokenizer(cfg.model)
    model = add_lora(load_model(cfg.model, resolve_device(cfg.sampling.device)), cfg.lora).eval()
    if args.eos_probability:
        eos_at_every_token(model, tokenizer.eos_token_id, args.eos_probability)
    prompts, _ = build_prompts(tokenizer, cfg.data, load_split(cfg.data, cfg.data.split)[0][:256])
    per_step = 4 if slow else 8
    print(f"{args.workload} on {cfg.sampling.engine}: {torch.get_num_threads()} threads, {per_step} prompts x "
          f"{cfg.sampling.group_size} a step, "
          f"generation_batch_size {cfg.sampling.generation_batch_size}, max_new_tokens {cfg.sampling.max_new_tokens}"
          + (f", environment steps of {args.delay:g} s" if slow else ""), flush=True)
    run = Episodes(cfg, model, tokenizer) if slow else Completions(cfg, model, tokenizer)
    variants = ["continuous", run.base] if slow else ["across steps", "continuous", run.base]
    measured = {variant: [] for variant in variants}
    batches = [prompts[step * per_step:(step + 1) * per_step] for step in range(args.steps + 1)]
    try:  # variant by variant: the steps of one follow each other (across steps starts the next in the last)
        for variant in variants:
            for step in range(args.steps):
                then = batches[step + 1] if variant == "across steps" and step + 1 < args.steps else None
                measured[variant].append(run(variant, batches[step], seed=1000 + step, then=then))
                print(f"  step {step} {variant:12s} "
                      + ", ".join(f"{k} {v:.4g}" for k, v in measured[variant][-1].items()),
                      flush=True)
    finally:
        run.close()
    unit = "episodes_per_s" if slow else "tokens_per_s"
    rate = {variant: sum(m["done"] for m in rows) / sum(m["seconds"] for m in rows)
            for variant, rows in measured.items()}
    print(f"{unit}: " + ", ".join(f"{variant} {rate[variant]:.3g} ({rate[variant] / rate[run.base]:.2f}x {run.base})"
                                  for variant in variants))
    for variant, rows in measured.items():
        if vllm and slow and variant == "continuous":  # the turn-by-turn path counts no waits
            print(f"  {variant}: episodes waiting on environments "
                  f"{statistics.mean(m['env_waiting'] for m in rows):.1f}, "
                  f"vLLM idle while they waited {sum(m['env_idle_s'] for m in rows):.1f} s")
        if vllm:
            continue
        print(f"  {variant}: live rows per decode step {statistics.mean(m['live_rows'] for m in rows):.1f}, "
              f"full steps {statistics.mean(m['full_steps'] for m in rows):.0%}, decode steps "
              f"{statistics.mean(m['decode_steps'] for m in rows):.0f}")
    return 0


def eos_at_every_token(model, eos: int, p: float) -> None:
    """The model's EOS logit set so that EOS has probability `p` at every position."""
    import math

    import torch

    def hook(module, args, logits):
        logits[..., eos] = (torch.logsumexp(logits.float(), -1) + math.log(p / (1 - p))).to(logits.dtype)
        return logits
    model.get_output_embeddings().register_forward_hook(hook)


def decode_metrics(engine) -> dict[str, float]:
    m = engine.loop_metrics.take()
    return {"decode_steps": m.get("sampler/decode_steps", 0.0),
            "live_rows": m.get("sampler/live_rows_per_decode_step", 0.0),
            "full_steps": m.get("sampler/full_decode_step_fraction", 0.0),
            "env_idle_s": m.get("timing/env_idle_s", 0.0),
            "env_waiting": m.get("env/waiting_mean", 0.0)}


def synchronize(device) -> None:
    import torch

    if device is not None and device.type == "cuda":
        torch.cuda.synchronize()


class Completions:
    def __init__(self, cfg, model, tokenizer):
        from grpo.sampler.rollout import make_engine

        self.cfg, self.engine = cfg, make_engine(cfg, model, tokenizer)
        self.vllm = cfg.sampling.engine == "vllm"
        self.base = "LLM.generate" if self.vllm else "blocks"
        self.device = getattr(self.engine, "device", None)
        self.llm = None
        if self.vllm:  # vLLM's synchronous engine beside the async one, as its own generate runs a step
            import psutil
            import vllm

            from grpo.sampler.rollout.vllm_arguments import engine_arguments

            self.llm = vllm.LLM(**engine_arguments(cfg, False, psutil.virtual_memory().available))

    def __call__(self, variant: str, prompts: list, seed: int, then: list | None = None) -> dict[str, float]:
        from grpo.sampler.rollout.sequences import NextCall

        G = self.cfg.sampling.group_size
        self.engine.loop_metrics.take()
        synchronize(self.device)
        t = time.perf_counter()
        if variant == "blocks":
            out = self.engine.generate_in_blocks([p.token_ids for p in prompts], G, seed=seed)
        elif variant == "LLM.generate":
            out = self._llm_generate(prompts, seed)
        else:
            after = NextCall([p.token_ids for p in then], G, seed + 1) if then is not None else None
            out = self.engine.generate([p.token_ids for p in prompts], G, seed=seed, then=after)
        synchronize(self.device)
        seconds = time.perf_counter() - t
        tokens = sum(len(c) for c in out.completion_ids)
        return {"seconds": seconds, "done": tokens, "tokens": tokens, **decode_metrics(self.engine)}

    def _llm_generate(self, prompts: list, seed: int):
        """The step's G completions of each prompt as one `LLM.generate` (n = G per request), as the async
        engine seeds them."""
        from types import SimpleNamespace

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from grpo.sampler.rollout import prompt_seeds

        s = self.cfg.sampling
        params = [SamplingParams(n=s.group_size, temperature=s.temperature, max_tokens=s.max_new_tokens, logprobs=0,
                                 seed=first, stop_token_ids=self.engine.eos_ids)
                  for first in prompt_seeds(seed, len(prompts))]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p.token_ids) for p in prompts], params,
                                    use_tqdm=False)
        return SimpleNamespace(completion_ids=[c.token_ids for request in outputs for c in request.outputs])

    def close(self) -> None:
        if self.vllm:
            self.engine.close()
            self.llm.llm_engine.engine_core.shutdown()


class Episodes:
    def __init__(self, cfg, model, tokenizer):
        import dataclasses

        from grpo.sampler.episodes import episode_runner
        from grpo.sampler.rollout import make_engine
        from grpo.sampler.rollout.hf_engine import HFEngine

        self.cfg, self.vllm = cfg, cfg.sampling.engine == "vllm"
        self.base = "turn by turn" if self.vllm else "blocks"
        in_turn = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, continuous_batching=False))
        self.runners = {"continuous": episode_runner(cfg, tokenizer), self.base: episode_runner(in_turn, tokenizer)}
        if self.vllm:  # one engine: its `continuous` flag picks the loop
            engine = make_engine(cfg, model, tokenizer)
            self.engines = {"continuous": engine, self.base: engine}
        else:
            self.engines = {variant: HFEngine(model, tokenizer, runner_cfg.sampling) for variant, runner_cfg in (
                ("continuous", cfg), ("blocks", in_turn))}

    def __call__(self, variant: str, prompts: list, seed: int, then: list | None = None) -> dict[str, float]:
        engine = self.engines[variant]
        if self.vllm:
            engine.continuous = variant == "continuous"
        engine.loop_metrics.take()
        t = time.perf_counter()
        out = self.runners[variant].run(engine, prompts, self.cfg.sampling.group_size, seed=seed)
        seconds = time.perf_counter() - t
        turns = sum(e.turns for e in out.episodes)
        return {"seconds": seconds, "done": len(out.episodes), "turns": turns,
                "tokens": sum(len(c) for c in out.rollouts.completion_ids), **decode_metrics(engine)}

    def close(self) -> None:
        for runner in self.runners.values():
            runner.pool.close()
        if self.vllm:
            self.engines["continuous"].close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
