"""Shared-prefix vs plain log-prob passes on the embedded SmolLM2-135M-Instruct, side by side.

    .venv/bin/python scripts/benchmarks/bench_prefix.py                 # both workloads, 3 repeats
    .venv/bin/python scripts/benchmarks/bench_prefix.py --workloads 1024x128x8 --repeats 5

For each workload (prompt tokens x completion tokens x G) it times the no-grad log-prob pass
(what the sampler does for old/ref log-probs) and forward+backward with LoRA r=16 on the
attention projections (what the trainer does), for the shared-prefix and the plain
repeated-prompt path, and prints their ratios. Every measurement runs in a fresh subprocess,
alternating variants, so that peak memory (RSS above the loaded model, sampled every 2 ms) is
that variant's own and slow drift of the machine hits both alike.
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRss:
    """Highest RSS seen while the block runs, sampled by a thread."""

    def __enter__(self):
        self.start, self.peak, self._stop = rss_bytes(), rss_bytes(), False
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self):
        while not self._stop:
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def workload(prompt_len: int, completion_len: int, group_size: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(100, 40000, (prompt_len,), generator=g)]
    completions = [torch.randint(100, 40000, (completion_len,), generator=g) for _ in range(group_size)]
    return prompts, completions, [group_size]


def measure(spec: dict) -> dict:
    """One measurement, in this (fresh) process."""
    import torch

    from grpo.config import Config
    from grpo.model.loading import load_policy
    from grpo.model.logprobs import completion_logprobs

    torch.manual_seed(0)
    cfg = Config()
    model = load_policy(cfg)  # LoRA r=16 on q, k, v, o
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.01)  # a trained-looking adapter
    prompts, completions, sizes = workload(spec["P"], spec["C"], spec["G"])
    kwargs = dict(shared_prefix=spec["variant"] == "shared", temperature=0.9, max_tokens_per_forward=10**6)
    if spec["mode"] == "nograd":
        model.eval()
        with torch.no_grad():
            completion_logprobs(model, prompts, completions[:1], [1], **kwargs)  # warm-up
            with PeakRss() as mem:
                t = time.perf_counter()
                logps = completion_logprobs(model, prompts, completions, sizes, **kwargs)
                seconds = time.perf_counter() - t
        torch.save([x.detach() for x in logps], spec["out"])
    else:
        model.train()
        with PeakRss() as mem:
            t = time.perf_counter()
            logps = completion_logprobs(model, prompts, completions, sizes, **kwargs)
            torch.stack([x.mean() for x in logps]).sum().backward()
            seconds = time.perf_counter() - t
    return {"seconds": seconds, "peak_mb": (mem.peak - mem.start) / 2**20}


def run_child(spec: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
    if out.returncode != 0:
        raise SystemExit(f"measurement {spec} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="1024x128x8,150x250x8", help="PxCxG, comma separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(json.loads(args.child))))
        return

    import torch

    from grpo.common.model_files import convert_embedded

    convert_embedded("smollm2-135m-instruct")  # convert before timing anything
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"median of {args.repeats}, variants alternating, one subprocess per measurement\n")
    rows = []
    tmp = Path(tempfile.mkdtemp())
    for text in args.workloads.split(","):
        P, C, G = (int(x) for x in text.split("x"))
        tokens_plain, tokens_shared = G * (P + C), P + G * C
        result = {}
        for mode in ("nograd", "fwdbwd"):
            runs = {"shared": [], "plain": []}
            for r in range(args.repeats):
                for variant in ("plain", "shared") if r % 2 else ("shared", "plain"):
                    spec = {"P": P, "C": C, "G": G, "mode": mode, "variant": variant,
                            "out": str(tmp / f"{text}-{variant}.pt")}
                    runs[variant].append(run_child(spec))
            for variant, values in runs.items():
                result[(mode, variant)] = (statistics.median(v["seconds"] for v in values),
                                           statistics.median(v["peak_mb"] for v in values))
        shared = torch.load(tmp / f"{text}-shared.pt")
        plain = torch.load(tmp / f"{text}-plain.pt")
        diff = max((a - b).abs().max().item() for a, b in zip(shared, plain))
        rows.append((text, tokens_plain / tokens_shared, result, diff))

    header = ("| P x C x G | tokens plain/shared | pass | plain s | shared s | speed-up | plain peak MB "
              "| shared peak MB | memory shared/plain | max abs diff |")
    print(header)
    print("| --- " * 10 + "|")
    for text, token_ratio, result, diff in rows:
        for mode, label in (("nograd", "no-grad log-probs"), ("fwdbwd", "fwd+bwd LoRA")):
            (tp, mp), (ts, ms) = result[(mode, "plain")], result[(mode, "shared")]
            print(f"| {text} | {token_ratio:.2f}x | {label} | {tp:.2f} | {ts:.2f} | {tp / ts:.2f}x | {mp:.0f} "
                  f"| {ms:.0f} | {ms / mp:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
