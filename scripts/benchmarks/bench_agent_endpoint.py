"""Your own agent loop against the sampler's own generation, side by side in one run, on either engine.

    .venv/bin/python scripts/benchmarks/bench_agent_endpoint.py [--steps 3] [overrides ...]
    .venv-vllm/bin/python scripts/benchmarks/bench_agent_endpoint.py sampling.engine=vllm

The default config (the embedded model with its LoRA adapter, GSM8K prompts with two solved examples) with
data.prefill '' and B x G = 2 x 8 completions a step, each step made twice, alternating: natively (the
engine's `generate`, as a run without an agent) and through the endpoint (agent.entrypoint: a plain
`openai`-client function per sample that sends the row's prompt turns and returns), under the same seed. The
two make the same tokens (checked; the HF engine's continuous loop draws what `generate` draws); the
difference in wall time is what the endpoint costs: the HTTP round trips, the sessions, the render of
each first request, and the harness threads. Printed: seconds per step of each, and the overhead per turn in
milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def ask(row: dict, base_url: str, api_key: str) -> None:
    """The harness: the run's own prompt turns, one turn."""
    from openai import OpenAI

    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="policy", messages=row["prompt_turns"])


def answer_begun(row: dict, base_url: str, api_key: str) -> None:
    """The needle recipe's turn through the endpoint (bench_continuous_learn.py --variants agent): the run's own
    prompt turns, the assistant's turn begun with the recipe's prefill; the run's rewards score the message."""
    from openai import OpenAI

    OpenAI(base_url=base_url, api_key=api_key, max_retries=0).chat.completions.create(
        model="policy", messages=[*row["prompt_turns"], {"role": "assistant", "content": "<answer>"}],
        extra_body={"continue_final_message": True, "add_generation_prompt": False})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    import torch

    from grpo.agent.runner import AgentRunner
    from grpo.common.model_files import resolve_device
    from grpo.config import load_config
    from grpo.data.problems import load_split
    from grpo.data.prompts import build_prompts
    from grpo.model.loading import add_lora, load_model, load_tokenizer
    from grpo.sampler.rollout import make_engine

    cfg = load_config(None, ["data.prefill=", "sampling.prompts_per_step=2", "sampling.group_size=8",
                             "agent.entrypoint=unused:ask", *args.overrides])
    tokenizer = load_tokenizer(cfg.model)
    model = add_lora(load_model(cfg.model, resolve_device(cfg.sampling.device)), cfg.lora).eval()
    engine = make_engine(cfg, model, tokenizer)
    prompts, _ = build_prompts(tokenizer, cfg.data, load_split(cfg.data, cfg.data.split)[0][:64])
    runner = AgentRunner(cfg.agent, tokenizer, cfg.sampling.max_new_tokens, cfg.data.max_prompt_tokens, "policy",
                         entrypoint=ask)
    B, G = cfg.sampling.prompts_per_step, cfg.sampling.group_size
    print(f"{cfg.sampling.engine}: {torch.get_num_threads()} threads, {B} prompts x {G} a step, max_new_tokens "
          f"{cfg.sampling.max_new_tokens}, {args.steps} steps each way, alternating", flush=True)
    seconds = {"native": [], "endpoint": []}
    try:
        for step in range(-1, args.steps):  # step -1: both warmed up, not counted
            batch, seed = prompts[(step + 1) * B:(step + 2) * B], 1000 + step
            t = time.perf_counter()
            native = engine.generate([p.token_ids for p in batch], G, seed=seed)
            native_s = time.perf_counter() - t
            t = time.perf_counter()
            served = runner.run(engine, batch, G, seed=seed)
            endpoint_s = time.perf_counter() - t
            if [p.token_ids for p in served.prompts] != [p.token_ids for p in batch]:
                raise SystemExit("the endpoint's prompts are not the run's: the comparison would not be like for like")
            same = [a.tolist() for a in native.completion_ids] == [a.tolist() for a in served.rollouts.completion_ids]
            tokens = sum(len(c) for c in native.completion_ids)
            print(f"step {step}: native {native_s:.2f} s, endpoint {endpoint_s:.2f} s, {tokens} tokens, "
                  f"same tokens: {same}", flush=True)
            if step >= 0:
                seconds["native"].append(native_s)
                seconds["endpoint"].append(endpoint_s)
    finally:
        runner.close()
        getattr(engine, "close", lambda: None)()
    native, endpoint = statistics.median(seconds["native"]), statistics.median(seconds["endpoint"])
    print(f"median s/step: native {native:.2f}, endpoint {endpoint:.2f} (x{endpoint / native:.3f}); overhead per "
          f"turn {1000 * (endpoint - native) / (B * G):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
