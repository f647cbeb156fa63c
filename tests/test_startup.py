"""A start that cannot progress says why: build locks of killed builds, a worker silent in its start-up
(its stacks, then a stop), a reward that fails on every sample, a kill -9 at start-up then the same
command again; each through the real launcher and workers, or the real lock files and processes."""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import psutil
from helpers import command_line
from teacher_server import serve_teacher
from test_launch import launch

from grpo.commands.local import EXIT_SAMPLER_FAILED
from grpo.config import ModelConfig
from grpo.model.loading import load_model
from grpo.run.watchdog import catches_sigusr1, is_worker, where
from grpo.trainer.build_locks import LockWaitReporter, build_locks, clear_stale_locks, lock_holders


def hold_open(path):
    """A live 'builder': a process that keeps `path` open, as torch's build keeps its lock."""
    holder = subprocess.Popen([sys.executable, "-c", f"import os, time; os.open({str(path)!r}, os.O_RDONLY); "
                                                     "print('open', flush=True); time.sleep(120)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "open\n"
    return holder


def test_a_lock_no_process_holds_is_removed_and_said_in_one_line(tmp_path, caplog):
    """$TORCH_EXTENSIONS_DIR/<op>/lock and the default root's <py311_cpu>/<op>/lock: a build killed
    mid-way left them, and torch would wait on them for ever."""
    stale = [tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "py311_cpu" / "fused_adam" / "lock"]
    for path in stale:
        path.parent.mkdir(parents=True)
        path.touch()
    with caplog.at_level(logging.WARNING, logger="grpo.trainer.build_locks"):
        assert clear_stale_locks(tmp_path) == stale
    assert build_locks(tmp_path) == []
    assert [r.getMessage().split(" ago")[0] for r in caplog.records] == [
        f"removed the build lock {path}: no process holds it (a build of {path.parent.name} was killed 0 s"
        for path in stale]
    others = tmp_path / "shared" / "fused_adam" / "lock"  # another user's: their builder would not be seen here
    others.parent.mkdir(parents=True)
    others.touch()
    os.chown(others, os.getuid() + 1, -1)
    assert clear_stale_locks(tmp_path) == [] and others.exists()


def test_a_lock_a_live_build_holds_is_named_while_waited_on_and_removed_once_its_builder_dies(tmp_path, caplog):
    lock = tmp_path / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir()
    lock.touch()
    holder = hold_open(lock)
    try:
        assert lock_holders(lock) == [holder.pid] and clear_stale_locks(tmp_path) == [] and lock.exists()
        with caplog.at_level(logging.WARNING, logger="grpo.trainer.build_locks"):
            with LockWaitReporter(tmp_path, after_s=0.3, poll_s=0.1):
                time.sleep(1.0)
                assert len(caplog.records) == 1
                first = caplog.records[0].getMessage()
                assert first.startswith(f"waiting for the build lock {lock}: held by pid {holder.pid} "
                                        f"({sys.executable} -c")
                assert first.endswith("), building deepspeed_shm_comm; a build takes about a minute")
                holder.kill()  # killed mid-build: the file stays, and nobody holds it
                holder.wait()
                time.sleep(0.5)
        assert not lock.exists()
        assert caplog.records[-1].getMessage().startswith(f"removed the build lock {lock}: no process holds it")
    finally:
        holder.kill()


def test_the_stacks_say_where_the_main_thread_is(tmp_path):
    """A real faulthandler dump (all threads, on SIGUSR1, as the workers register it): the innermost
    frames of the thread that took the signal, callers after it."""
    script = tmp_path / "stuck.py"
    script.write_text("import faulthandler, signal, threading, time\n"
                      "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"
                      "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                      "def read_forever():\n"
                      "    print('ready', flush=True)\n"
                      "    time.sleep(60)\n"
                      "def load():\n"
                      "    read_forever()\n"
                      "load()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.5)  # inside the sleep of line 6
        importing = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # no handler yet
        time.sleep(0.3)
        assert catches_sigusr1(proc.pid) and not catches_sigusr1(importing.pid)  # it would not be signalled
        importing.kill()
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
    finally:
        proc.kill()
    dump = proc.communicate()[1]
    assert dump.count("Thread 0x") == 1 and "Current thread 0x" in dump
    assert where(dump) == f"read_forever ({script}:6) <- load ({script}:8) <- <module> ({script}:9)"
    assert where("") == "an unknown place (no stacks reached the log)"


def test_a_worker_silent_in_its_start_up_gets_its_stacks_and_the_run_stops(tmp_path, digit_model_dir):
    """The sampler's data is a pipe no one writes (a stalled network mount reads alike): it hangs
    before it has its prompts. At launch.stall_s its stacks go to sampler.log and the console says
    where it is; at twice that the launcher stops the run (exit 3), never waiting for ever."""
    data = tmp_path / "data"
    data.mkdir()
    os.mkfifo(data / "train.jsonl")
    run = tmp_path / "run"
    started = time.monotonic()
    proc = launch(run, digit_model_dir, data, "training.steps=1", "launch.stall_s=8")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_SAMPLER_FAILED, out
    assert re.search(r"warning: the sampler has written nothing for \d+ s during its start-up \(launch.stall_s=8\); "
                     r"it is in open \(pathlib.py:\d+\) <- _read_jsonl \(data/problems.py:\d+\) <- _read_local "
                     r"\(data/problems.py:\d+\)\. Its Python stacks are in " + re.escape(str(run)), out), out
    assert re.search(r"error: the sampler made no progress for \d+ s during its start-up \(launch.stall_s=8: stacks at "
                     r"8 s, stop at twice that\); it was in open \(pathlib.py:\d+\) <- _read_jsonl", out), out
    assert "Current thread 0x" in (run / "sampler.log").read_text()
    assert time.monotonic() - started < 120


def test_a_planted_build_lock_in_the_runs_extension_cache_does_not_hang_the_start(tmp_path, digit_model_dir,
                                                                                 tiny_gsm8k):
    extensions = tmp_path / "extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    proc = launch(tmp_path / "run", digit_model_dir, tiny_gsm8k, "training.steps=1", "launch.stall_s=60",
                  env={"TORCH_EXTENSIONS_DIR": str(extensions)})
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert f"  trainer: removed the build lock {lock}: no process holds it" in out and not lock.exists()
    assert "done: 1 steps" in out


def test_a_reward_that_fails_on_every_sample_stops_the_launch_with_its_line(tmp_path, digit_model_dir, tiny_gsm8k):
    """The console names the reward, its error and its line, and shows this launch's part of the log
    alone (an earlier launch's error in the same sampler.log is not shown)."""
    (tmp_path / "my_rewards.py").write_text("def exact(completion, row):\n"
                                            "    return float(row['solution'] in completion)\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "sampler.log").write_text("2026-01-01 00:00:00 sampler ERROR an earlier launch's failure\n")
    proc = launch(run, digit_model_dir, tiny_gsm8k, "training.steps=5",
                  f"rewards.names=[{tmp_path}/my_rewards.py:exact]",
                  "rewards.weights=[1.0]", f"rewards.accuracy_reward={tmp_path}/my_rewards.py:exact")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_SAMPLER_FAILED, out
    assert "the sampler failed (exit code 8)" in out and "an earlier launch's failure" not in out
    shown = out.split("(this launch):\n", 1)[1]
    assert shown.startswith("===== launch ") and "grpo.workers.sampler" in shown.splitlines()[0]
    assert (f"reward {tmp_path}/my_rewards.py:exact failed on all 8 samples in each of the last 2 steps: KeyError: "
            f"'solution' ({tmp_path}/my_rewards.py:2, in exact); stopped.") in shown


def test_a_teacher_server_that_answers_wrongly_stops_the_launch_naming_what_it_sent(tmp_path, digit_model_dir,
                                                                                    tiny_gsm8k, tiny_model_dir):
    """distill.teacher_url passes the sampler's checks at start, then answers the first step's request with a
    log-prob above 0: the run stops at once, the console naming the server, the token and what it sent, never
    training on it."""
    def wrong(reply, n):
        if n > 1:  # after the check at start
            entry = reply["choices"][0]["prompt_logprobs"][-1]
            next(iter(entry.values()))["logprob"] = 2.5
        return reply

    teacher = load_model(ModelConfig(name_or_path=str(tiny_model_dir))).eval()
    with serve_teacher(teacher, name="the-teacher", answer=wrong) as (url, requests):
        proc = launch(tmp_path / "run", digit_model_dir, tiny_gsm8k, "training.steps=3", "sampling.temperature=1.0",
                      f"distill.teacher={tiny_model_dir}", f"distill.teacher_url={url}",
                      "distill.served_name=the-teacher")
        out, _ = proc.communicate(timeout=300)
    assert proc.returncode == EXIT_SAMPLER_FAILED, out
    assert re.search(rf"distill.teacher_url={re.escape(url)}: sequence 0, completion token \d+ \(id \d+\): no "
                     r"log-prob of that token in its entry, or not a number in \[-1000, 0\] .*'logprob': 2.5", out), out
    assert len(requests) == 2 and "done:" not in out  # the check, then the first step's request


def wait_for_line(path, text: str, timeout: float = 180, skip: int = 0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace")[skip:]:
            return
        time.sleep(0.1)
    raise AssertionError(f"no {text!r} in {path} within {timeout:g} s")


def test_a_kill_9_at_start_up_then_the_same_command_finishes_the_run(tmp_path, digit_model_dir, tiny_gsm8k):
    """The trainer killed while DeepSpeed starts, then (in a second run of 4 steps that resumes the
    first) the sampler killed while it loads its prompts: each time the same command again runs the
    run to its end, with nothing left behind that blocks or hijacks the next start."""
    run = tmp_path / "run"
    for steps, victim, log, moment in ((2, "grpo.workers.trainer", "trainer.log", "Setting accelerator"),
                                       (4, "grpo.workers.sampler", "sampler.log", "prompts from")):
        command = [run, digit_model_dir, tiny_gsm8k, f"training.steps={steps}"]
        before = (run / log).read_text() if (run / log).is_file() else ""
        proc = launch(*command)
        try:
            wait_for_line(run / log, moment, skip=len(before))
            target = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                          if victim in command_line(p))
            target.kill()
            out, _ = proc.communicate(timeout=180)
        finally:
            proc.kill()
        assert proc.returncode in (3, 4), out
        proc = launch(*command)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        assert f"done: {steps} steps" in out
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == list(range(1, steps + 1))


def test_a_worker_is_known_by_its_module_or_its_script_and_deepspeeds_processes_are_not():
    """Only workers get SIGUSR1 for their stacks: to DeepSpeed's runner and launcher it is fatal."""
    py = "/v/bin/python"
    assert is_worker([py, "-u", "-m", "grpo.workers.trainer", "--local_rank=0", "--config", "c.yaml"])
    assert is_worker([py, "-m", "grpo.workers.sampler", "a=1"]) and is_worker([py, "sampling_worker.py"])
    assert is_worker([py, "-u", "/repo/training_worker.py", "--local_rank=0"])
    assert not is_worker([py, "-u", "-m", "deepspeed.launcher.launch", "--world_info=e30=", "--module",
                          "grpo.workers.trainer"])
    assert not is_worker([py, "/v/bin/deepspeed", "--num_gpus", "2", "--module", "grpo.workers.trainer"])
    assert not is_worker([py, "-m", "grpo.commands.train"]) and not is_worker([py, "-m"])
