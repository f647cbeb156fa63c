"""Your own agent loop against the sampler's own generation, side by side in one run, on either engine.

    .venv/bin/python scripts/benchmarks/bench_agent_endpoint.py [--steps 3] [--episodes tools] [overrides ...]
    .venv-vllm/bin/python scripts/benchmarks/bench_agent_endpoint.py sampling.engine=vllm

The default config (the embedded model with its LoRA adapter, GSM8K prompts with two solved examples) with
data.prefill '' and B x G = 2 x 8 completions a step, each step made twice, alternating: natively (the
engine's `generate`, as a run without an agent) and through the endpoint (agent.entrypoint: a plain
`openai`-client function per sample that sends the row's prompt turns and returns), under the same seed. The
two make the same tokens (checked; the HF engine's continuous loop draws what `generate` draws); the
difference in wall time is what the endpoint costs: the HTTP round trips, the sessions, the render of
each first request, and the harness threads. Printed: seconds per step of each, and the overhead per turn in
milliseconds. `--episodes tools`: configs/gsm8k_tools.yaml's calculator episodes instead, natively (the tool
environment) and through an openai-client tool loop (tool_loop); printed also: model tokens per second each way,
and how many rows came out the same.
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


def tool_loop(tools: list):
    """The harness of `--episodes tools`: the run's prompt turns and tools, each call the model makes run here
    (errors as the tool environment writes them), until a message without calls or agent.max_turns."""
    import json

    from openai import BadRequestError, OpenAI

    from grpo.environments.calculator import calculate

    def run(call) -> str:
        try:
            return calculate(**json.loads(call.function.arguments))
        except Exception as e:  # the model reads it, as from the tool environment
            return f"error: {type(e).__name__}: {e}"

    def agent(row: dict, base_url: str, api_key: str) -> None:
        client, messages = OpenAI(base_url=base_url, api_key=api_key, max_retries=0), list(row["prompt_turns"])
        while True:
            try:
                message = client.chat.completions.create(model="policy", messages=messages,
                                                         tools=tools).choices[0].message
            except BadRequestError:  # past agent.max_turns or the token budget: the session was cut
                return
            if not message.tool_calls:
                return
            messages.append(message.model_dump(exclude_none=True))
            messages += [{"role": "tool", "tool_call_id": call.id, "content": run(call)} for call in message.tool_calls]
    return agent


def set_up(tools: bool, overrides: list[str]):
    """(config, tokenizer, engine, prompts, the native episodes' runner or None, the harness)."""
    from grpo.common.model_files import resolve_device
    from grpo.config import load_config
    from grpo.data.problems import load_split
    from grpo.data.prompts import build_prompts
    from grpo.model.loading import add_lora, load_model, load_tokenizer
    from grpo.sampler.rollout import make_engine

    common = ["data.prefill=", "sampling.prompts_per_step=2", "sampling.group_size=8", *overrides]
    # episodes: both ways decode with the replies taken at fixed points (no overlap), so their tokens can agree
    native_cfg = load_config(str(ROOT / "configs" / "gsm8k_tools.yaml"), [*common, "sampling.max_staleness=0"]) \
        if tools else None
    cfg = load_config(None, ["agent.entrypoint=unused:ask", *common, *(
        [f"model.chat_template={native_cfg.model.chat_template}", f"agent.max_turns={native_cfg.env.max_turns}",
         f"sampling.max_new_tokens={native_cfg.sampling.max_new_tokens}",
         f"data.max_prompt_tokens={native_cfg.data.max_prompt_tokens}", "sampling.max_staleness=0"] if tools else [])])
    tokenizer = load_tokenizer(cfg.model)
    model = add_lora(load_model(cfg.model, resolve_device(cfg.sampling.device)), cfg.lora).eval()
    engine = make_engine(cfg, model, tokenizer)
    problems = load_split(cfg.data, cfg.data.split)[0][:64]
    if tools:
        from grpo.environments import prompt_options
        from grpo.sampler.episodes import episode_runner

        prompts, _ = build_prompts(tokenizer, native_cfg.data, problems, **prompt_options(native_cfg.env))
        episodes = episode_runner(native_cfg, tokenizer)
        harness = tool_loop(list(prompts[0].tools))
    else:
        prompts, _ = build_prompts(tokenizer, cfg.data, problems)
        episodes, harness = None, ask
    return cfg, tokenizer, engine, prompts, episodes, harness


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--episodes", choices=("single", "tools"), default="single",
                        help="tools: configs/gsm8k_tools.yaml's calculator episodes, natively (env.tools) and "
                             "through an openai-client tool loop")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    import torch

    cfg, tokenizer, engine, prompts, episodes, harness = set_up(args.episodes == "tools", args.overrides)
    tools = episodes is not None
    from grpo.agent.runner import AgentRunner

    runner = AgentRunner(cfg.agent, tokenizer, cfg.sampling.max_new_tokens, cfg.data.max_prompt_tokens, "policy",
                         entrypoint=harness)
    B, G = cfg.sampling.prompts_per_step, cfg.sampling.group_size
    print(f"{cfg.sampling.engine}: {torch.get_num_threads()} threads, {B} prompts x {G} a step, max_new_tokens "
          f"{cfg.sampling.max_new_tokens}, {args.steps} steps each way, alternating", flush=True)
    seconds, counts = {"native": [], "endpoint": []}, {"native": [], "endpoint": []}
    try:
        for step in range(-1, args.steps):  # step -1: both warmed up, not counted
            batch, seed = prompts[(step + 1) * B:(step + 2) * B], 1000 + step
            t = time.perf_counter()
            native = episodes.run(engine, batch, G, seed=seed).rollouts if tools else \
                engine.generate([p.token_ids for p in batch], G, seed=seed)
            native_s = time.perf_counter() - t
            t = time.perf_counter()
            served = runner.run(engine, batch, G, seed=seed)
            endpoint_s = time.perf_counter() - t
            if [p.token_ids for p in served.prompts] != [p.token_ids for p in batch]:
                raise SystemExit("the endpoint's prompts are not the run's: the comparison would not be like for like")
            same = sum(a.tolist() == b.tolist() for a, b in zip(native.completion_ids, served.rollouts.completion_ids))
            sampled = [sum(m.tolist()) if m is not None else len(c)
                       for c, m in zip(native.completion_ids, native.model_masks or [None] * B * G)]
            served_sampled = sum(sum(m.tolist()) for m in served.rollouts.model_masks)
            print(f"step {step}: native {native_s:.2f} s ({sum(sampled) / native_s:.1f} model tokens/s), endpoint "
                  f"{endpoint_s:.2f} s ({served_sampled / endpoint_s:.1f}), {sum(sampled)} vs {served_sampled} model "
                  f"tokens, same rows: {same}/{B * G}", flush=True)
            if step >= 0:
                seconds["native"].append(native_s)
                seconds["endpoint"].append(endpoint_s)
                counts["native"].append(sum(sampled))
                counts["endpoint"].append(served_sampled)
    finally:
        runner.close()
        if episodes is not None:
            episodes.close()
        getattr(engine, "close", lambda: None)()
    rates = {way: sum(counts[way]) / sum(seconds[way]) for way in seconds}
    print(f"model tokens/s over the counted steps: native {rates['native']:.1f}, endpoint {rates['endpoint']:.1f} "
          f"(x{rates['endpoint'] / rates['native']:.3f})")
    native, endpoint = statistics.median(seconds["native"]), statistics.median(seconds["endpoint"])
    print(f"median s/step: native {native:.2f}, endpoint {endpoint:.2f} (x{endpoint / native:.3f}); difference "
          f"per session {1000 * (endpoint - native) / (B * G):.1f} ms (one turn each without --episodes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
