"""Faults on real DeepSpeed ranks and sockets: killed processes (nothing trained twice, nothing
lost), non-finite steps (skipped, then a clean stop), failed writes and a bad run folder.

The delivery rule under test (grpo/wire/delivery.py): at-least-once from the sampler's spool,
de-duplicated by sampler step, trained strictly in order.
"""

import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from conftest import PROCESS_CONFIG, REPO
from helpers import free_tcp_address
from safetensors.torch import load_file
from test_sampling_worker import start_sampler, trained_adapter
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.config import load_config
from grpo.model.logprobs import completion_logprobs
from grpo.objective import Objective
from grpo.objective.advantages import group_advantages
from grpo.run.ports import free_local_port
from grpo.run.secret import run_secret
from grpo.weights.folder import publish, read_latest, verify, version_dir
from grpo.wire.batch import RolloutBatch
from grpo.wire.behaviour import behaviour_of
from grpo.wire.codec import encode_batch
from grpo.wire.transport import BatchSender
from grpo.workers.trainer import EXIT_BAD_STEPS, EXIT_BEHAVIOUR_MISMATCH, EXIT_WRITE_FAILED

DEEPSPEED = Path(sys.executable).parent / "deepspeed"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
COMMON = ["sampling.max_new_tokens=1", "sampling.group_size=4", "sampling.prompts_per_step=2",
          "rewards.names=[gsm8k_answer_lenient]", "rewards.weights=[1.0]", "training.learning_rate=0.05",
          "sampling.max_staleness=1", "training.steps=6", "sampling.wait_timeout_s=300",
          "transport.send_timeout_s=300"]


def start_trainer(run_dir, model_dir, data_dir, address, *extra, preexec_fn=None):
    """Two ranks in their own process group, so that a test can SIGKILL all of them at once."""
    args = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_local_port()),
            str(REPO / "training_worker.py"),
            "--config", str(PROCESS_CONFIG), f"run.dir={run_dir}", f"model.name_or_path={model_dir}",
            f"data.path={data_dir}", f"transport.address={address}", "lora.r=4", *COMMON, *extra]
    log = open(run_dir / "trainer.log", "ab")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=ENV, start_new_session=True,
                            preexec_fn=preexec_fn)


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


def kill_both(trainer, sampler):
    os.killpg(trainer.pid, signal.SIGKILL)
    sampler.kill()


def finish_with_each_step_trained_and_generated_once(run_dir, trainer, sampler, steps: int = 6) -> str:
    """Both exit 0; sampler steps 0..steps-1 were trained once each, in order, and generated once each."""
    logs = finish(run_dir, trainer, sampler)
    trained = rows(run_dir)
    assert [r["step"] for r in trained] == list(range(1, steps + 1)), logs
    assert [r["sampler_step"] for r in trained] == list(range(steps)), logs
    assert_each_step_generated_once(run_dir, "sampler.log", steps, logs)
    return logs


def generated_steps(text: str) -> list[int]:
    """Sampler steps in the order they were generated (the sampler logs one line per step, after its send)."""
    return [int(m) for m in re.findall(r"sampler\d* INFO step (\d+) v", text)]


def assert_each_step_generated_once(run_dir, log_name: str, steps: int, logs: str) -> None:
    """The sampler's log (a killed sampler's, then its restart's) shows steps 0..steps-1 generated once each, in
    order: the restart resumes at the step after the last one its first process sent. That one's own line may be
    missing: the kill can land between its send and its log line."""
    first, restarted, after = (run_dir / log_name).read_text().partition("resuming at step ")
    if not restarted:
        assert generated_steps(first) == list(range(steps)), logs
        return
    resumed = int(after.split()[0])
    assert generated_steps(first) in (list(range(resumed)), list(range(resumed - 1))), logs
    assert generated_steps(after) == list(range(resumed, steps)), logs


def test_killed_sampler_restarts_and_no_step_is_trained_twice_or_skipped(tmp_path, digit_model_dir, tiny_gsm8k):
    address = free_tcp_address()
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "transport.recv_timeout_s=120")
    sampler = start_sampler(tmp_path, digit_model_dir, tiny_gsm8k, address, *COMMON)
    try:
        wait_for(lambda: len(rows(tmp_path)) >= 2, "two trained steps")
        sampler.send_signal(signal.SIGKILL)
        sampler.wait()
        wait_for(lambda: "waiting for sampler 0 step" in (tmp_path / "trainer.log").read_text(),
                 "the trainer to say it is waiting", timeout=120)
        sampler = start_sampler(tmp_path, digit_model_dir, tiny_gsm8k, address, *COMMON)
    except BaseException:
        kill_both(trainer, sampler)
        raise
    finish_with_each_step_trained_and_generated_once(tmp_path, trainer, sampler)  # it resumed from its cursor
    assert all(0 <= r["staleness"] <= 1 for r in rows(tmp_path))


def test_killed_trainer_resumes_from_its_checkpoint_and_the_spool_loses_nothing(tmp_path, digit_model_dir,
                                                                                tiny_gsm8k):
    """Wherever the kill lands (after three steps, before the end), the new trainer resumes at
    its last checkpoint and gets every later step exactly once, even when the sampler has
    already sent its last step (it waits for the trainer to checkpoint past it)."""
    address, steps = free_tcp_address(), "training.steps=12"
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "checkpoint.every=2", steps)
    sampler = start_sampler(tmp_path, digit_model_dir, tiny_gsm8k, address, *COMMON, steps)
    try:
        wait_for(lambda: len(rows(tmp_path)) >= 3, "three trained steps")
        os.killpg(trainer.pid, signal.SIGKILL)  # mid-run: the launcher and both ranks, no clean-up
        trainer.wait()
        trained_before_kill = len(rows(tmp_path))
        assert trained_before_kill < 12, "the trainer finished before the kill; nothing to test"
        trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "checkpoint.every=2", steps)
    except BaseException:
        kill_both(trainer, sampler)
        raise
    logs = finish_with_each_step_trained_and_generated_once(tmp_path, trainer, sampler, 12)
    checkpoint = int(re.search(r"resumed from \S+ at step (\d+)", logs).group(1))
    # the last even step, or the one before if the kill landed while that checkpoint was being written
    assert checkpoint >= 2 and checkpoint in (trained_before_kill // 2 * 2, trained_before_kill // 2 * 2 - 2)
    # re-sends start at the resuming trainer's checkpoint (none are logged when the batches after it
    # were still queued in the sampler's socket and reached the new trainer, or it had checkpointed past them)
    resends = re.findall(r"resumes at sampler step (\d+): re-sent spooled steps (\d+)\.\.",
                         (tmp_path / "sampler.log").read_text())
    assert all(at == first for at, first in resends), logs


def trainer_settings(run_dir, model_dir) -> tuple:
    """The config the trainer in `run_dir` saved at start, and the behaviour settings it expects."""
    wait_for(lambda: (run_dir / "config.yaml").is_file(), "the trainer's config.yaml")
    cfg = load_config(run_dir / "config.yaml")
    return cfg, behaviour_of(cfg, AutoTokenizer.from_pretrained(model_dir), Objective.of(cfg).header())


def crafted_batch(model, step: int, finite: bool, cfg, behaviour: dict) -> RolloutBatch:
    """Two groups of four 3-token digit completions with the model's own log-probs, half of each group
    right (the first reward 1), its advantages those of its rewards. Not `finite`: reference log-probs
    200 above the policy's overflow the KL term (training.beta > 0), and the loss is inf."""
    g = torch.Generator().manual_seed(step)
    prompts = [torch.randint(3, 60, (6,), generator=g) for _ in range(2)]
    completions = [torch.randint(3, 60, (3,), generator=g) for _ in range(8)]
    with torch.no_grad():
        logps = completion_logprobs(model, prompts, completions, [4, 4], temperature=0.9)  # the sampling temperature
    rewards = torch.zeros(8, len(cfg.rewards.names))
    rewards[:, 0] = torch.tensor([1.0, 0.0] * 4)
    totals = rewards[:, 0] * cfg.rewards.weights[0]
    return RolloutBatch(step=step, policy_version=0, prompt_ids=prompts, completion_ids=completions,
                        group_sizes=[4, 4], old_logps=logps, ref_logps=logps if finite else [x + 200 for x in logps],
                        rewards=rewards, reward_names=list(cfg.rewards.names),
                        advantages=group_advantages(totals, 4, scale=cfg.training.advantage_scale),
                        truncated=torch.zeros(8, dtype=torch.bool), behaviour=behaviour, totals=totals,
                        scored=torch.ones(8, dtype=torch.bool), worst=torch.zeros(8, dtype=torch.bool))


def feed_trainer(trainer, address, model_dir, finite: list[bool], run_dir, forge=None) -> tuple[int, str]:
    """Send one crafted batch per entry of `finite` (sampler steps 0, 1, ...), each changed by `forge`
    when given; the trainer's exit code and log."""
    sender = BatchSender(address, send_timeout_s=120, secret=run_secret(None, run_dir))  # the run's own
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    cfg, behaviour = trainer_settings(run_dir, model_dir)
    try:
        for step, ok in enumerate(finite):
            batch = crafted_batch(model, step, ok, cfg, behaviour)
            sender.send(forge(batch) if forge else batch)
        code = trainer.wait(timeout=300)
    finally:
        sender.close()
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    return code, (run_dir / "trainer.log").read_text()


def test_non_finite_steps_are_skipped_and_too_many_in_a_row_stop_with_a_checkpoint(tmp_path, digit_model_dir,
                                                                                  tiny_gsm8k):
    address = free_tcp_address()
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "training.max_bad_steps=2",
                            "weights.keep_last=10", "training.steps=10", "training.lr_schedule=linear",
                            "training.min_lr_ratio=0.1", "sampling.max_staleness=10",  # crafted batches: v0
                            "training.beta=0.04")
    code, log = feed_trainer(trainer, address, digit_model_dir, [True, False, True, False, False], tmp_path)
    assert code == EXIT_BAD_STEPS, log[-3000:]
    assert "2 steps in a row (up to step 5) had a non-finite loss or gradient" in log
    trained = rows(tmp_path)
    assert [r["skipped"] for r in trained] == [0, 1, 0, 1, 1]
    assert [r["trainer/skipped_steps"] for r in trained] == [0, 1, 1, 2, 3]
    # linear decay over 10 updates to 0.1 x 0.05, counted in applied updates (0, 1, 1, 2, 2 before each step):
    # a skipped step leaves the rate where it was
    assert [r["learning_rate"] for r in trained] == pytest.approx([0.05, 0.0455, 0.0455, 0.041, 0.041], abs=1e-12)
    adapters = [load_file(version_dir(tmp_path / "weights", v) / "adapter_model.safetensors") for v in (1, 2, 3)]
    assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0])  # a skipped step changes nothing
    assert any(not torch.equal(adapters[1][k], adapters[2][k]) for k in adapters[0])  # the next good one does
    assert all(torch.isfinite(v).all() for v in adapters[2].values())
    assert (tmp_path / "checkpoints" / "step000005").is_dir()


def test_a_batch_staler_than_max_staleness_stops_the_trainer_before_it_trains(tmp_path, digit_model_dir, tiny_gsm8k):
    """Crafted batches all sampled with v0: steps 0 and 1 are within sampling.max_staleness=1 of
    the trainer's v0 and v1, step 2 is two versions behind v2."""
    address = free_tcp_address()
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "sampling.max_staleness=1")
    code, log = feed_trainer(trainer, address, digit_model_dir, [True, True, True], tmp_path)
    assert code == EXIT_BEHAVIOUR_MISMATCH, log[-3000:]
    assert ("sampler 0 step 2 was sampled with weights v0, 2 versions behind this trainer's v2; "
            "sampling.max_staleness=1 allows 1. Nothing was trained with it.") in log
    assert [r["step"] for r in rows(tmp_path)] == [1, 2] and read_latest(tmp_path / "weights") == 2


def test_the_learning_rate_clock_counts_optimizer_updates_with_several_passes(tmp_path, digit_model_dir, tiny_gsm8k):
    """num_iterations=2: each pass sets its own rate on a linear decay over 3 steps x 2 passes = 6
    updates, and the non-finite batch's skipped passes do not advance it. Before, the rate was set
    once per batch, counted in batches over 3, and one skipped pass stopped the clock for both."""
    address = free_tcp_address()
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "training.num_iterations=2",
                            "training.steps=3", "training.lr_schedule=linear", "training.min_lr_ratio=0.1",
                            "sampling.max_staleness=10", "training.beta=0.04")
    code, log = feed_trainer(trainer, address, digit_model_dir, [True, False, True], tmp_path)
    assert code == 0, log[-3000:]
    trained = rows(tmp_path)
    assert [r["optimizer_updates"] for r in trained] == [2, 0, 2] and [r["skipped"] for r in trained] == [0, 1, 0]
    rate = [0.05 * (0.1 + 0.9 * (1 - u / 6)) for u in (1, 2, 3)]  # the last pass's update: 1, (2), 3
    assert [r["learning_rate"] for r in trained] == pytest.approx(rate, abs=1e-12)


def limit_file_size():
    """In the trainer's processes: any write past 32 KiB fails (EFBIG), as on a full disk (ENOSPC)."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (32 << 10, 32 << 10))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a failed write, not a killed process


def test_a_failed_write_stops_the_trainer_clearly_and_leaves_nothing_partial(tmp_path, digit_model_dir, tiny_gsm8k):
    address = free_tcp_address()
    # adapters (9 KB), metrics and TensorBoard events fit under the limit; the 52 KB checkpoint of step 2
    # (the adapter and its optimizer state) does not
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "checkpoint.every=2",
                            "sampling.max_staleness=10", preexec_fn=limit_file_size)
    code, log = feed_trainer(trainer, address, digit_model_dir, [True, True, True], tmp_path)
    assert code == EXIT_WRITE_FAILED, log[-3000:]
    assert f"cannot write the checkpoint of step 2 to {tmp_path / 'checkpoints'}" in log
    assert "Nothing partial is visible" in log
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]  # every trained step's metrics are there
    assert read_latest(tmp_path / "weights") == 2
    assert [verify(version_dir(tmp_path / "weights", v))["version"] for v in (1, 2)] == [1, 2]  # whole
    assert not (tmp_path / "checkpoints" / "latest").exists()  # a resume would not pick the broken one


def test_an_unwritable_run_folder_stops_the_launcher_and_the_sampler_at_start(tmp_path, digit_model_dir,
                                                                              tiny_gsm8k):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    bad = blocker / "run"
    for command in (["-m", "grpo", "train"], [str(REPO / "sampling_worker.py")]):
        proc = subprocess.run([sys.executable, *command, "--config", str(PROCESS_CONFIG),
                               f"run.dir={bad}", f"model.name_or_path={digit_model_dir}", f"data.path={tiny_gsm8k}"],
                              cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert f"the run folder {bad} is not writable (Not a directory" in proc.stdout + proc.stderr, command


def test_garbage_on_the_trainers_socket_is_counted_and_training_goes_on(tmp_path, digit_model_dir, tiny_gsm8k):
    address = free_tcp_address()
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "training.steps=2")
    context = zmq.Context()
    raw = context.socket(zmq.PUSH)
    raw.connect(address)
    model = AutoModelForCausalLM.from_pretrained(digit_model_dir)
    rng = random.Random(0)
    cfg, behaviour = trainer_settings(tmp_path, digit_model_dir)
    good = [encode_batch(crafted_batch(model, step, True, cfg, behaviour), run_secret(None, tmp_path))
            for step in range(2)]
    pickled = [b'{"schema": "grpo.sampler.rollout/1"}', b"\x80\x04\x95" + rng.randbytes(40)]  # a pickle-looking frame
    try:
        for step in range(2):
            for _ in range(10):
                raw.send_multipart([rng.randbytes(rng.randrange(1, 200)) for _ in range(rng.randrange(1, 4))])
            raw.send_multipart(pickled)
            raw.send_multipart(good[step])
        code = trainer.wait(timeout=300)
    finally:
        raw.close(linger=0)
        context.term()
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert code == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    trained = rows(tmp_path)
    assert [r["step"] for r in trained] == [1, 2] and trained[-1]["trainer/rejected_messages"] == 22


def test_a_batch_whose_advantages_do_not_follow_from_its_rewards_stops_the_trainer(tmp_path, digit_model_dir,
                                                                                  tiny_gsm8k):
    """Signed with the run's secret, so that only the advantage check stands between it and the loss:
    step 0 trains, step 1 is forged (an advantage of 1e4), and the trainer names the sample and exits. The
    other forgeries (a total raised, a failed sample scored above its group, an unscored one with an
    advantage) are named by the same check: tests/test_advantages.py."""
    def forge(batch):
        if batch.step == 1:
            batch.advantages[0] = 1e4
        return batch

    address = free_tcp_address()
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, "sampling.max_staleness=10")
    code, log = feed_trainer(trainer, address, digit_model_dir, [True, True], tmp_path, forge=forge)
    assert code == EXIT_BEHAVIOUR_MISMATCH, log[-3000:]
    assert ("sampler 0 step 1's advantages do not follow from its rewards under this run's rewards.weights and "
            "training.advantage=grpo, training.advantage_scale=group: sample 0's advantage 10000 is not the "
            "group-scaled grpo one of its totals (0.865") in log and "Nothing was trained with it" in log
    assert [r["step"] for r in rows(tmp_path)] == [1] and read_latest(tmp_path / "weights") == 1


def test_a_batch_sampled_at_another_temperature_stops_the_trainer_before_it_trains(tmp_path, digit_model_dir,
                                                                                  tiny_gsm8k):
    """Sampler at temperature 0.7, trainer at 0.9 (its config): the trainer names the key and both
    values and exits; no step is trained, no weights are published."""
    log = refused_before_training(tmp_path, digit_model_dir, tiny_gsm8k, ["sampling.temperature=0.9"],
                                  ["sampling.temperature=0.7"])
    assert "sampler 0 step 0 was made with other settings than this trainer's; nothing was trained with it" in log
    assert "sampling.temperature: the sampler used 0.7, this trainer has 0.9" in log


def refused_before_training(run_dir, model_dir, data_dir, trainer_extra: list, sampler_extra: list) -> str:
    """Start both; the trainer must exit with the behaviour-mismatch code having trained and
    published nothing. Its log."""
    address = free_tcp_address()
    trainer = start_trainer(run_dir, model_dir, data_dir, address, *trainer_extra)
    sampler = start_sampler(run_dir, model_dir, data_dir, address, *COMMON, *sampler_extra)
    try:
        code = trainer.wait(timeout=300)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
        sampler.kill()
    log = (run_dir / "trainer.log").read_text()
    assert code == EXIT_BEHAVIOUR_MISMATCH, log[-3000:]
    assert rows(run_dir) == [] and read_latest(run_dir / "weights") is None
    return log


def test_a_batch_sampled_with_weights_this_trainer_did_not_publish_stops_it_before_it_trains(
        tmp_path, digit_model_dir, tiny_gsm8k):
    """The sampler reads another run's weights folder, whose v1 this trainer never published: the
    batch's manifest digest is not one the trainer recorded, so it names both and exits."""
    foreign = tmp_path / "other-run-weights"
    publish(trained_adapter(digit_model_dir, seed=3), foreign, version=1, step=1)
    stranger = verify(version_dir(foreign, 1))["digest"]
    log = refused_before_training(tmp_path, digit_model_dir, tiny_gsm8k, [], [f"weights.dir={foreign}"])
    assert (f"sampler 0 step 0 was sampled with weights v1 whose manifest sha256 is {stranger[:16]}, but this "
            "trainer published v1 as nothing; nothing was trained with it") in log


@pytest.mark.parametrize("killed", ["sampler1", "trainer"])
def test_two_samplers_and_two_ranks_lose_nothing_when_one_process_is_killed(tmp_path, digit_model_dir, tiny_gsm8k,
                                                                           killed):
    """kill -9 sampler 1 (then restart it), or the trainer (then restart it from its checkpoint):
    global steps 0-7 are trained once each and in order, each made by sampler g % 2 as its step
    g // 2, and each sampler generated each of its steps once."""
    address, steps, two = free_tcp_address(), "training.steps=8", "sampling.num_workers=2"
    trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, two, steps, "checkpoint.every=2",
                            "transport.recv_timeout_s=120")
    samplers = {f"sampler{i}": start_sampler(tmp_path, digit_model_dir, tiny_gsm8k, address, *COMMON, two, steps,
                                             f"sampling.worker_index={i}", log_name=f"sampler{i}.log")
                for i in range(2)}
    try:
        wait_for(lambda: len(rows(tmp_path)) >= 3, "three trained steps")
        if killed == "trainer":
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
            trainer = start_trainer(tmp_path, digit_model_dir, tiny_gsm8k, address, two, steps, "checkpoint.every=2",
                                    "transport.recv_timeout_s=120")
        else:
            samplers["sampler1"].send_signal(signal.SIGKILL)
            samplers["sampler1"].wait()
            samplers["sampler1"] = start_sampler(tmp_path, digit_model_dir, tiny_gsm8k, address, *COMMON, two, steps,
                                                 "sampling.worker_index=1", log_name="sampler1.log")
        codes = trainer.wait(timeout=600), *(s.wait(timeout=120) for s in samplers.values())
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
        for s in samplers.values():
            s.kill()
    logs = (tmp_path / "trainer.log").read_text()[-3000:] + (tmp_path / "sampler1.log").read_text()[-2000:]
    assert codes == (0, 0, 0), logs
    trained = rows(tmp_path)
    assert [r["step"] for r in trained] == list(range(1, 9)), logs
    assert [(r["sampler/index"], r["sampler_step"]) for r in trained] == [(g % 2, g // 2) for g in range(8)], logs
    for i in range(2):
        assert_each_step_generated_once(tmp_path, f"sampler{i}.log", 4, logs)
    assert all(0 <= r["staleness"] <= 1 for r in trained)
