"""The shared-prefix attention's backward (grpo/model/prefix_attention.py, CPU flash's backward per block)
against its forward and against an exact plain-matmul backward, side by side in one run.

    .venv/bin/python scripts/benchmarks/bench_attention_backward.py [--repeats 20] [--threads 1]

One layer of the embedded SmolLM2 (9 query heads, 3 key/value heads, head size 64) on the two
workloads of `make bench-trl`: gsm8k-like (a 160-token prompt, 8 completions of 128) and long
(660 + 8 x 64). Printed: median milliseconds of the forward, of the kernel's backward (CPU flash)
and of the same gradients as dense matmuls (`matmul_backward` below: P = exp(q k^T s - lse), dV =
P^T dO, dS = P (dO V^T - rowsum(dO out)), dQ = dS K s, dK = dS^T Q s), the variants alternating;
their attention GFLOP/s (forward 4 H Lq Lk D per block, backward twice that, the causal block
counted whole), and the ratios. The matmul variant is checked equal to the kernel's gradients first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from grpo.model import prefix_attention  # noqa: E402

WORKLOADS = {"gsm8k-like": (160, 128, 8), "long": (660, 64, 8)}  # prompt, completion, G
H, HKV, D = 9, 3, 64


def matmul_backward(grad_out, q, k, v, out, lse, scale, causal: bool):
    """CPU flash's backward of one block as dense float32 matmuls (grouped-query heads)."""
    B, heads, L, dim = q.shape
    kv_heads, Lk = k.shape[1], k.shape[2]
    s = scale if scale is not None else dim ** -0.5
    rows = (B, kv_heads, heads // kv_heads * L)
    qg, do, o = (t.reshape(*rows, dim) for t in (q, grad_out, out))
    scores = qg @ k.transpose(-1, -2) * s
    if causal:
        hidden = torch.ones(L, Lk, dtype=torch.bool).triu(1).repeat(heads // kv_heads, 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    p = torch.exp(scores - lse.reshape(*rows, 1))
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return (ds @ k * s).reshape(B, heads, L, dim), ds.transpose(-1, -2) @ qg * s, dv


def inputs(prompt: int, completion: int, group: int):
    g = torch.Generator().manual_seed(0)
    lc = completion * group
    tensors = [torch.randn(1, H, lc, D, generator=g), torch.randn(1, HKV, prompt, D, generator=g),
               torch.randn(1, HKV, prompt, D, generator=g), torch.randn(1, HKV, lc, D, generator=g),
               torch.randn(1, HKV, lc, D, generator=g)]
    return [t.requires_grad_() for t in tensors], torch.randn(1, H, lc, D, generator=g), [completion] * group


def use_backward(kind: str) -> None:
    """Point the kernel's per-block backward at CPU flash's ("flash") or the matmuls ("matmul")."""
    flash = prefix_attention.__dict__.setdefault("_FLASH_BACKWARD", prefix_attention._BACKWARD)
    if kind == "flash":
        prefix_attention._BACKWARD = flash
    else:
        prefix_attention._BACKWARD = lambda g, q, k, v, o, lse, dropout, causal, scale=None: \
            matmul_backward(g, q, k, v, o, lse, scale, causal)


def measure(prompt: int, completion: int, group: int, repeats: int) -> dict[str, float]:
    tensors, weights, lens = inputs(prompt, completion, group)

    def grads():
        out = prefix_attention.prefix_merged_attention(*tensors, lens, None)
        return torch.autograd.grad((out * weights).sum(), tensors)
    use_backward("matmul")
    matmul = grads()
    use_backward("flash")
    for a, b in zip(matmul, grads()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    times = {"forward": [], "backward: CPU flash (the kernel's)": [], "backward: plain matmuls": []}
    for round_index in range(repeats + 1):  # round 0 warms up
        for name, kind in (("backward: CPU flash (the kernel's)", "flash"), ("backward: plain matmuls", "matmul")):
            use_backward(kind)
            t = time.perf_counter()
            out = prefix_attention.prefix_merged_attention(*tensors, lens, None)
            forward_s, t = time.perf_counter() - t, time.perf_counter()
            torch.autograd.grad((out * weights).sum(), tensors)
            if round_index:
                times[name].append(time.perf_counter() - t)
                times["forward"].append(forward_s)
    use_backward("flash")
    flops = 4 * H * D * (completion * group * prompt + group * completion * completion)
    return {name: statistics.median(values) for name, values in times.items()} | {"forward_flops": flops}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# {args.threads} thread(s), {args.repeats} repeats, median; one attention layer, H {H}, Hkv {HKV}, D {D}")
    print("| workload | pass | ms | attention GFLOP/s | rate / forward's | time / CPU flash backward |")
    print("|---|---|---|---|---|---|")
    for name, shape in WORKLOADS.items():
        m = measure(*shape, args.repeats)
        flash = m["backward: CPU flash (the kernel's)"]
        for key in ("forward", "backward: CPU flash (the kernel's)", "backward: plain matmuls"):
            rate = m["forward_flops"] * (1 if key == "forward" else 2) / m[key] / 1e9
            forward_rate = m["forward_flops"] / m["forward"] / 1e9
            print(f"| {name} {shape} | {key} | {m[key] * 1e3:.2f} | {rate:.1f} | {rate / forward_rate:.2f} | "
                  f"{'' if key == 'forward' else f'{m[key] / flash:.2f}'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
