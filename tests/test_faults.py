"""Killed processes on real DeepSpeed ranks and sockets: nothing trained twice, nothing lost.

The delivery rule under test (grpo/spool.py): at-least-once from the sampler's spool,
de-duplicated by sampler step, trained strictly in order.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO
from helpers import free_tcp_address
from test_sampling_worker import start_sampler
from test_training import free_port

DEEPSPEED = Path(sys.executable).parent / "deepspeed"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
COMMON = ["sampling.max_new_tokens=1", "sampling.group_size=4", "sampling.prompts_per_step=2",
          "rewards.names=[gsm8k_answer_lenient]", "rewards.weights=[1.0]", "training.learning_rate=0.05",
          "sampling.max_staleness=1", "training.steps=6", "sampling.wait_timeout_s=300",
          "transport.send_timeout_s=300"]


def start_trainer(run_dir, model_dir, data_dir, address, *extra):
    """Two ranks in their own process group, so that a test can SIGKILL all of them at once."""
    args = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_port()), str(REPO / "training_worker.py"),
            "--config", str(REPO / "config.yaml"), f"run.dir={run_dir}", f"model.name_or_path={model_dir}",
            f"data.path={data_dir}", f"transport.address={address}", "lora.r=4", *COMMON, *extra]
    log = open(run_dir / "trainer.log", "ab")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=ENV, start_new_session=True)


def rows(run_dir):
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def wait_for(condition, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def finish(run_dir, trainer, sampler):
    try:
        codes = trainer.wait(timeout=600), sampler.wait(timeout=120)
    finally:
        for p in (trainer, sampler):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL) if p is trainer else p.kill()
    logs = (run_dir / "trainer.log").read_text()[-4000:] + (run_dir / "sampler.log").read_text()[-3000:]
    assert codes == (0, 0), logs
    return logs


def generated_steps(run_dir):
    """Sampler steps in the order they were generated (the sampler logs one line per step)."""
    return [int(m) for m in re.findall(r"sampler INFO step (\d+) v", (run_dir / "sampler.log").read_text())]


def test_killed_sampler_restarts_and_no_step_is_trained_twice_or_skipped(tmp_path, digit_model_dir, tiny_gsm8k):
    address = free_tcp_address()
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "transport.recv_timeout_s=120")
    sampler = start_sampler(tmp_path, digit_model_dir, tiny_gsm8k, address, *COMMON)
    try:
        wait_for(lambda: len(rows(tmp_path)) >= 2, "two trained steps")
        sampler.send_signal(signal.SIGKILL)
        sampler.wait()
        wait_for(lambda: "waiting for sampler step" in (tmp_path / "trainer.log").read_text(),
                 "the trainer to say it is waiting", timeout=120)
        sampler = start_sampler(tmp_path, digit_model_dir, tiny_gsm8k, address, *COMMON)
    except BaseException:
        os.killpg(trainer.pid, signal.SIGKILL)
        sampler.kill()
        raise
    logs = finish(tmp_path, trainer, sampler)
    trained = rows(tmp_path)
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5, 6], logs
    assert [r["sampler_step"] for r in trained] == [0, 1, 2, 3, 4, 5], logs
    assert sorted(generated_steps(tmp_path)) == [0, 1, 2, 3, 4, 5]  # resumed from its cursor: none generated twice
    assert all(0 <= r["staleness"] <= 1 for r in trained)


def test_killed_trainer_resumes_from_its_checkpoint_and_the_spool_loses_nothing(tmp_path, digit_model_dir,
                                                                                tiny_gsm8k):
    address = free_tcp_address()
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "checkpoint.every=2")
    sampler = start_sampler(tmp_path, digit_model_dir, tiny_gsm8k, address, *COMMON)
    try:
        wait_for(lambda: len(rows(tmp_path)) >= 3, "three trained steps (one past the checkpoint)")
        os.killpg(trainer.pid, signal.SIGKILL)  # mid-run: the launcher and both ranks, no clean-up
        trainer.wait()
        sent_before_restart = set(generated_steps(tmp_path))
        trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "checkpoint.every=2")
    except BaseException:
        os.killpg(trainer.pid, signal.SIGKILL)
        sampler.kill()
        raise
    logs = finish(tmp_path, trainer, sampler)
    trained = rows(tmp_path)
    assert [r["step"] for r in trained] == [1, 2, 3, 4, 5, 6], logs
    assert [r["sampler_step"] for r in trained] == [0, 1, 2, 3, 4, 5], logs
    assert "resumed from" in logs and "re-sent spooled steps 2.." in (tmp_path / "sampler.log").read_text()
    # the steps after the checkpoint were re-sent from the spool, not generated again
    assert sorted(generated_steps(tmp_path)) == [0, 1, 2, 3, 4, 5] and {2, 3} <= sent_before_restart
