"""grpo train: placement, --help and --dry-run plans, the rank check, the fresh-start guard, a
real two-step run, two runs at once, the time limit, and a killed sampler stopping everything."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import PROCESS_CONFIG, REPO
from helpers import closed_pipe, command_line, free_tcp_address

from grpo.commands.local import (  # noqa: E402
    EXIT_SAMPLER_FAILED,
    gpu_count,
    placement,
    placement_problem,
    rank_problem,
    trainer_command,
)
from grpo.commands.train import main  # noqa: E402
from grpo.run.preflight import planning_note  # noqa: E402
from grpo.run.progress import StepProgress, format_duration, progress_line, stop_summary  # noqa: E402
from grpo.weights.folder import read_latest


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
    command, env = trainer_command(placement(0, 0, 0, 2), ["a=1"], 29511)
    assert command == [sys.executable, "-u", "-m", "grpo.workers.trainer", "a=1"]
    assert env == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "RANK": "0",
                   "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29511"}
    command, env = trainer_command(placement(0, 0, 3, 16), ["a=1"], 29511)
    assert command == [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29511",
                       "--module", "grpo.workers.trainer", "a=1"]
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1"}


def test_help_says_how_to_start_and_where_the_keys_are():
    proc = subprocess.run([sys.executable, "-m", "grpo", "train", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == ""
    lines = proc.stdout.splitlines()
    assert lines[0] == "usage: grpo train [--config config.yaml] [--dry-run] [key=value ...]"
    assert lines[1] == "       python -m grpo train ...    (the same with a given interpreter)"
    assert lines[2].startswith('       make train ARGS="..."    (passes the same')
    for text in ("config.yaml by default", "configs/ holds recipes", "--help-config", "docs/config.md", "--gpus N"):
        assert text in proc.stdout, text


def dry_run(capsys, *args, gpus: int | None):
    """The launcher's --dry-run, in this process, planning for `gpus` GPUs (None: this machine's):
    (exit code, stdout, stderr)."""
    code = main(["--config", str(PROCESS_CONFIG), "--dry-run", *(["--gpus", str(gpus)] if gpus is not None else []),
                 *args])
    out, err = capsys.readouterr()
    return code, out, err


def read_plan(out: str) -> tuple[dict, dict]:
    """The dry run's facts ({"start": ...}) and processes ({"trainer": {"what", "env", "command"}})."""
    assert out.splitlines()[0] == "dry run: nothing is started, created or moved"
    facts, processes, current = {}, {}, None
    for line in out.splitlines()[1:]:
        if line.startswith("  "):
            field, value = line.split(maxsplit=1)
            processes[current][field] = shlex.split(value) if field == "command" else value
        elif line[:11].strip() == "trainer" or line.startswith("sampler"):
            current = line[:11].strip()
            processes[current] = {"what": line[12:]}
        else:
            facts[line[:11].strip()] = line[12:]
    return facts, processes


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


CPU3 = "OMP_NUM_THREADS=3 MKL_NUM_THREADS=3 CUDA_VISIBLE_DEVICES="


@pytest.mark.parametrize("gpus, extra, trainer, trainer_env, samplers", [
    (0, ["launch.cpu_threads=3"], "1 rank, CPU, 3 threads", CPU3, {"sampler": ("engine hf, CPU, 3 threads", CPU3)}),
    (1, [], "1 rank, CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=0",
     {"sampler": ("engine hf, CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=0")}),
    (2, [], "1 rank, CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=0",
     {"sampler": ("engine hf, CUDA_VISIBLE_DEVICES=1", "CUDA_VISIBLE_DEVICES=1")}),
    (8, ["sampling.prompts_per_step=14"], "7 ranks, CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6",
     "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6",
     {"sampler": ("engine hf, CUDA_VISIBLE_DEVICES=7", "CUDA_VISIBLE_DEVICES=7")}),
    (8, ["sampling.prompts_per_step=12", "sampling.num_workers=2"], "6 ranks, CUDA_VISIBLE_DEVICES=0,1,2,3,4,5",
     "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5", {"sampler0": ("engine hf, CUDA_VISIBLE_DEVICES=6", "CUDA_VISIBLE_DEVICES=6"),
                                          "sampler1": ("engine hf, CUDA_VISIBLE_DEVICES=7", "CUDA_VISIBLE_DEVICES=7")}),
])
def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path, capsys, gpus, extra, trainer, trainer_env, samplers):
    run_dir = tmp_path / "run"
    code, out, err = dry_run(capsys, f"run.dir={run_dir}", *extra, gpus=gpus)
    note = planning_note(gpus, gpu_count())  # a plan for GPUs this machine lacks says so
    assert code == 0 and err == (f"warning: {note}\n" if note else ""), err
    assert list(tmp_path.iterdir()) == []  # no run folder, no lock file
    facts, processes = read_plan(out)
    address, port = facts["transport"].split()[0], facts["deepspeed"].split()[2]
    assert facts == {"run folder": f"{run_dir} (does not exist yet)", "start": "fresh start",
                     "machine": f"{gpus} GPU{'s' * (gpus != 1)} (--gpus), {os.cpu_count()} CPU cores",
                     "transport": f"{address} (a free loopback port; a real start picks its own)",
                     "deepspeed": f"master port {port} (a real start picks its own free port)"}
    assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+", address) and not address.endswith(f":{port}")
    args = ["--config", str(PROCESS_CONFIG), f"run.dir={run_dir}", *extra, f"sampling.num_workers={len(samplers)}",
            f"transport.address={address}"]
    ranks = int(trainer.split()[0])
    if ranks == 1:  # the worker itself, with the environment DeepSpeed's runner would give it
        command = [sys.executable, "-u", "-m", "grpo.workers.trainer", *args]
        trainer_env += f" RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT={port}"
    else:
        command = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(ranks), "--master_port", port,
                   "--module", "grpo.workers.trainer", *args]
    assert list(processes) == ["trainer", *samplers]
    assert processes["trainer"] == {"what": trainer, "env": trainer_env, "command": command}
    for i, (name, (what, env)) in enumerate(samplers.items()):
        assert processes[name] == {"what": what, "env": env, "command": [
            sys.executable, "-m", "grpo.workers.sampler", *args, f"sampling.worker_index={i}"]}


USED = {"metrics.jsonl": '{"step": 1, "reward": 0.5}\n', "weights/v000001/manifest.json": "{}"}


@pytest.mark.parametrize("made, extra, code, start", [
    ({"trainer.log": "x"}, [], 0, "fresh start"),  # only logs: nothing a fresh start would mix with
    ({"checkpoints/latest": "global_step4"}, [], 0,
     "resume from {run}/checkpoints (checkpoint global_step4)"),
    (USED, [], 2, "run folder {run} (run.name=gsm8k-lora-grpo) already holds published weights v1, "
                  "metrics.jsonl (1 rows), and this start is a fresh one (there is no checkpoint to resume from); "
                  "nothing was changed. Pick a new run.name, or set run.overwrite=true to move the old contents "
                  "aside into a dated folder"),
    (USED, ["run.overwrite=true"], 0, "fresh start; the old contents (published weights v1, metrics.jsonl (1 rows)) "
                                      "are first moved aside into run.replaced-<date> beside it (run.overwrite=true)"),
])
def test_dry_run_says_whether_it_would_start_fresh_resume_or_refuse(tmp_path, capsys, made, extra, code, start):
    run_dir = tmp_path / "run"
    for name, text in made.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)
    before = snapshot(tmp_path)
    result, out, err = dry_run(capsys, f"run.dir={run_dir}", *extra, gpus=0)
    assert result == code and snapshot(tmp_path) == before
    facts, _ = read_plan(out)
    assert facts["run folder"] == f"{run_dir} (exists)" and facts["start"] == start.format(run=run_dir)
    assert err == ("" if code == 0 else f"error: {facts['start']}\n")


def test_more_trainer_ranks_than_groups_a_step_is_refused_in_one_line(tmp_path, capsys):
    code, out, err = dry_run(capsys, f"run.dir={tmp_path / 'run'}", gpus=8)  # the process config: 2 prompts a step
    note = planning_note(8, gpu_count())
    err = err.replace(f"warning: {note}\n" if note else "", "")
    assert code == 2 and out == ""
    assert err == ("error: 8 GPUs give 7 trainer ranks but sampling.prompts_per_step=2 gives only 2 groups a step: "
                   "raise sampling.prompts_per_step to >= 7 (a multiple of 7 balances the ranks) or set "
                   "launch.trainer_ranks=2\n")
    code, out, err = dry_run(capsys, f"run.dir={tmp_path / 'run'}", "sampling.prompts_per_step=10", gpus=8)
    assert code == 0 and read_plan(out)[1]["trainer"]["what"] == "7 ranks, CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6"
    err = err.replace(f"warning: {note}\n" if note else "", "")
    assert err == ("warning: sampling.prompts_per_step=10 is not a multiple of the 7 trainer ranks: some ranks train 2 "
                   "groups a step, others 1, and each step waits for the busiest\n")
    assert list(tmp_path.iterdir()) == []


def test_rank_problem_names_an_explicit_launch_trainer_ranks():
    from grpo.config import Config

    cfg = Config()  # not validated: the config rule refuses this before the launcher would
    cfg.launch.trainer_ranks, cfg.sampling.prompts_per_step = 4, 3
    assert rank_problem(4, 8, cfg) == (
        "launch.trainer_ranks=4 gives 4 trainer ranks but sampling.prompts_per_step=3 gives only 3 groups a step: "
        "raise sampling.prompts_per_step to >= 4 (a multiple of 4 balances the ranks) or set launch.trainer_ranks=3")
    assert rank_problem(3, 8, cfg) is None


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8"],
     "error: --gpus plans for another machine and goes with --dry-run only; a real start counts its GPUs"),
    (["--dry-run", "--gpus", "eight"], "error: --gpus needs a number of GPUs; got 'eight'"),
])
def test_gpus_is_for_planning_only(capsys, args, message):
    assert main(args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == message + "\n"


def launch_command(run_dir, model_dir, data_dir, *extra, own_address=True):
    """A tiny run; with own_address=False the launcher picks the transport address itself."""
    address = [f"transport.address={free_tcp_address()}"] if own_address else []
    return [sys.executable, "-m", "grpo", "train", "--config", str(PROCESS_CONFIG),
            f"run.dir={run_dir}", f"model.name_or_path={model_dir}", f"data.path={data_dir}", *address,
            "sampling.prompts_per_step=2", "sampling.group_size=4", "sampling.max_new_tokens=1", "lora.r=4",
            "launch.cpu_threads=1", *extra]


def launch(run_dir, model_dir, data_dir, *extra, own_address=True, env=None):
    return subprocess.Popen(launch_command(run_dir, model_dir, data_dir, *extra, own_address=own_address), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})


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
    shown = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [(r["step"], r["sampler"]) for r in shown] == [(1, 0)] * 4 + [(2, 0)] * 4  # logging.completions_per_step
    assert set(shown[0]) == {"step", "sampler", "sample_id", "prompt", "completion", "rewards", "reward", "advantage"}
    assert shown[0]["prompt"][-1]["role"] == "user" and "plus 0" in shown[0]["prompt"][-1]["content"]
    assert list(shown[0]["rewards"]) == ["gsm8k_answer_lenient", "think_answer_format_partial"]
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["staleness"] == 0 and first["sampling/sampling_logp_difference/max"] < 1e-3
    assert (0.999 < first["sampling/importance_sampling_ratio/min"]
            <= first["sampling/importance_sampling_ratio/max"] < 1.001)


def test_a_launcher_whose_reader_is_gone_stops_what_it_started(tmp_path, digit_model_dir, tiny_gsm8k):
    """`grpo train ... | head -0`: the line naming the started processes is the first write; it fails, and the
    launcher stops the trainer and the sampler (started in sessions of their own) and exits 130."""
    with closed_pipe() as stdout:
        proc = subprocess.run(launch_command(tmp_path, digit_model_dir, tiny_gsm8k, "training.steps=50"), cwd=REPO,
                              stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300,
                              env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"})
    assert (proc.returncode, proc.stderr) == (130, ""), proc.stderr[-2000:]
    left = [p for p in psutil.process_iter(["cmdline"]) if f"run.dir={tmp_path}" in " ".join(p.info["cmdline"] or [])]
    assert left == []
    assert (tmp_path / "trainer.log").exists() and (tmp_path / "sampler.log").exists()  # they had started


def make_used(run_dir: Path) -> None:
    """A run folder as a finished run leaves it: published weights and metrics."""
    for name, text in USED.items():
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_text(text)


def test_a_fresh_start_into_a_used_run_folder_is_refused_and_changes_nothing(tmp_path, digit_model_dir, tiny_gsm8k):
    run_dir = tmp_path / "run"
    make_used(run_dir)
    before = snapshot(run_dir)
    proc = subprocess.run(launch_command(run_dir, digit_model_dir, tiny_gsm8k, "training.steps=1"), cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"error: run folder {run_dir} (run.name=gsm8k-lora-grpo) already holds ")
    assert "run.overwrite=true" in proc.stderr
    assert snapshot(run_dir) == before


def test_two_runs_at_once_pick_their_own_addresses(tmp_path, digit_model_dir, tiny_gsm8k):
    """Two launches on one machine, neither given transport.address: each picks a free loopback port,
    passes it to its processes (their config.yaml records it), writes it to <run>/address and prints
    it. The second also starts fresh over a used folder with run.overwrite=true: the old contents
    are found beside it in <name>.replaced-<date>."""
    first, second = tmp_path / "first", tmp_path / "second"
    make_used(second)
    old = snapshot(second)
    procs = [launch(first, digit_model_dir, tiny_gsm8k, "training.steps=2", own_address=False),
             launch(second, digit_model_dir, tiny_gsm8k, "training.steps=2", "run.overwrite=true", own_address=False)]
    outs = [proc.communicate(timeout=600)[0] for proc in procs]
    for proc, out in zip(procs, outs):
        assert proc.returncode == 0, out
        assert "done: 2 steps" in out
    addresses = [(run_dir / "address").read_text() for run_dir in (first, second)]
    assert addresses[0] != addresses[1]
    for run_dir, address, out in zip((first, second), addresses, outs):
        assert re.fullmatch(r"tcp://127\.0\.0\.1:\d+\n", address)
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["transport"]["address"] == address.strip()
        assert f"; transport {address.strip()}; logs in " in out
        assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 2
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("second.replaced-")]
    assert len(moved) == 1 and f"run.overwrite=true: the old contents of {second} were moved to {moved[0]}\n" in outs[1]
    assert {name: data for name, data in snapshot(moved[0]).items() if name in old} == old
    assert not any(p.name.startswith("first.replaced-") for p in tmp_path.iterdir())


@pytest.mark.parametrize("override, named", [
    ("data.path=openai/gsm8k", "data.path='openai/gsm8k' is a Hugging Face Hub id"),
    ("model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct",
     "model.name_or_path='Qwen/Qwen2.5-0.5B-Instruct' is a Hugging Face Hub id"),
])
def test_a_hub_id_without_the_hub_fails_in_one_line_before_anything_starts(tmp_path, override, named):
    """No HF_HUB_OFFLINE, an empty Hugging Face cache and a Hub that refuses connections (a closed
    loopback port): the launcher answers in one line naming the key and the fix, and starts nothing."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=free_tcp_address().replace("tcp://", "http://"), HF_HOME=str(tmp_path / "hf"))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "grpo", "train", "--config", str(REPO / "config.yaml"),
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
        sampler = next(p for p in children if "grpo.workers.sampler" in command_line(p))
        trainers = [p for p in children if "grpo.workers.trainer" in command_line(p)]
        for worker in (sampler, *trainers):  # the venv's tools first, whatever the shell's PATH holds
            assert worker.environ()["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
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
    assert re.search(r"time limit: launch.max_minutes=0.75 reached after 0:00:4\d; stopping all", out), out
    assert 0 < steps < 500, out
    state = json.loads((tmp_path / "trainer_state.json").read_text())
    assert state["step"] == steps and (tmp_path / "checkpoints" / f"step{state['step']:06d}").is_dir()
    assert read_latest(tmp_path / "weights") == state["step"]  # the result is the last trained version
    # the last line says what was trained and saved, read off the run folder after the stop
    assert out.rstrip().splitlines()[-1] == (
        f"stopped: the last step trained was {steps} of 500 (weights in {tmp_path / 'weights'}); the checkpoint of "
        f"step {steps} is saved; the same command resumes from it")


def test_progress_line_and_eta_past_a_day():
    assert format_duration(3723) == "1:02:03" and format_duration(90_000) == "25:00:00"
    row = {"step": 4, "reward": -0.4375, "strict/answer_accuracy": 0.0625, "strict/format_rate": 0.125, "kl": 0.0019}
    line = progress_line(row, 1000, 80.1, 77.7, 312.4)
    assert line == ("step 4/1000 | reward -0.438 | answer   6.2% | format  12.5% | kl 0.0019 |   80.1 s/step | "
                    "elapsed 0:05:12 | ETA 21:29:49")
    episodes = {**row, "env/tool_messages/well_formed_rate": 0.75}
    assert "| format  12.5% | calls ok  75.0% | kl" in progress_line(episodes, 1000, 80.1, 77.7, 312.4)


def test_step_time_is_the_steps_own_and_start_up_is_not_in_it(tmp_path, capsys):
    """The first step of a launch waited for the sampler's start-up (timing/wait_s): its own time is
    its training and publishing; later steps' are the time between rows; the ETA is their mean."""
    metrics, now = tmp_path / "metrics.jsonl", time.time()
    metrics.write_text(json.dumps({"step": 1, "wall_time": now - 50}) + "\n")  # an earlier launch's: not shown again
    clock = iter([0.0, 400.0, 460.0, 525.0]).__next__
    progress = StepProgress(metrics, 10, clock=clock)
    rows = [{"step": 2, "wall_time": now + 100, "timing/wait_s": 200.0, "timing/train_s": 20.0,
             "timing/publish_s": 1.5},
            {"step": 3, "wall_time": now + 130, "timing/wait_s": 5.0, "timing/train_s": 20.0, "timing/publish_s": 1.5},
            {"step": 4, "wall_time": now + 170, "timing/wait_s": 15.0, "timing/train_s": 20.0, "timing/publish_s": 1.5}]
    with metrics.open("a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    progress.print_new()
    times = re.findall(r"\|\s+([\d.]+) s/step \| elapsed (\S+) \| ETA (\S+)", capsys.readouterr().out)
    # own 21.5 (train + publish), then 30 and 40 s; ETA: 8 x 21.5, 7 x 30, 6 x mean(30, 40)
    assert times == [("21.5", "0:06:40", "0:02:52"), ("30.0", "0:07:40", "0:03:30"), ("40.0", "0:08:45", "0:03:30")]


def test_a_resumed_trainers_rows_are_shown_though_it_rewrote_the_file_shorter(tmp_path, capsys):
    """A resume from the checkpoint of step 10 of 12 trained steps: the trainer rewrites metrics.jsonl
    with rows 1-10, then appends 11, 12 again; each is shown, no earlier row is."""
    from grpo.common.files import write_atomically

    metrics, now = tmp_path / "metrics.jsonl", time.time()
    old = [json.dumps({"step": i, "wall_time": now - 100 + i}) for i in range(1, 13)]
    metrics.write_text("\n".join(old) + "\n")
    progress = StepProgress(metrics, 20)
    write_atomically(metrics, "\n".join(old[:10]) + "\n")
    with metrics.open("a") as f:
        f.write("".join(json.dumps({"step": i, "wall_time": now + i}) + "\n" for i in (11, 12)))
    progress.print_new()
    assert re.findall(r"^step (\d+)/20 ", capsys.readouterr().out, re.M) == ["11", "12"]


def test_steps_with_nothing_to_learn_from_give_one_warning(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    progress = StepProgress(metrics, 10)
    spreads = [1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
    now = time.time()
    metrics.write_text("".join(json.dumps({"step": i + 1, "wall_time": now + i, "sampling/zero_spread_fraction": z})
                               + "\n" for i, z in enumerate(spreads)))
    progress.print_new()
    lines = capsys.readouterr().out.splitlines()
    warnings = [i for i, line in enumerate(lines) if line.startswith("warning: nothing to learn from")]
    assert warnings == [6]  # once, after steps 4, 5 and 6 (the third alike in a row); not again at 7 and 8
    assert "every group scored alike in the last 3 steps" in lines[6] and "sampling.temperature" in lines[6]


def test_the_stop_summary_says_what_was_trained_and_saved(tmp_path):
    weights = tmp_path / "weights"
    assert stop_summary(tmp_path, weights, 200) == "no step was trained; the same command starts the run afresh"
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/answer_accuracy": 0.1}\n{"step": 1}\n{"step": 2}\n')
    assert stop_summary(tmp_path, weights, 200) == (
        f"the last step trained was 2 of 200 (weights in {weights}); no checkpoint was saved, so the same command "
        "would be refused as a fresh start into a used run folder: add checkpoint.resume=never run.overwrite=true to "
        "start over (the old outputs are moved aside)")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step000002")
    assert "; the checkpoint of step 2 is saved;" in stop_summary(tmp_path, weights, 200)


@pytest.mark.parametrize("ranks, gpus, samplers, message", [
    (2, 0, 1, None),  # CPU ranks share the cores
    (2, 3, 1, None),
    (2, 1, 1, "launch.trainer_ranks=2 cannot be placed: the plan is for 1 GPU and the trainer and "
              "sampling.num_workers=1 sampler(s) share GPU 0, which leaves 1 for trainer ranks (one GPU each); set "
              "launch.trainer_ranks=1 (or 0: automatic), or use a machine with 3 GPUs"),
    (2, 2, 1, "launch.trainer_ranks=2 cannot be placed: the plan is for 2 GPUs and sampling.num_workers=1 "
              "sampler(s) take 1 of them, one each, which leaves 1 for trainer ranks (one GPU each); set "
              "launch.trainer_ranks=1 (or 0: automatic), or use a machine with 3 GPUs"),
])
def test_trainer_ranks_that_cannot_be_placed_are_an_error_never_cut(ranks, gpus, samplers, message):
    assert placement_problem(ranks, gpus, samplers, "the plan is for") == message


@pytest.mark.parametrize("extra, gpus, lines", [
    (["launch.trainer_ranks=2", "sampling.prompts_per_step=4"], 2,
     ["warning: this plan is for 2 GPUs (--gpus 2); this machine has no GPU, and a start here is planned for what "
      "it has",
      "error: launch.trainer_ranks=2 cannot be placed: the plan is for 2 GPUs and sampling.num_workers=1 sampler(s) "
      "take 1 of them, one each, which leaves 1 for trainer ranks (one GPU each); set launch.trainer_ranks=1 (or 0: "
      "automatic), or use a machine with 3 GPUs"]),
    (["sampling.device=cuda"], 0, ["error: sampling.device=cuda needs a CUDA GPU and this machine has none (torch "
                                   "sees no GPU): set it to auto, or run on a machine with a GPU"]),
    (["data.path=/data/nonexistent"], None,
     ["error: data.path='/data/nonexistent' is not a folder, a Hub dataset id (org/name) or gsm8k-embedded"]),
])
def test_every_check_runs_before_anything_starts_in_the_dry_run_too(tmp_path, capsys, extra, gpus, lines):
    code, out, err = dry_run(capsys, f"run.dir={tmp_path / 'run'}", *extra, gpus=gpus)
    assert code == 2 and out == "" and err.splitlines() == lines
    assert list(tmp_path.iterdir()) == []


def test_data_columns_and_answer_format_are_checked_before_anything_starts(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"problem": f"Capital {i}?", "solution": "Paris"}) + "\n"
                                              for i in range(30)))
    code, _, err = dry_run(capsys, f"run.dir={tmp_path / 'run'}", f"data.path={data}", gpus=None)
    assert code == 2 and err == (f"error: {data} split 'train' has no column 'question' or 'answer' "
                                 "(data.prompt_column="
                                 "'question', data.answer_column='answer'); its columns: problem, solution; set "
                                 "data.prompt_column=problem data.answer_column=solution\n")
    columns = [f"data.path={data}", "data.prompt_column=problem", "data.answer_column=solution", "data.few_shot=0"]
    code, _, err = dry_run(capsys, f"run.dir={tmp_path / 'run'}", *columns, gpus=None)
    assert code == 2 and err == (f"error: {data} split 'train': none of its first 30 rows is usable (skipped: "
                                 "{'non-numeric answer': 30}); 30 of 30 rows have no number after '####' in column "
                                 "'solution' (data.answer_format=gsm8k reads GSM8K's '#### 42'): "
                                 "data.answer_format=text "
                                 "takes the column as it is\n")
    code, out, err = dry_run(capsys, f"run.dir={tmp_path / 'run'}", *columns, "data.answer_format=text", gpus=None)
    assert code == 0 and err == "" and read_plan(out)[0]["start"] == "fresh start"


def test_a_missing_vllm_is_an_error_with_the_install_command(tmp_path, capsys):
    code, out, err = dry_run(capsys, f"run.dir={tmp_path / 'run'}", "sampling.engine=vllm",
                             f"sampling.vllm.python={tmp_path / 'no-venv' / 'python'}", gpus=None)
    if code == 0:
        pytest.skip("this Python has vLLM")
    assert code == 2 and out == "" and err == (
        f"error: sampling.engine=vllm needs vLLM, and neither sampling.vllm.python={tmp_path / 'no-venv' / 'python'} "
        f"exists nor does {sys.executable} have it: run `make install-vllm` (the CUDA build where nvidia-smi sees a "
        "GPU, the CPU build elsewhere), or set sampling.engine=hf\n")


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


def test_help_config_lists_every_key_with_its_default(capsys):
    assert main(["--help-config"]) == 0
    out, _ = capsys.readouterr()
    assert "transport.address = tcp://127.0.0.1:5555\n    ZeroMQ address" in out
    assert "\nrun.overwrite = false\n" in out and "\nlaunch.trainer_ranks = 0\n" in out
