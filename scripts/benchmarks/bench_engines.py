"""HF engine vs vLLM engine on the same prompts, G, completion limit and temperature, side by side.

    .venv/bin/python scripts/benchmarks/bench_engines.py                       # after make install-vllm
    .venv/bin/python scripts/benchmarks/bench_engines.py --repeats 3 --few-shot 0,2 --rounds 2
    .venv/bin/python scripts/benchmarks/bench_engines.py --engines hf,hf@model.dtype=bfloat16 --few-shot 2
    # against an earlier HF engine
    .venv/bin/python scripts/benchmarks/bench_engines.py --engines hf@rev=c5eb412,hf --few-shot 2

Each (engine, workload) runs in a fresh subprocess, each engine in the environment the launcher
gives it (HF: this Python, .venv; vLLM: sampling.vllm.python, .venv-vllm), the engines alternating, so that start-up
and peak memory are that engine's own and drift of the machine hits both alike. A subprocess
starts the engine (timed: for vLLM this includes its engine-core process and its warm-up),
publishes a LoRA adapter and swaps it in (timed), then generates `--repeats` steps of B prompts
x G completions (the first one, which compiles, reported apart) and reports completion tokens/s.
Peak RSS is that of the subprocess and its children (vLLM's engine core), sampled every 20 ms.
`hf@rev=<git revision>` runs the HF engine as `grpo/sampler/rollout/hf_engine.py` was at that revision
(the rest of the tree as it is now), to measure a change of the engine on and off in one run.
Workloads: the default run's chat prompts with `data.few_shot` solved examples (0 = short
prompts, 2 = the default, ~325-token prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def tree_rss(proc: psutil.Process) -> int:
    """RSS of a process and its children now (0 once it has exited)."""
    try:
        members = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for member in members:
        try:
            total += member.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_measured(python: str, args: list[str]) -> tuple[dict, int]:
    """Run one measurement subprocess; (its JSON result, the peak RSS of its process tree)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        proc = subprocess.Popen([python, __file__, "--child", out.name, *args], cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peak, watched = 0, psutil.Process(proc.pid)
        done = threading.Event()

        def watch():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, tree_rss(watched))
                time.sleep(0.02)

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        _, err = proc.communicate()
        done.set()
        thread.join()
        if proc.returncode != 0:
            raise RuntimeError(f"measurement {args} failed:\n{err[-3000:]}")
        return json.loads(Path(out.name).read_text()), peak


def hf_engine_at(revision: str):
    """HFEngine as grpo/sampler/rollout/hf_engine.py was at a git revision (imports resolve against today's tree)."""
    import importlib.util

    for place in ("grpo/sampler/rollout/hf_engine.py", "grpo/rollout/hf_engine.py"):  # today's, and before the move
        shown = subprocess.run(["git", "show", f"{revision}:{place}"], cwd=ROOT, capture_output=True, text=True)
        if shown.returncode == 0:
            break
    else:
        raise SystemExit(f"no hf_engine.py at revision {revision}")
    source = shown.stdout
    path = Path(tempfile.mkdtemp()) / f"hf_engine_{revision}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HFEngine


def child(out_path: str, engine_name: str, few_shot: int, repeats: int, overrides: list[str]) -> None:
    import torch

    from grpo.config import load_config
    from grpo.data.problems import load_split
    from grpo.data.prompts import build_prompts
    from grpo.model.loading import add_lora, load_model, load_tokenizer
    from grpo.sampler.batches import step_seed
    from grpo.sampler.rollout import make_engine
    from grpo.weights.folder import WeightWatcher, publish, stager_for_model

    revision = next((o.split("=", 1)[1] for o in overrides if o.startswith("rev=")), None)
    overrides = [o for o in overrides if not o.startswith("rev=")]
    cfg = load_config(ROOT / "config.yaml", [f"sampling.engine={engine_name}", f"data.few_shot={few_shot}",
                                             "sampling.vllm.kv_cache_gb=2", *overrides])
    tokenizer = load_tokenizer(cfg.model)
    torch.manual_seed(cfg.seed)
    model = add_lora(load_model(cfg.model), cfg.lora).eval()
    prompts, _ = build_prompts(tokenizer, cfg.data, load_split(cfg.data, cfg.data.split)[0][:64])
    t = time.perf_counter()
    engine = make_engine(cfg, model, tokenizer) if revision is None else hf_engine_at(revision)(model, tokenizer,
                                                                                                cfg.sampling)
    start_s = time.perf_counter() - t

    trained = add_lora(load_model(cfg.model), cfg.lora)
    for name, p in trained.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)
    with tempfile.TemporaryDirectory() as weights:
        publish(trained, weights, version=1, step=1)
        stagers = [engine.stage_weights] if engine_name == "hf" else [stager_for_model(model), engine.stage_weights]
        t = time.perf_counter()
        assert WeightWatcher(weights, stagers).poll().loaded
        swap_s = time.perf_counter() - t
        steps = []
        B = cfg.sampling.prompts_per_step
        for step in range(repeats + 1):
            chosen = prompts[step * B:(step + 1) * B]
            t = time.perf_counter()
            rollouts = engine.generate([p.token_ids for p in chosen], cfg.sampling.group_size,
                                       seed=step_seed(cfg, step))
            steps.append((sum(len(c) for c in rollouts.completion_ids), time.perf_counter() - t))
    engine.close()
    prompt_tokens = statistics.mean(len(p.token_ids) for p in prompts[:B * (repeats + 1)])
    Path(out_path).write_text(json.dumps({"start_s": start_s, "swap_s": swap_s, "steps": steps,
                                          "prompt_tokens": prompt_tokens}))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=1, help=argparse.SUPPRESS)
    parser.add_argument("--engine", default="hf", help=argparse.SUPPRESS)
    parser.add_argument("--engines", default="hf,vllm",
                        help="variants, comma-separated: an engine, optionally with overrides of its own after '@' "
                             "(hf@model.dtype=bfloat16); each is compared with the first")
    parser.add_argument("--few-shot", default="0,2", help="workloads: data.few_shot values, comma-separated")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per measurement (after a first one)")
    parser.add_argument("--rounds", type=int, default=2, help="measurements per engine and workload, alternating")
    parser.add_argument("overrides", nargs="*", help="config overrides for both engines, e.g. sampling.group_size=16")
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.engine, int(args.few_shot), args.repeats, args.overrides)
        return 0

    from grpo.config import load_config

    vllm_python = ROOT / load_config(ROOT / "config.yaml", args.overrides).sampling.vllm.python
    pythons = {"hf": sys.executable, "vllm": str(vllm_python) if vllm_python.is_file() else sys.executable}
    print(f"# {os.cpu_count()} CPUs, each engine with its default threads (all of them); hf in {pythons['hf']}, "
          f"vllm in {pythons['vllm']}; overrides: {' '.join(args.overrides) or '(none)'}")
    print("| workload | engine | prompt tokens | start-up s | adapter swap s | first step tok/s | tok/s (median) | "
          "peak RSS GiB |")
    print("|---|---|---|---|---|---|---|---|")
    variants = {label: label.split("@") for label in args.engines.split(",")}  # label: [engine, override, ...]
    for few_shot in (int(x) for x in args.few_shot.split(",")):
        results = {label: [] for label in variants}
        for _ in range(args.rounds):
            for label, (engine, *extra) in variants.items():
                results[label].append(run_measured(pythons[engine], ["--engine", engine, "--few-shot", str(few_shot),
                                                                     "--repeats", str(args.repeats), *args.overrides,
                                                                     *extra]))
        rates = {}
        for engine, runs in results.items():
            timed = [tokens / seconds for result, _ in runs for tokens, seconds in result["steps"][1:]]
            first = [r["steps"][0][0] / r["steps"][0][1] for r, _ in runs]
            rates[engine] = statistics.median(timed)
            print(f"| few_shot={few_shot} | {engine} | {runs[0][0]['prompt_tokens']:.0f} | "
                  f"{statistics.median(r['start_s'] for r, _ in runs):.1f} | "
                  f"{statistics.median(r['swap_s'] for r, _ in runs):.2f} | {statistics.median(first):.0f} | "
                  f"{rates[engine]:.0f} | {max(peak for _, peak in runs) / 2**30:.2f} |")
        first = next(iter(variants))
        for label in list(variants)[1:]:
            print(f"| few_shot={few_shot} | {label} / {first} | | | | | {rates[label] / rates[first]:.2f}x | |")
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    sys.exit(main(sys.argv[1:]))
