"""The real sampler process on loopback: staleness, hot-swap order, refusals, cursor resume."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import PROCESS_CONFIG, REPO
from helpers import free_tcp_address

from grpo.config import LoraConfig, ModelConfig
from grpo.data.cursor import PromptCursor
from grpo.model.flops import ModelShape, generation_flops
from grpo.model.loading import add_lora, load_model
from grpo.model.logprobs import completion_logprobs
from grpo.run.secret import run_secret
from grpo.weights.folder import publish, version_dir
from grpo.wire.staleness import required_version
from grpo.wire.transport import BatchReceiver, TransportTimeout


def start_sampler(run_dir, model_dir, data_dir, address, *extra, log_name="sampler.log"):
    args = [sys.executable, str(REPO / "sampling_worker.py"), "--config", str(PROCESS_CONFIG),
            f"run.dir={run_dir}", f"model.name_or_path={model_dir}", f"data.path={data_dir}",
            f"transport.address={address}", "sampling.prompts_per_step=2", "sampling.group_size=3",
            "sampling.max_new_tokens=6", "lora.r=4", "sampling.wait_timeout_s=120", "transport.send_timeout_s=120",
            "logging.level=INFO", *extra]
    log = open(run_dir / log_name, "ab")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def trained_adapter(model_dir, seed):
    model = add_lora(load_model(ModelConfig(name_or_path=str(model_dir))), LoraConfig(r=4))
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    return model.eval()


def logps_of(model, batch):
    with torch.no_grad():
        return completion_logprobs(model, batch.prompt_ids, batch.completion_ids, batch.group_sizes, temperature=0.9)


def close(a, b):
    return all(torch.allclose(x, y, atol=1e-5) for x, y in zip(a, b))


@pytest.mark.parametrize("publish_every", [1, 2, 3])
@pytest.mark.parametrize("extra", [0, 1, 2])
def test_the_required_version_is_published_in_time_and_within_max_staleness(publish_every, extra):
    """For every step g: the version the sampler waits for exists (a multiple of publish_every), is
    at most max_staleness behind g, and is published by the time the trainer has trained g steps
    (the newest version then is g rounded down). Before, it was rounded down: up to
    max_staleness + publish_every - 1 behind."""
    max_staleness = publish_every - 1 + extra
    for g in range(40):
        v = required_version(g, max_staleness, publish_every)
        assert v % publish_every == 0 and g - max_staleness <= v <= g - g % publish_every, (g, v)
    assert required_version(5, 1, 2) == 4 and required_version(6, 1, 2) == 6 and required_version(5, 2, 3) == 3


def test_staleness_zero_waits_for_each_version_and_loads_before_generating(tmp_path, tiny_model_dir, tiny_gsm8k):
    address = free_tcp_address()
    receiver = BatchReceiver(address, secret=run_secret(None, tmp_path))  # the run's, as the trainer's
    proc = start_sampler(tmp_path, tiny_model_dir, tiny_gsm8k, address, "sampling.max_staleness=0",
                         "training.steps=3", "training.reference_on=sampler")
    try:
        first = receiver.receive_frames(timeout_s=120)[1]
        assert (first.step, first.policy_version) == (0, 0)
        assert first.ref_logps is not None and len(first.completion_ids) == 6
        assert set(first.meta["metrics"]) >= {"reward", "reward_std", "frac_reward_zero_std",
                                              "completions/mean_length", "completions/clipped_ratio",
                                              "completions/eos_rate", "timing/generate_s", "timing/logprobs_s",
                                              "timing/rewards_s", "sampler/tokens_per_s", "policy_version",
                                              "rewards/gsm8k_answer_lenient/mean",
                                              "rewards/think_answer_format_partial/std",
                                              "strict/answer_accuracy", "strict/format_rate"}
        generated = generation_flops(ModelShape.of(trained_adapter(tiny_model_dir, seed=0)),
                                     [len(p) for p in first.prompt_ids], [len(c) for c in first.completion_ids],
                                     first.group_sizes)  # its value: tests/test_flops.py
        assert first.meta["metrics"]["perf/generation_model_gflop"] == pytest.approx(generated.total / 1e9)
        with pytest.raises(TransportTimeout):  # step 1 needs v1, which does not exist yet
            receiver.receive_frames(timeout_s=3)[1]

        v1 = trained_adapter(tiny_model_dir, seed=1)
        publish(v1, tmp_path / "weights", version=1, step=1)
        second = receiver.receive_frames(timeout_s=60)[1]
        assert (second.step, second.policy_version) == (1, 1)
        assert close(second.old_logps, logps_of(v1, second))  # generated and scored by v1
        with v1.disable_adapter():
            assert close(second.ref_logps, logps_of(v1, second))  # reference: the adapter off
            assert not close(second.old_logps, logps_of(v1, second))

        # v2 arrives corrupted: refused, v1 kept; then re-published intact: loaded, then used
        v2 = trained_adapter(tiny_model_dir, seed=2)
        proc.send_signal(signal.SIGSTOP)  # it must not read v2 between its publish and its corruption
        try:
            publish(v2, tmp_path / "weights", version=2, step=2)
            path = version_dir(tmp_path / "weights", 2) / "adapter_model.safetensors"
            path.write_bytes(path.read_bytes()[:-1] + b"\x00")
        finally:
            proc.send_signal(signal.SIGCONT)
        with pytest.raises(TransportTimeout):
            receiver.receive_frames(timeout_s=3)[1]
        publish(v2, tmp_path / "weights", version=2, step=2)
        third = receiver.receive_frames(timeout_s=60)[1]
        assert (third.step, third.policy_version) == (2, 2)
        assert third.meta["metrics"]["sampler/weight_load_failures"] == 1.0
        assert close(third.old_logps, logps_of(v2, third))
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        receiver.close()
    log = (tmp_path / "sampler.log").read_text()
    events = [log.index(e) for e in ("step 0 v0", "loaded weights v1", "step 1 v1", "refused weights v2",
                                     "loaded weights v2", "step 2 v2")]
    assert events == sorted(events), log[-3000:]


def test_restarted_sampler_continues_with_the_next_prompts(tmp_path, tiny_model_dir, tiny_gsm8k):
    address = free_tcp_address()
    receiver = BatchReceiver(address, secret=run_secret(None, tmp_path))  # the run's, as the trainer's
    try:
        proc = start_sampler(tmp_path, tiny_model_dir, tiny_gsm8k, address, "sampling.max_staleness=10",
                             "training.steps=3", "data.few_shot=2")
        got = [receiver.receive_frames(timeout_s=120)[1] for _ in range(3)]
        assert proc.wait(timeout=60) == 0
        proc = start_sampler(tmp_path, tiny_model_dir, tiny_gsm8k, address, "sampling.max_staleness=10",
                             "training.steps=5", "data.few_shot=2")
        got += [receiver.receive_frames(timeout_s=120)[1] for _ in range(2)]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        receiver.close()
    # one uninterrupted run's order over the 10 problems that are asked: train-0 and train-1 are
    # the two few-shot examples, shown in every prompt and never asked themselves
    cursor = PromptCursor(10, seed=0)
    expected = [[f"train-{2 + i}" for i in cursor.take(2)] for _ in range(5)]
    assert [b.step for b in got] == [0, 1, 2, 3, 4]
    assert [b.meta["sample_ids"] for b in got] == expected
    assert "resuming at step 3" in (tmp_path / "sampler.log").read_text()


def test_old_logps_read_off_generation_are_the_serving_versions_and_checked_once(tmp_path, tiny_model_dir,
                                                                                 tiny_gsm8k):
    address = free_tcp_address()
    receiver = BatchReceiver(address, secret=run_secret(None, tmp_path))  # the run's, as the trainer's
    proc = start_sampler(tmp_path, tiny_model_dir, tiny_gsm8k, address, "sampling.max_staleness=0",
                         "training.steps=2", "sampling.old_logps=generation")
    try:
        first = receiver.receive_frames(timeout_s=120)[1]
        v1 = trained_adapter(tiny_model_dir, seed=1)
        with v1.disable_adapter():  # v0: the adapter's B starts at zero, so v0 is the base model
            assert close(first.old_logps, logps_of(v1, first))
        # checked once per start, on the second step: the first batch goes out without the recompute
        assert "sampler/engine_logp_gap_max" not in first.meta["metrics"]
        publish(v1, tmp_path / "weights", version=1, step=1)
        second = receiver.receive_frames(timeout_s=60)[1]
        assert second.policy_version == 1 and close(second.old_logps, logps_of(v1, second))
        assert second.meta["metrics"]["sampler/engine_logp_gap_max"] < 1e-5
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        receiver.close()
    assert "old log-probs read off generation differ from the recomputed ones by at most" in (
        tmp_path / "sampler.log").read_text()


def test_embedded_model_streams_real_gsm8k_batches(tmp_path, gsm8k_data):
    address = free_tcp_address()
    receiver = BatchReceiver(address, secret=run_secret(None, tmp_path))  # the run's, as the trainer's
    proc = start_sampler(tmp_path, "smollm2-135m-instruct", gsm8k_data, address, "training.steps=1",
                         "sampling.max_new_tokens=24", "sampling.group_size=2", "sampling.prompts_per_step=1")
    try:
        batch = receiver.receive_frames(timeout_s=300)[1]
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
        receiver.close()
    assert batch.group_sizes == [2] and batch.meta["sample_ids"][0].startswith("train-")
    assert all(len(c) <= 24 for c in batch.completion_ids)
    assert batch.rewards.shape == (2, 2)
    assert all(bool((x <= 0).all()) for x in batch.old_logps)


UNREADABLE_REWARD = '''\
"""A reward that reads a column the dataset does not have: it raises on every sample."""


def exact_match(completion, row):
    return float(completion.strip() == row["solution"])
'''


def test_a_reward_that_raises_on_every_sample_stops_the_sampler_with_its_error_and_line(tmp_path, tiny_model_dir,
                                                                                          tiny_gsm8k):
    """rewards.max_failed_steps=2: step 0 is sent (its samples left out: no score, advantage 0), step 1
    is not; exit code 8, one error line naming the reward, the error and the line of the user's file
    that raised it (the reward runs in the sandbox child)."""
    from grpo.workers.sampler import EXIT_REWARD_FAILED

    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(UNREADABLE_REWARD)
    address = free_tcp_address()
    receiver = BatchReceiver(address, secret=run_secret(None, tmp_path))  # the run's, as the trainer's
    proc = start_sampler(tmp_path, tiny_model_dir, tiny_gsm8k, address, "sampling.max_staleness=10",
                         "training.steps=4", f"rewards.names=[{rewards}:exact_match]", "rewards.weights=[1.0]",
                         "rewards.max_failed_steps=2")
    try:
        first = receiver.receive_frames(timeout_s=120)[1]
        assert proc.wait(timeout=120) == EXIT_REWARD_FAILED == 8
        with pytest.raises(TransportTimeout):
            receiver.receive_frames(timeout_s=1)
    finally:
        proc.kill()
        receiver.close()
    assert first.step == 0 and first.rewards[:, 0].tolist() == [0.0] * 6 and first.advantages.tolist() == [0.0] * 6
    assert first.meta["metrics"][f"rewards/{rewards}:exact_match/failures"] == 6.0
    errors = [line.split(" sampler ERROR ", 1)[1] for line in (tmp_path / "sampler.log").read_text().splitlines()
              if " sampler ERROR " in line]
    assert errors == [f"reward {rewards}:exact_match failed on all 6 samples in each of the last 2 steps: KeyError: "
                      f"'solution' ({rewards}:5, in exact_match); stopped. Fix the function, or set "
                      "rewards.max_failed_steps=0 to train on without it (the samples it fails on score the "
                      "batch's worst, or are left out)"]
