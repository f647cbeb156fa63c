"""One GPU check, to run before and after a change wherever a GPU is at hand (no network needed).

    .venv/bin/python scripts/benchmarks/gpu_check.py                      # the 1-GPU recipe's shape, ~5 min
    .venv/bin/python scripts/benchmarks/gpu_check.py --out runs/gpu_check/after-change
    .venv/bin/python scripts/benchmarks/gpu_check.py --quick                # a tiny shape: the CPU runs it too

Builds a random-weights model of configs/qwen2.5-0.5b-gsm8k-1gpu.yaml's shape on the machine
(Qwen2.5-0.5B's architecture: 24 layers, hidden 896, 14 query and 2 key/value heads, with the embedded
SmolLM2 tokenizer; random weights never write EOS, so every completion runs to sampling.max_new_tokens)
and measures, the recipe's settings otherwise (bfloat16, LoRA r 32 on every linear layer, 16 prompts x 8):

- the device's bfloat16 matmul rate (8192 x 8192 products): the ceiling MFU is measured against;
- the HF engine's decode: generated tokens/s at 64 and 128 rows (a sampler step's generate), and at 64 rows
  again with `sampling.compile_decode` (its steps replayed as CUDA graphs): tokens/s, the first call (compile
  and capture), the share of completions equal to the eager ones;
- the sampler/trainer log-prob gap in bfloat16 (the engine's recorded log-probs against the shared-prefix
  recompute, on the 128-row step): largest and mean per token;
- the trainer's step alone (no sampler on the device): the forward and backward of every micro-batch,
  with the shared prefix on and off, its attention per group (SDPA with the group's mask) and in one
  FlexAttention call a row (`model.attn_implementation=flex_attention`), LoRA (its reference pass with the
  adapter off included) and full fine-tune (at beta 0: its reference would be a model of its own); model
  TFLOP/s (grpo/model/flops.py), MFU, peak memory;
- the top kernels by device time of one LoRA step (torch.profiler);
- FlexAttention's shared-prefix path against SDPA's on one micro-batch (loss, LoRA gradients), and how many
  graphs torch compiled in all (a GPU only: torch has no FlexAttention backward on the CPU).

Writes gpu_check.json and gpu_check.md under --out and prints the markdown; the figures go into
docs/performance.md with the date and the machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "configs" / "qwen2.5-0.5b-gsm8k-1gpu.yaml"
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
TRAINER_VARIANTS = (  # name, LoRA, shared prefix, model.attn_implementation
    ("LoRA, shared prefix", True, True, "sdpa"),
    ("LoRA, shared prefix, FlexAttention", True, True, "flex_attention"),
    ("LoRA, no shared prefix", True, False, "sdpa"),
    ("full, shared prefix", False, True, "sdpa"),
    ("full, shared prefix, FlexAttention", False, True, "flex_attention"),
    ("full, no shared prefix", False, False, "sdpa"),
)
QUICK = ["sampling.max_new_tokens=12", "sampling.prompts_per_step=2", "sampling.group_size=4",
         "data.max_prompt_tokens=256"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "gpu_check" / time.strftime("%Y-%m-%d-%H%M"))
    parser.add_argument("--device", default="", help="default: cuda where there is one, else cpu")
    parser.add_argument("--quick", action="store_true", help="a tiny shape and a short step (checks the script)")
    parser.add_argument("overrides", nargs="*", help="config overrides on top of the recipe's")
    return parser.parse_args(argv)


def build_model(folder: Path, shape: dict) -> None:
    """The shape with random weights and the embedded model's tokenizer, saved as a model folder."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo.config import ModelConfig
    from grpo.model.loading import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig())
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, **shape)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def synced(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(device, n: int) -> float:
    """bfloat16 FLOP/s of [n, n] @ [n, n] products, after a warm-up."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    a @ b
    synced(device)
    rounds, t = 0, time.perf_counter()
    while time.perf_counter() - t < 2.0:
        a @ b
        rounds += 1
        if rounds % 10 == 0:
            synced(device)
    synced(device)
    return rounds * 2 * n ** 3 / (time.perf_counter() - t)


def peak_memory(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def prompts_of(cfg, tokenizer, count: int) -> list:
    from grpo.data.problems import load_split
    from grpo.data.prompts import build_prompts

    problems = load_split(cfg.data, cfg.data.split)[0][:cfg.data.few_shot + count]
    return build_prompts(tokenizer, cfg.data, problems)[0]


def sample(cfg, device) -> tuple[dict, object]:
    """The HF engine's decode at half the step's rows, then the whole step as the sampler makes it (its
    generate timed, its log-probs recomputed): (figures, the batch)."""
    import torch

    from grpo.model.loading import load_policy, load_tokenizer
    from grpo.sampler.batches import SamplerModels, make_batch
    from grpo.sampler.rollout.hf_engine import HFEngine

    tokenizer = load_tokenizer(cfg.model)
    model = load_policy(cfg, device).eval()
    engine = HFEngine(model, tokenizer, cfg.sampling)
    prompts = prompts_of(cfg, tokenizer, cfg.sampling.prompts_per_step)
    half = prompts[:max(1, len(prompts) // 2)]
    figures = {}
    with torch.no_grad():
        engine.generate([p.token_ids for p in half[:1]], 1, seed=0, max_new_tokens=[4])  # warm-up
        synced(device)
        t = time.perf_counter()
        got = engine.generate([p.token_ids for p in half], cfg.sampling.group_size, seed=1)
        synced(device)
        seconds = time.perf_counter() - t
        rows = len(half) * cfg.sampling.group_size
        figures[f"decode_tokens_per_s_{rows}_rows"] = sum(len(c) for c in got.completion_ids) / seconds
        figures.update(compiled_decode(cfg, model, tokenizer, [p.token_ids for p in half], got, device,
                                       [p.token_ids for p in prompts]))
        policy = SamplerModels.of(cfg, engine, model, None, tokenizer, {})
        batch = make_batch(cfg, policy, prompts, step=0, metrics_so_far={}, measure_logp_gap=True)
    metrics = batch.meta["metrics"]
    rows = len(batch.completion_ids)
    figures[f"decode_tokens_per_s_{rows}_rows"] = sum(len(c) for c in batch.completion_ids) / \
        metrics["timing/generate_s"]
    figures["completion_tokens_mean"] = statistics.mean(len(c) for c in batch.completion_ids)
    gaps = [(a - b).abs() for a, b in zip(batch.old_logps, recorded_against_recompute(cfg, policy, batch))]
    figures["logp_gap_max"] = max(g.max().item() for g in gaps)
    figures["logp_gap_mean"] = torch.cat(gaps).mean().item()
    del engine, model, policy
    return figures, batch


def compiled_decode(cfg, model, tokenizer, prompts: list, eager, device, warm: list) -> dict:
    """The same generate with sampling.compile_decode (CUDA graphs on a GPU): its first call, on `warm` (compiles
    and captures; the prompts' completions to different lengths, so rows leave and smaller row buckets run too),
    then the call timed against the eager one's tokens (bfloat16 kernels of another shape may draw other
    tokens: the share of completions equal); the times torch decided to skip CUDA graphs for a compiled graph
    (0 where every step replays one), the graphs compiled, and the peak memory of the timed call."""
    import torch
    import torch._dynamo

    from grpo.sampler.rollout.hf_engine import HFEngine

    engine = HFEngine(model, tokenizer, dataclasses.replace(cfg.sampling, compile_decode=True))
    rows, limit = len(prompts) * cfg.sampling.group_size, cfg.sampling.max_new_tokens
    counters = torch._dynamo.utils.counters
    skips, graphs = counters["inductor"]["cudagraph_skips"], counters["stats"]["unique_graphs"]
    with torch.no_grad():
        t = time.perf_counter()
        engine.generate(warm, cfg.sampling.group_size, seed=1,
                        max_new_tokens=[max(1, limit >> (i % 4)) for i in range(len(warm))])
        synced(device)
        first = time.perf_counter() - t
        reset_peak(device)
        t = time.perf_counter()
        got = engine.generate(prompts, cfg.sampling.group_size, seed=1)
        synced(device)
        seconds = time.perf_counter() - t
    same = [torch.equal(a, b) for a, b in zip(eager.completion_ids, got.completion_ids)]
    figures = {f"compiled_decode_tokens_per_s_{rows}_rows": sum(len(c) for c in got.completion_ids) / seconds,
               "compiled_decode_first_call_s": first, "compiled_decode_same_completions": sum(same) / len(same),
               "compiled_decode_steps": float(engine.graphs.fixed_steps) if engine.graphs is not None else 0.0,
               "compiled_decode_cudagraph_skips": float(counters["inductor"]["cudagraph_skips"] - skips),
               "compiled_decode_graphs": float(counters["stats"]["unique_graphs"] - graphs)}
    peak = peak_memory(device)
    if peak is not None:
        figures["compiled_decode_peak_gib"] = peak
    return figures


def recorded_against_recompute(cfg, policy, batch) -> list:
    """The trainer's shared-prefix log-probs of the batch's completions under the served weights."""
    import torch

    from grpo.model.logprobs import completion_logprobs

    with torch.no_grad():
        got = completion_logprobs(policy.model, batch.prompt_ids, batch.completion_ids, batch.group_sizes,
                                  temperature=cfg.sampling.temperature, shared_prefix=True)
    return [x.float().cpu() for x in got]


def micro_batches(cfg, batch) -> list:
    """The groups of each micro-batch of the step, as the trainer packs them on one rank."""
    from grpo.model.sharding import pack_micro_batches
    from grpo.trainer.groups import group_costs

    costs = group_costs(batch)
    return pack_micro_batches(list(range(len(costs))), costs, cfg.training.max_tokens_per_micro_batch)


def train_step(cfg, batch, device, profile: bool = False) -> dict:
    """The forward and backward of every micro-batch of a trainer step, timed after a warm-up step."""
    from grpo.model.flops import ModelShape, batch_step_flops
    from grpo.model.loading import load_policy
    from grpo.trainer.groups import select_groups
    from grpo.trainer.training_step import micro_batch_loss

    reset_peak(device)
    model = load_policy(cfg, device).train()
    micro = micro_batches(cfg, batch)

    def step():
        model.zero_grad(set_to_none=True)
        for groups in micro:
            micro_batch_loss(model, select_groups(batch, groups), cfg)[0].backward()
        synced(device)

    step()
    t = time.perf_counter()
    step()
    seconds = time.perf_counter() - t
    out = {"seconds": seconds, "model_flops": batch_step_flops(ModelShape.of(model), batch, cfg)["model"],
           "micro_batches": len(micro), "peak_gib": peak_memory(device)}
    if profile:
        out["top_kernels"] = top_kernels(step, device)
    return out


def flex_against_sdpa(cfg, batch, device) -> dict:
    """FlexAttention's shared-prefix path against SDPA's on the step's first micro-batch, the same LoRA weights (B
    drawn too, so that every adapter matrix gets a gradient): the largest log-prob gap and the largest relative
    error of an adapter gradient, in the recipe's dtype."""
    import torch

    from grpo.model.loading import load_policy
    from grpo.trainer.groups import select_groups
    from grpo.trainer.training_step import micro_batch_loss

    mb, got = select_groups(batch, micro_batches(cfg, batch)[0]), {}
    for attention in ("sdpa", "flex_attention"):
        variant = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attn_implementation=attention))
        torch.manual_seed(0)
        model = load_policy(variant, device).train()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.02)
        loss = micro_batch_loss(model, mb, variant)[0]
        loss.backward()
        got[attention] = ([p.grad.float() for p in model.parameters() if p.requires_grad], loss.item())
        del model
    (grads, loss), (flex_grads, flex_loss) = got["sdpa"], got["flex_attention"]
    return {"loss_gap": abs(flex_loss - loss),
            "lora_grad_relative_error": max(((a - b).norm() / b.norm().clamp(min=1e-12)).item()
                                            for a, b in zip(flex_grads, grads))}


def top_kernels(step, device, count: int = 12) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:count]
    total = sum(getattr(e, key) for e in prof.key_averages()) or 1
    return [{"name": e.key[:90], "ms": getattr(e, key) / 1000, "share": getattr(e, key) / total, "calls": e.count}
            for e in events]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch
    import torch._dynamo

    from grpo.config import load_config

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.out / "model"
    shape = SHAPES["tiny" if args.quick else "qwen2.5-0.5b"]
    build_model(folder, shape)
    overrides = [f"model.name_or_path={folder}", "sampling.engine=hf", f"sampling.device={device}", "eval.every=0",
                 "sampling.old_logps=generation",
                 *(QUICK if args.quick else []), *args.overrides]
    cfg = load_config(RECIPE, overrides)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "shape": shape, "overrides": overrides,
              "matmul_bf16_tflops": matmul_rate(device, 1024 if args.quick else 8192) / 1e12}
    t = time.perf_counter()
    report["sampler"], batch = sample(cfg, device)
    report["trainer"], sampler_graphs = {}, torch._dynamo.utils.counters["stats"]["unique_graphs"]  # compiled decode
    for name, lora, shared, attention in TRAINER_VARIANTS:
        if attention == "flex_attention" and device.type == "cpu":
            report.setdefault("skipped", {})[name] = "torch's FlexAttention has no backward on the CPU"
            continue
        # a full fine-tune's reference is a model of its own, not measured here: its variants run at beta 0
        training = dataclasses.replace(cfg.training, shared_prefix=shared, beta=cfg.training.beta if lora else 0.0)
        variant = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, enabled=lora), training=training,
                                      model=dataclasses.replace(cfg.model, attn_implementation=attention))
        got = train_step(variant, batch, device, profile=name == "LoRA, shared prefix")
        got["model_tflops"] = got["model_flops"] / got["seconds"] / 1e12
        got["mfu"] = got["model_tflops"] / report["matmul_bf16_tflops"]
        report["trainer"][name] = got
    if device.type != "cpu":
        report["flex_compiled_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - sampler_graphs
        report["flex_against_sdpa"] = flex_against_sdpa(cfg, batch, device)
    report["seconds"] = time.perf_counter() - t
    (args.out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    markdown = as_markdown(report)
    (args.out / "gpu_check.md").write_text(markdown)
    print(markdown)
    return 0


def as_markdown(report: dict) -> str:
    s = report["sampler"]
    lines = [f"GPU check on {report['device']} (torch {report['torch']}), bf16 matmul "
             f"{report['matmul_bf16_tflops']:.3g} TFLOP/s, {report['seconds']:.0f} s", "",
             "| sampler (HF engine) | value |", "|---|---:|"]
    lines += [f"| {key.replace('_', ' ')} | {value:,.4g} |" for key, value in s.items()]
    lines += ["", "| trainer step alone | micro-batches | s | model TFLOP/s | MFU | peak GiB |",
              "|---|---:|---:|---:|---:|---:|"]
    for name, t in report["trainer"].items():
        peak = "" if t["peak_gib"] is None else f"{t['peak_gib']:.1f}"
        lines.append(f"| {name} | {t['micro_batches']} | {t['seconds']:.2f} | {t['model_tflops']:.3g} | "
                     f"{t['mfu']:.1%} | {peak} |")
    lines += [f"| {name}: not run ({why}) | | | | | |" for name, why in report.get("skipped", {}).items()]
    if "flex_against_sdpa" in report:
        gap = report["flex_against_sdpa"]
        lines += ["", f"FlexAttention against SDPA, first micro-batch: loss gap {gap['loss_gap']:.3g}, largest LoRA "
                      f"gradient relative error {gap['lora_grad_relative_error']:.3g}; graphs compiled in all "
                      f"{report['flex_compiled_graphs']}"]
    kernels = report["trainer"]["LoRA, shared prefix"].get("top_kernels", [])
    lines += ["", "| top kernels, one LoRA step | ms | share | calls |", "|---|---:|---:|---:|"]
    lines += [f"| `{k['name']}` | {k['ms']:.1f} | {k['share']:.1%} | {k['calls']} |" for k in kernels]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
