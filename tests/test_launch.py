"""scripts/launch.py: placement, a real two-step run, the time limit, and a killed sampler stopping everything."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import PROCESS_CONFIG, REPO
from grpo.weights import read_latest
from helpers import free_tcp_address

sys.path.insert(0, str(REPO / "scripts"))
from launch import EXIT_SAMPLER_FAILED, format_duration, placement, progress_line, trainer_command  # noqa: E402


@pytest.mark.parametrize("ranks, threads, gpus, cores, samplers, expected_ranks, trainer_gpus, sampler_gpus", [
    (0, 0, 0, 2, 1, 1, "", [""]),  # CPU: one rank, the cores split
    (0, 0, 1, 16, 1, 1, "0", ["0"]),  # one GPU shared
    (0, 0, 3, 16, 1, 2, "0,1", ["2"]),  # the README's three-GPU layout: two train, the last samples
    (0, 0, 8, 64, 1, 7, "0,1,2,3,4,5,6", ["7"]),
    (4, 0, 8, 64, 1, 4, "0,1,2,3", ["7"]),  # override: the sampler keeps the last GPU
    (0, 0, 8, 64, 3, 5, "0,1,2,3,4", ["5", "6", "7"]),  # three samplers, one GPU each
    (0, 0, 2, 16, 2, 1, "0", ["0", "0"]),  # fewer GPUs than processes: all share GPU 0
])
def test_placement(ranks, threads, gpus, cores, samplers, expected_ranks, trainer_gpus, sampler_gpus):
    plan = placement(ranks, threads, gpus, cores, samplers)
    assert plan["ranks"] == expected_ranks
    assert plan["trainer_env"]["CUDA_VISIBLE_DEVICES"] == trainer_gpus
    assert [env["CUDA_VISIBLE_DEVICES"] for env in plan["sampler_envs"]] == sampler_gpus


def test_cpu_threads_do_not_oversubscribe_the_cores():
    plan = placement(0, 0, 0, 2)
    assert plan["trainer_env"]["OMP_NUM_THREADS"] == plan["sampler_envs"][0]["OMP_NUM_THREADS"] == "1"
    assert placement(0, 3, 0, 2)["trainer_env"]["OMP_NUM_THREADS"] == "3"
    assert [env["OMP_NUM_THREADS"] for env in placement(0, 0, 0, 12, 3)["sampler_envs"]] == ["3", "3", "3"]


def test_one_rank_runs_the_worker_itself_and_several_go_through_deepspeed():
    """One rank needs no DeepSpeed runner: the launcher gives it the environment the runner would."""
    command, env = trainer_command(placement(0, 0, 0, 2), ["a=1"])
    assert command[0] == sys.executable and command[-2:] == [str(REPO / "training_worker.py"), "a=1"]
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")} == \
        {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    assert int(env["MASTER_PORT"]) > 0 and env["OMP_NUM_THREADS"] == "1"
    command, env = trainer_command(placement(0, 0, 3, 16), ["a=1"])
    assert Path(command[0]).name == "deepspeed" and command[1:3] == ["--num_gpus", "2"] and "RANK" not in env
    assert command[-2:] == [str(REPO / "training_worker.py"), "a=1"]


def launch(run_dir, model_dir, data_dir, *extra):
    args = [sys.executable, str(REPO / "scripts" / "launch.py"), "--config", str(PROCESS_CONFIG),
            f"run.dir={run_dir}", f"model.name_or_path={model_dir}", f"data.path={data_dir}",
            f"transport.address={free_tcp_address()}", "sampling.prompts_per_step=2", "sampling.group_size=4",
            "sampling.max_new_tokens=1", "lora.r=4", "launch.cpu_threads=1", *extra]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_launcher_runs_both_processes_to_a_clean_end(tmp_path, penalised_digit_model_dir, tiny_gsm8k):
    """Also: a checkpoint whose generation_config carries processors (repetition penalty, ...) is
    sampled from what is recorded: at staleness 0 the trainer's log-probs of the sampled tokens
    equal the recorded ones to float32 precision."""
    proc = launch(tmp_path, penalised_digit_model_dir, tiny_gsm8k, "training.steps=2")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "step 1/2 | reward" in out and "step 2/2 | reward" in out and "done: 2 steps" in out
    # start-up milestones come first: the first step takes minutes with a real model on a CPU
    assert re.search(r"\n  sampler: \d+ prompts from .*\n", out) and "\n  trainer: 1 ranks (gloo)" in out
    assert max(out.index("  sampler: "), out.index("  trainer: ")) < out.index("step 1/2")
    for name in ("config.yaml", "sampler.log", "trainer.log", "metrics.jsonl", "weights", "checkpoints", "tb"):
        assert (tmp_path / name).exists(), name
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["staleness"] == 0 and first["sampling/sampling_logp_difference/max"] < 1e-3
    assert 0.999 < first["sampling/importance_sampling_ratio/min"] <= first["sampling/importance_sampling_ratio/max"] < 1.001


@pytest.mark.parametrize("override, named", [
    ("data.path=openai/gsm8k", "data.path='openai/gsm8k' is a Hugging Face Hub id"),
    ("model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct", "model.name_or_path='Qwen/Qwen2.5-0.5B-Instruct' is a Hugging Face Hub id"),
])
def test_a_hub_id_without_the_hub_fails_in_one_line_before_anything_starts(tmp_path, override, named):
    """No HF_HUB_OFFLINE, an empty Hugging Face cache and a Hub that refuses connections (a closed
    loopback port): the launcher answers in one line naming the key and the fix, and starts nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=free_tcp_address().replace("tcp://", "http://"), HF_HOME=str(tmp_path / "hf"))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "launch.py"), "--config", str(REPO / "config.yaml"),
                           f"run.dir={tmp_path / 'run'}", override], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {named}") and "the Hub cannot be reached" in proc.stderr
    fix = "data.path=gsm8k-embedded" if override.startswith("data") else "model.name_or_path=smollm2-135m-instruct"
    assert fix in proc.stderr
    assert elapsed < 10 and not (tmp_path / "run").exists()


def test_killed_sampler_stops_the_trainer_and_fails_the_launch(tmp_path, digit_model_dir, tiny_gsm8k):
    proc = launch(tmp_path, digit_model_dir, tiny_gsm8k, "training.steps=500", "sampling.max_staleness=0")
    lines = []
    try:
        for line in proc.stdout:  # wait for training to be under way
            lines.append(line)
            if line.startswith("step 1/500"):
                break
        children = psutil.Process(proc.pid).children(recursive=True)
        sampler = next(p for p in children if "sampling_worker.py" in " ".join(p.cmdline()))
        trainers = [p for p in children if "training_worker.py" in " ".join(p.cmdline())]
        os.kill(sampler.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_SAMPLER_FAILED, "".join(lines) + out
    assert "the sampler failed (exit code -9); stopping the trainer" in out
    time.sleep(1)
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in trainers)


def test_time_limit_stops_both_cleanly_with_a_checkpoint(tmp_path, digit_model_dir, tiny_gsm8k):
    proc = launch(tmp_path, digit_model_dir, tiny_gsm8k, "training.steps=500", "launch.max_minutes=0.75")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    steps = len((tmp_path / "metrics.jsonl").read_text().splitlines())
    reported = re.search(r"time limit: 0.75 min reached after (\d+) steps", out)
    assert reported and 0 < int(reported[1]) <= steps < 500, out  # a step may finish while it stops
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["step"] == steps and (tmp_path / "checkpoints" / f"step{state['step']:06d}").is_dir()
    assert read_latest(tmp_path / "weights") == state["step"]  # the result is the last trained version


def test_progress_line_and_eta_past_a_day():
    assert format_duration(3723) == "1:02:03" and format_duration(90_000) == "25:00:00"
    row = {"step": 4, "reward": -0.4375, "strict/answer_accuracy": 0.0625, "strict/format_rate": 0.125, "kl": 0.0019}
    line = progress_line(row, 1000, [77.7])
    assert line == ("step 4/1000 | reward -0.438 | answer   6.2% | format  12.5% | kl 0.0019 |   77.7 s/step | "
                    "ETA 21:29:49")


def test_a_run_with_truncated_importance_sampling(tmp_path, penalised_digit_model_dir, tiny_gsm8k):
    """training.importance_sampling=token_truncate through the real processes: the weights are
    logged, at most the cap, and 1 to float32 precision at staleness 0 (no engine mismatch)."""
    proc = launch(tmp_path, penalised_digit_model_dir, tiny_gsm8k, "training.steps=2",
                  "training.importance_sampling=token_truncate", "training.importance_sampling_cap=1.5")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0 < r["importance_sampling/weight_mean"] <= 1.5 for r in rows)
    assert rows[0]["staleness"] == 0 and abs(rows[0]["importance_sampling/weight_mean"] - 1) < 1e-3
