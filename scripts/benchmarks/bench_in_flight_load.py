"""What an in-flight weight load costs the decode loop: the time inside its polls (every row waits for it), with
the new version verified and read on the decode thread, against on a thread of its own (the HF engine's way).

    .venv/bin/python scripts/benchmarks/bench_in_flight_load.py                  # full fine-tune, ~110M parameters
    .venv/bin/python scripts/benchmarks/bench_in_flight_load.py --layers 24 --rounds 3

A random Llama (hidden 768, `--layers` layers, SmolLM2's vocabulary size) is published as a full version (one
safetensors file and its manifest), then loaded into an HF engine serving another copy by the in-flight poll,
called every `--step-ms` (a decode step's time: the loop's thread sleeps between polls, as a GPU step leaves
it). The two ways alternate over `--rounds` rounds, each loading a freshly published version; per way: the
time inside the polls until the version is served (the stall), the wall time from the first poll to the load,
and the ratio of the stalls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-ms", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args(argv)


def model_of(layers: int, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=768, intermediate_size=2048, num_hidden_layers=layers,
                         num_attention_heads=12, num_key_value_heads=4, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def one_load(engine, root: Path, background: bool, step_s: float) -> tuple[float, float]:
    """(seconds inside the polls, seconds from the first poll to the version served)."""
    from grpo.sampler import in_flight
    from grpo.weights.folder import WeightWatcher, read_latest

    in_flight.LATEST_READ_S = 0.0
    watcher = WeightWatcher(root, [engine.stage_weights], initial_version=engine.version)
    loads = in_flight.InFlightLoads(watcher, background=background)
    target, inside, started = read_latest(root), 0.0, time.perf_counter()
    while engine.version != target:
        t = time.perf_counter()
        loads()
        inside += time.perf_counter() - t
        time.sleep(step_s)
    return inside, time.perf_counter() - started


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    from grpo.config import load_config
    from grpo.sampler.rollout.hf_engine import HFEngine
    from grpo.weights.folder import publish

    torch.set_num_threads(args.threads)
    served = model_of(args.layers, 0)
    params = sum(p.numel() for p in served.parameters())
    engine = HFEngine(served, type("T", (), {"pad_token_id": 0, "eos_token_id": 1})(), load_config(None, []).sampling)
    measured = {"on the decode thread": [], "on a thread of its own": []}
    with tempfile.TemporaryDirectory() as folder:
        root, version = Path(folder), 0
        for r in range(args.rounds):
            ways = list(measured) if r % 2 == 0 else list(measured)[::-1]
            for way in ways:
                version += 1
                publish(model_of(args.layers, version), root, version, version, keep_last=2)
                measured[way].append(one_load(engine, root, way == "on a thread of its own", args.step_ms / 1000))
    print(f"full fine-tune, {params / 1e6:.0f}M parameters (float32), a poll every {args.step_ms:g} ms, "
          f"{args.rounds} loads each way, {args.threads} threads")
    print("| the verify and read | stall in the polls (s) | first poll to served (s) |")
    print("|---|---:|---:|")
    for way, runs in measured.items():
        print(f"| {way} | {statistics.median(r[0] for r in runs):.3f} | {statistics.median(r[1] for r in runs):.3f} |")
    before, after = (statistics.median(r[0] for r in runs) for runs in measured.values())
    print(f"stall ratio: {before / after:.1f}x less")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
