"""Our sampler + trainer against TRL's GRPOTrainer on the same work, one after the other in one run.

    make bench-trl                                   # installs requirements-bench.txt, then runs this
    .venv/bin/python scripts/benchmarks/bench_vs_trl.py [--workloads gsm8k,long] [--steps 8] [--warmup 2]
                                             [--out runs/bench/vs_trl.json] [key=value ...]

Both systems get the same model (the configured one, the embedded SmolLM2-135M-Instruct by
default, LoRA r 16 on the attention projections), the same prompts in the same order (our
prompt text and our PromptCursor's order, given to TRL as plain-text prompts with shuffling off),
G, temperature, completion limit, learning rate, KL beta, loss aggregation, rewards and steps.

Beside the TRL ratio it prints the machine's ceiling, measured in the same run before the
workloads: the fp32 matmul rate on the model's own shapes (grpo/model/flops.py) with one process's
threads and with all cores; our model FLOPs per step (the trainer's and the generation's, from
metrics.jsonl) and their share of that ceiling (MFU) per process and end to end; and with
`--sync` (on by default) ours again at `sampling.max_staleness=0`, same work: the
asynchronous-over-synchronous tokens/s ratio; with `--bf16` (on by default) ours again at
`model.dtype=bfloat16` (sampler and trainer; this CPU multiplies bf16 at ~2.2x its fp32 rate),
and TRL in bfloat16 too (its model loaded in bf16 and GRPOConfig's bf16 mode): ours/TRL like for
like.

Workloads: `gsm8k` (plain questions, 2 prompts x G 8 per step, completions <= 128 tokens) and
`long` (4 solved train examples before each question, ~660 prompt tokens, G 8, completions
<= 64 tokens). Each system runs in its own subprocess; a thread samples the memory of its
whole process tree every 0.5 s (summed RSS, as asked, and summed PSS, which counts pages
shared between our processes once). The first `--warmup` steps (model load, first
generation) are not timed. Printed per system: median step time, completion tokens trained
per second over the timed steps, peak memory, and ours / TRL; for ours also the median
per-step timings from metrics.jsonl and the overlap efficiency (step time over
max(sampler busy, trainer busy)).
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

WORKLOADS = {
    "gsm8k": ["data.few_shot=0", "sampling.prompts_per_step=2", "sampling.group_size=8",
              "sampling.max_new_tokens=128"],
    "long": ["data.few_shot=4", "sampling.prompts_per_step=2", "sampling.group_size=8",
             "sampling.max_new_tokens=64", "data.max_prompt_tokens=2048"],
}
SAMPLER_TIMINGS = ["timing/weights_wait_s", "timing/generate_s", "timing/rewards_s", "timing/logprobs_s",
                   "timing/previous_send_s"]
TRAINER_TIMINGS = ["timing/wait_s", "timing/forward_backward_s", "timing/optimizer_s", "timing/publish_s"]


# ---------------------------------------------------------------------------- measuring


def process_label(cmdline: list[str], parent_cmdline: list[str]) -> str:
    """Which part of a run a process is, from its command line and its parent's."""
    text = " ".join(cmdline)
    if "--trl-worker" in text:
        return "TRL"
    if "grpo.workers.sampler" in cmdline or "sampling_worker.py" in text:
        return "reward sandbox" if cmdline == parent_cmdline else "sampler"  # forked by the sampler
    if "grpo.workers.trainer" in cmdline or "training_worker.py" in text:
        if "deepspeed.launcher.launch" in text:
            return "DeepSpeed launcher"
        if len(cmdline) > 1 and Path(cmdline[1]).name == "deepspeed":
            return "DeepSpeed runner"
        return "trainer rank"
    if "grpo.commands.train" in text or cmdline[1:3] == ["-m", "grpo"] or \
            Path(cmdline[min(1, len(cmdline) - 1)]).name == "grpo":
        return "launcher"
    return "other"


def tree_memory(pid: int, labels: dict | None = None) -> tuple[int, int, dict[str, int]]:
    """(summed RSS, summed PSS) in bytes of a process and all its descendants, and the RSS summed
    by `process_label`. `labels` remembers each process's label across calls: an exiting process
    has no command line left but still its memory, which stays counted under its own label."""
    labels = {} if labels is None else labels
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0, {}
    rss = pss = 0
    by_label: dict[str, int] = {}
    for proc in procs:
        try:
            info = proc.memory_full_info()
            parent = proc.parent()
            cmdline = proc.cmdline()
            key = (proc.pid, proc.create_time())
            if cmdline or key not in labels:
                labels[key] = process_label(cmdline, parent.cmdline() if parent else [])
            label = labels[key]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        rss, pss = rss + info.rss, pss + getattr(info, "pss", info.rss)
        by_label[label] = by_label.get(label, 0) + info.rss
    return rss, pss, by_label


def run_measured(cmd: list[str], log_path: Path, env: dict) -> dict:
    """Run `cmd` to the end; its exit code, wall time, peak tree memory and each part's peak RSS."""
    peak, labels = {"rss": 0, "pss": 0, "rss_by_process": {}}, {}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        done = threading.Event()

        def watch():
            while not done.is_set():
                rss, pss, by_label = tree_memory(proc.pid, labels)
                peak["rss"], peak["pss"] = max(peak["rss"], rss), max(peak["pss"], pss)
                for label, value in by_label.items():
                    peak["rss_by_process"][label] = max(peak["rss_by_process"].get(label, 0), value)
                done.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        start = time.perf_counter()
        watcher.start()
        code = proc.wait()
        done.set()
        watcher.join()
    return {"exit_code": code, "wall_s": time.perf_counter() - start, "peak_rss": peak["rss"], "peak_pss": peak["pss"],
            "peak_rss_by_process": peak["rss_by_process"]}


def summarize(step_end_times: list[float], completion_tokens: list[int], warmup: int) -> dict:
    """Median step time and completion tokens per second over the steps after `warmup`.

    Step i's time is end[i] - end[i-1]; the timed window runs from the end of step `warmup`
    to the end of the last step, and counts the completion tokens of the steps inside it.
    """
    if len(step_end_times) != len(completion_tokens) or len(step_end_times) < warmup + 2:
        raise ValueError(f"need at least {warmup + 2} steps with times and token counts, got "
                         f"{len(step_end_times)} times and {len(completion_tokens)} counts")
    times = step_end_times[warmup:]
    steps = [b - a for a, b in zip(times, times[1:])]
    tokens = sum(completion_tokens[warmup + 1:])
    return {"timed_steps": len(steps), "median_step_s": statistics.median(steps),
            "completion_tokens_per_s": tokens / (times[-1] - times[0]), "timed_completion_tokens": tokens}


def model_flops_rates(rows: list[dict], warmup: int) -> dict:
    """Over the timed steps: the trainer's and the generation's median model GFLOP/s of their own
    busy time, and all model GFLOPs done per second of wall time (both processes together)."""
    timed = rows[warmup + 1:]
    times = [r["wall_time"] for r in rows[warmup:]]
    done = sum(r["perf/trainer_model_gflop"] + r.get("perf/generation_model_gflop", 0.0) for r in timed)
    return {"trainer_gflop_per_s": statistics.median(r["perf/trainer_gflop_per_s"] for r in timed),
            "generation_gflop_per_s": statistics.median(r.get("perf/generation_gflop_per_s", 0.0) for r in timed),
            "trainer_model_gflop_per_step": statistics.median(r["perf/trainer_model_gflop"] for r in timed),
            "generation_model_gflop_per_step": statistics.median(r.get("perf/generation_model_gflop", 0.0)
                                                                 for r in timed),
            "end_to_end_gflop_per_s": done / (times[-1] - times[0])}


def matmul_ceiling(config: Path, overrides: list[str]) -> dict:
    """GFLOP/s of fp32 matmuls of the model's shapes with one process's threads (the launcher gives
    the trainer and the sampler half the cores each) and with all of them."""
    import torch

    from grpo.commands.local import placement
    from grpo.config import parse_cli
    from grpo.model.flops import ModelShape, measure_matmul_rate
    from grpo.model.loading import load_model
    from grpo.run.preflight import named_code_problems

    cfg = parse_cli(["--config", str(config), *overrides], checks=[named_code_problems])
    shape = ModelShape.of(load_model(cfg.model))
    cores = os.cpu_count() or 1
    per_process = int(placement(0, cfg.launch.cpu_threads, 0, cores)["trainer_env"]["OMP_NUM_THREADS"])
    rates = {}
    for threads in sorted({per_process, cores}):
        torch.set_num_threads(threads)
        rates[threads] = measure_matmul_rate(shape) / 1e9
    return {"per_process_threads": per_process, "cores": cores, "gflop_per_s": rates}


def overlap_efficiency(rows: list[dict], warmup: int) -> dict:
    """Median per-step timings of both processes and step time over max(sampler busy, trainer busy).

    Busy: the sampler's generate + rewards + log-probs + send, the trainer's forward-backward +
    optimizer + publish. 1.0 means the slower process never waits for the other.
    """
    timed = rows[warmup + 1:]
    medians = {k: statistics.median(r.get(k, 0.0) for r in timed) for k in SAMPLER_TIMINGS + TRAINER_TIMINGS}
    sampler_busy = statistics.median(sum(r.get(k, 0.0) for k in SAMPLER_TIMINGS[1:]) for r in timed)
    trainer_busy = statistics.median(sum(r.get(k, 0.0) for k in TRAINER_TIMINGS[1:]) for r in timed)
    times = [r["wall_time"] for r in rows[warmup:]]
    step = statistics.median(b - a for a, b in zip(times, times[1:]))
    return {"medians": medians, "sampler_busy_s": sampler_busy, "trainer_busy_s": trainer_busy,
            "overlap_efficiency": step / max(sampler_busy, trainer_busy)}


# ---------------------------------------------------------------------------- the two systems


def run_ours(workload: str, args, overrides: list[str], folder: Path, name: str = "ours") -> dict:
    from grpo.run.ports import free_loopback_address

    run_dir = folder / f"{name}-{workload}"
    cmd = [sys.executable, "-m", "grpo", "train", "--config", str(args.config), f"run.dir={run_dir}",
           *WORKLOADS[workload], f"training.steps={args.steps}", "checkpoint.every=100000",
           "logging.tensorboard=false", f"transport.address={free_loopback_address()}", *overrides]
    measured = run_measured(cmd, folder / f"{name}-{workload}.log", dict(os.environ))
    if measured["exit_code"] != 0:
        raise SystemExit(f"our run failed ({measured['exit_code']}); see {folder / f'{name}-{workload}.log'} "
                         f"and {run_dir}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    result = summarize([r["wall_time"] for r in rows], [r["trainer/completion_tokens"] for r in rows], args.warmup)
    return {**measured, **result, **overlap_efficiency(rows, args.warmup), **model_flops_rates(rows, args.warmup)}


def run_trl(workload: str, args, overrides: list[str], folder: Path, name: str = "trl") -> dict:
    out = folder / f"{name}-{workload}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", workload, "--steps", str(args.steps),
           "--config", str(args.config), "--out", str(out), *overrides]
    measured = run_measured(cmd, folder / f"{name}-{workload}.log", dict(os.environ))
    if measured["exit_code"] != 0:
        raise SystemExit(f"the TRL run failed ({measured['exit_code']}); see {folder / f'{name}-{workload}.log'}")
    steps = json.loads(out.read_text())
    result = summarize([s["end_time"] for s in steps], [s["completion_tokens"] for s in steps], args.warmup)
    return {**measured, **result}


def trl_worker(workload: str, steps: int, config: Path, out: Path, overrides: list[str]) -> None:
    """Runs in the TRL subprocess: GRPOTrainer with our settings, prompts and rewards."""
    import torch
    from transformers import TrainerCallback

    from grpo.config import parse_cli
    from grpo.run.preflight import named_code_problems

    cfg = parse_cli(["--config", str(config), *WORKLOADS[workload], f"training.steps={steps}", *overrides],

                    checks=[named_code_problems])
    sampling = cfg.sampling

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_log(self, _args, state, _control, logs=None, **_):
            if logs and "completions/mean_length" in logs:
                self.steps.append({"step": state.global_step, "end_time": time.time(),
                                   "completion_tokens": round(logs["completions/mean_length"]
                                                              * sampling.prompts_per_step * sampling.group_size)})

    from trl_recipe import trl_prompt_rows, trl_trainer

    callback = StepTimes()
    trainer = trl_trainer(cfg, trl_prompt_rows(cfg, steps), out.parent / f"trl-{workload}", steps, [callback])
    print(f"TRL {__import__('trl').__version__}, torch threads {torch.get_num_threads()}", flush=True)
    trainer.train()
    out.write_text(json.dumps(callback.steps))


# ---------------------------------------------------------------------------- report


def table(workload: str, results: dict, args) -> str:
    ours, trl = results["ours"], results["trl"]
    lines = [f"workload {workload}: {' '.join(WORKLOADS[workload])}, {args.steps} steps, first {args.warmup} not timed",
             f"{'system':<6} {'median step s':>14} {'compl. tok/s':>13} {'peak RSS MiB':>13} {'peak PSS MiB':>13}"]
    for name, r in (("ours", ours), ("TRL", trl)):
        lines.append(f"{name:<6} {r['median_step_s']:>14.2f} {r['completion_tokens_per_s']:>13.2f} "
                     f"{r['peak_rss'] / 2**20:>13.0f} {r['peak_pss'] / 2**20:>13.0f}")
    lines.append(f"ours/TRL: tokens/s x{ours['completion_tokens_per_s'] / trl['completion_tokens_per_s']:.2f}, "
                 f"step time x{ours['median_step_s'] / trl['median_step_s']:.2f}, "
                 f"peak RSS x{ours['peak_rss'] / trl['peak_rss']:.2f}, "
                 f"peak PSS x{ours['peak_pss'] / trl['peak_pss']:.2f}")
    ceiling = results["ceiling"]
    one, every = ceiling["gflop_per_s"][ceiling["per_process_threads"]], ceiling["gflop_per_s"][ceiling["cores"]]
    lines.append(f"ceiling: fp32 matmuls of the model's shapes {one:.1f} GFLOP/s on {ceiling['per_process_threads']} "
                 f"thread(s), {every:.1f} on {ceiling['cores']}")
    lines.append(f"ours, model GFLOP per step: trainer {ours['trainer_model_gflop_per_step']:.0f}, generation "
                 f"{ours['generation_model_gflop_per_step']:.0f}; MFU: trainer "
                 f"{ours['trainer_gflop_per_s'] / one:.0%}, generation {ours['generation_gflop_per_s'] / one:.0%} "
                 f"(of {ceiling['per_process_threads']} thread(s), busy time), end to end "
                 f"{ours['end_to_end_gflop_per_s'] / every:.0%} (of {ceiling['cores']}, wall time)")
    if "variant" in results:
        lines.append(variant_line(f"ours with {' '.join(args.variant)}", results["variant"], ours, trl, one, every))
    if "sync" in results:
        sync = results["sync"]
        lines.append(f"ours async/sync (max_staleness 1 vs 0): tokens/s "
                     f"x{ours['completion_tokens_per_s'] / sync['completion_tokens_per_s']:.2f} "
                     f"({ours['completion_tokens_per_s']:.2f} vs {sync['completion_tokens_per_s']:.2f}), step time "
                     f"{ours['median_step_s']:.2f} vs {sync['median_step_s']:.2f} s")
    if "bf16" in results:
        lines.append(variant_line("ours in bfloat16 (model.dtype=bfloat16)", results["bf16"], ours, trl, one, every))
    if "trl_bf16" in results:  # like for like: both in bfloat16
        bf16, trl16 = results["bf16"], results["trl_bf16"]
        lines.append(f"TRL in bfloat16 (its weights in bf16, GRPOConfig bf16=True): tokens/s "
                     f"{trl16['completion_tokens_per_s']:.2f}, step {trl16['median_step_s']:.2f} s, peak RSS "
                     f"{trl16['peak_rss'] / 2**20:.0f} MiB")
        lines.append(f"ours/TRL, both in bfloat16: tokens/s "
                     f"x{bf16['completion_tokens_per_s'] / trl16['completion_tokens_per_s']:.2f}, "
                     f"step time x{bf16['median_step_s'] / trl16['median_step_s']:.2f}, "
                     f"peak RSS x{bf16['peak_rss'] / trl16['peak_rss']:.2f}")
    for name, r in (("ours", ours), ("TRL", trl)):
        parts = sorted(r["peak_rss_by_process"].items(), key=lambda kv: -kv[1])
        lines.append(f"{name}, peak RSS by process (MiB, each part's own peak): "
                     + ", ".join(f"{label} {value / 2**20:.0f}" for label, value in parts))
    m = ours["medians"]
    lines.append("ours, median per step (s): " + ", ".join(f"{k.split('/')[1][:-2]} {v:.2f}" for k, v in m.items()))
    lines.append(f"ours, overlap: sampler busy {ours['sampler_busy_s']:.2f} s, "
                 f"trainer busy {ours['trainer_busy_s']:.2f} s, "
                 f"step / max(busy) = {ours['overlap_efficiency']:.2f}")
    return "\n".join(lines)


def variant_line(label: str, r: dict, ours: dict, trl: dict, one: float, every: float) -> str:
    """A variant of ours against ours and TRL: throughput, step time, MFU, busy times, memory."""
    return (f"{label}: tokens/s {r['completion_tokens_per_s']:.2f}, "
            f"x{r['completion_tokens_per_s'] / ours['completion_tokens_per_s']:.2f} ours, "
            f"x{r['completion_tokens_per_s'] / trl['completion_tokens_per_s']:.2f} TRL; "
            f"step {r['median_step_s']:.2f} s; MFU trainer {r['trainer_gflop_per_s'] / one:.0%}, "
            f"generation {r['generation_gflop_per_s'] / one:.0%}, end to end "
            f"{r['end_to_end_gflop_per_s'] / every:.0%}; sampler busy {r['sampler_busy_s']:.2f} s, trainer busy "
            f"{r['trainer_busy_s']:.2f} s; peak RSS {r['peak_rss'] / 2**20:.0f} MiB "
            f"(x{r['peak_rss'] / ours['peak_rss']:.2f})")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="gsm8k,long")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "vs_trl.json")
    parser.add_argument("--sync", action=argparse.BooleanOptionalAction, default=True,
                        help="also run ours at sampling.max_staleness=0 for the async/sync ratio")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True,
                        help="also run ours and TRL at model.dtype=bfloat16: ours' ratio to ours in fp32, and ours/TRL "
                             "with both in bf16")
    parser.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE",
                        help="also run ours with these overrides (repeatable; together one variant), reported beside "
                             "ours with its MFU and busy times, e.g. --variant training.reference_on=sampler")
    parser.add_argument("--trl-worker", default=None, help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker, args.steps, args.config, args.out, overrides)
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: make bench-trl (or .venv/bin/pip install -r requirements-bench.txt)",
              file=sys.stderr)
        return 2
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown or args.steps < args.warmup + 2:
        print(f"workloads are {', '.join(WORKLOADS)}; --steps must be >= --warmup + 2", file=sys.stderr)
        return 2
    folder = Path(tempfile.mkdtemp(prefix="bench_vs_trl_"))
    ceiling = matmul_ceiling(args.config, overrides)  # before anything else runs
    report, printed = {}, []
    for workload in args.workloads.split(","):
        results = {"ceiling": ceiling, "ours": run_ours(workload, args, overrides, folder),
                   "trl": run_trl(workload, args, overrides, folder)}
        if args.variant:
            results["variant"] = run_ours(workload, args, [*overrides, *args.variant], folder, name="variant")
        if args.sync:
            results["sync"] = run_ours(workload, args, [*overrides, "sampling.max_staleness=0"], folder, name="sync")
        if args.bf16:
            results["bf16"] = run_ours(workload, args, [*overrides, "model.dtype=bfloat16"], folder, name="bf16")
            results["trl_bf16"] = run_trl(workload, args, [*overrides, "model.dtype=bfloat16"], folder, name="trl-bf16")
        report[workload] = results
        printed.append(table(workload, results, args))
        print(printed[-1] + "\n", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "warmup": args.warmup, "overrides": overrides,
                                    "cpu_count": os.cpu_count(), "results": report}, indent=1))
    print(f"wrote {args.out}; logs and run folders in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
