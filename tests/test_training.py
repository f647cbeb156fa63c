"""The trainer on real DeepSpeed ranks (gloo, CPU) with a real sampler process on loopback."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import PROCESS_CONFIG, REPO
from helpers import free_tcp_address
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from teacher_server import serve_teacher
from test_sampling_worker import start_sampler
from transformers import AutoModelForCausalLM

from grpo.config import LoraConfig, ModelConfig
from grpo.model.loading import add_lora, load_model
from grpo.run.ports import free_local_port
from grpo.run.tracking import run_id
from grpo.weights.folder import read_latest, version_dir

DEEPSPEED = Path(sys.executable).parent / "deepspeed"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_two_rank_update_equals_the_single_process_whole_batch_update(tmp_path):
    """W=2 ranks with several micro-batches each against one process: every aggregation at both
    levels (GRPO token, GSPO sequence) at ZeRO-0, every aggregation at the token level at ZeRO-2 and
    ZeRO-3, GSPO/grpo at ZeRO-3, the reference log-probs computed by the trainer at ZeRO-0 and 3, and
    CISPO with the entropy bonus, SAPO with GSPO's sequence ratio; and a tiny Qwen2-VL with images whose vision encoder
    trains (model.train_vision) at ZeRO-2 and ZeRO-0, one rank padding with a zero-loss forward."""
    out = tmp_path / "result.json"
    proc = subprocess.run([str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_local_port()),
                           str(REPO / "tests" / "ds_equivalence.py"), str(out)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert len(cases) == 19
    assert [case["micro_batches"] for case in cases if "model.train_vision=true" in case["case"]] == [[1, 2]] * 2
    for case in cases:
        assert relative(case["loss"], case["ref_loss"]) <= 1e-6, case["case"]
        assert relative(case["grad_norm"], case["ref_grad_norm"]) <= 1e-6, case["case"]
        delta = torch.tensor([x for n in case["delta"] for x in torch.tensor(case["delta"][n]).flatten().tolist()])
        ref = torch.tensor([x for n in case["ref_delta"]
                            for x in torch.tensor(case["ref_delta"][n]).flatten().tolist()])
        assert ((delta - ref).norm() / ref.norm()).item() <= 1e-6, case["case"]


def start_trainer(run_dir, model_dir, data_dir, address, *extra):
    args = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(free_local_port()),
            str(REPO / "training_worker.py"),
            "--config", str(PROCESS_CONFIG), f"run.dir={run_dir}", f"model.name_or_path={model_dir}",
            f"data.path={data_dir}", f"transport.address={address}", "sampling.prompts_per_step=2",
            "sampling.group_size=3", "sampling.max_new_tokens=6", "lora.r=4", "transport.recv_timeout_s=300",
            *extra]
    log = open(run_dir / "trainer.log", "ab")
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=ENV)


LEARNING = ["sampling.max_new_tokens=1", "sampling.group_size=8", "sampling.prompts_per_step=2",
            "rewards.names=[gsm8k_answer_lenient]", "rewards.weights=[1.0]", "training.learning_rate=0.05",
            "sampling.max_staleness=1"]

TRAINER_KEYS = {"step", "loss", "policy_loss", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "grad_norm", "learning_rate", "staleness", "timing/wait_s",
                "timing/train_s", "timing/publish_s", "timing/forward_backward_s", "timing/optimizer_s",
                "trainer/tokens_per_s", "trainer/completion_tokens", "wall_time", "perf/trainer_model_gflop",
                "perf/trainer_recomputed_gflop", "perf/trainer_gflop_per_s"}
SAMPLER_KEYS = {"reward", "reward_std", "timing/generate_s", "timing/logprobs_s", "timing/rewards_s",
                "timing/weights_wait_s", "timing/weight_load_s", "timing/previous_send_s", "completions/mean_length",
                "policy_version"}


def run_both(run_dir, model_dir, data_dir, *extra, timeout=600):
    address = free_tcp_address()
    trainer = start_trainer(run_dir, model_dir, data_dir, address, *extra)
    sampler = start_sampler(run_dir, model_dir, data_dir, address, *extra)
    try:
        codes = trainer.wait(timeout=timeout), sampler.wait(timeout=120)
    finally:
        trainer.kill()
        sampler.kill()
    logs = (run_dir / "trainer.log").read_text()[-4000:] + (run_dir / "sampler.log").read_text()[-2000:]
    assert codes == (0, 0), logs
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deepspeed_shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")}


def test_sampler_and_two_rank_trainer_train_together(tmp_path, digit_model_dir, tiny_gsm8k):
    segments = deepspeed_shm_segments()
    # the trainer computes the reference log-probs here (the sampler ships none); KL > 0 once the adapter moved
    rows = run_both(tmp_path, digit_model_dir, tiny_gsm8k, "training.steps=3", "training.reference_on=trainer",
                    "logging.backend=wandb", *LEARNING)
    assert deepspeed_shm_segments() <= segments  # DeepSpeed's 69 MB /dev/shm segments are not left behind
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["sampler_step"] for r in rows] == [0, 1, 2]
    for row in rows:
        assert TRAINER_KEYS | SAMPLER_KEYS <= set(row), TRAINER_KEYS | SAMPLER_KEYS - set(row)
        assert 0 <= row["staleness"] <= 1
        assert row["perf/trainer_gflop_per_s"] == pytest.approx(row["perf/trainer_model_gflop"] / row["timing/train_s"])
        # tests/test_flops.py: the values
        assert row["perf/trainer_model_gflop"] > row["perf/trainer_recomputed_gflop"] > 0
    assert any(r["frac_reward_zero_std"] < 1 for r in rows)  # some group had a learning signal
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0  # v0 is the reference itself (LoRA B starts at 0)
    weights = tmp_path / "weights"
    assert read_latest(weights) == 3 and all(version_dir(weights, v).is_dir() for v in (1, 2, 3))
    adapter = load_file(version_dir(weights, 3) / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())  # LoRA B starts at 0
    assert (tmp_path / "tb").is_dir() and (tmp_path / "checkpoints" / "latest").is_file()
    # W&B offline, from rank 0 only: one run of this trainer (tests/test_tracking.py reads the records)
    assert len(list((tmp_path / "wandb").glob(f"offline-run-*-{run_id(tmp_path)}-trainer-*/run-*.wandb"))) == 1
    assert all(r["tracker/failures"] == 0 for r in rows)


BROKEN_TRACKIO = """
class _Run:
    pass


def init(**kwargs):
    return _Run()


def log(values, step=None):
    raise ConnectionError("the tracker's server went away")


def finish():
    raise RuntimeError("finish failed too")
"""


def test_a_raising_tracker_neither_stops_nor_stalls_a_two_rank_run(tmp_path, digit_model_dir, tiny_gsm8k,
                                                                    monkeypatch):
    """An exception in rank 0's tracker used to leave rank 1 waiting in the next collective: now it
    is logged and counted (tracker/failures) and both ranks train every step."""
    shim = tmp_path / "shim" / "trackio"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text(BROKEN_TRACKIO)
    monkeypatch.setitem(ENV, "PYTHONPATH", str(shim.parent))
    rows = run_both(tmp_path, digit_model_dir, tiny_gsm8k, "training.steps=3", "logging.backend=trackio", *LEARNING,
                    timeout=400)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # counted before each row is sent: each step's row and its completions table (logging.completions_per_step)
    assert [r["tracker/failures"] for r in rows] == [0, 2, 4]
    assert "the tracker's log failed (ConnectionError: the tracker's server went away)" in \
        (tmp_path / "trainer.log").read_text()


@pytest.mark.parametrize("stage", [0, 3])
def test_stopped_run_resumes_without_training_a_sampler_step_twice_or_skipping_one(tmp_path, digit_model_dir,
                                                                                    tiny_gsm8k, stage):
    """ZeRO-3 too: its checkpoints hold parameter slices, and publishing gathers them on every rank."""
    zero = f"deepspeed.zero_stage={stage}"
    first = run_both(tmp_path, digit_model_dir, tiny_gsm8k, "training.steps=2", "checkpoint.every=1", zero, *LEARNING)
    v1, v2 = (load_file(version_dir(tmp_path / "weights", v) / "adapter_model.safetensors") for v in (1, 2))
    fresh = get_peft_model_state_dict(add_lora(
        AutoModelForCausalLM.from_pretrained(digit_model_dir),
        LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])))
    assert {k: v.shape for k, v in v2.items()} == {k.replace(".default", ""): v.shape for k, v in fresh.items()}
    assert any(not torch.equal(v1[k], v2[k]) for k in v1)  # whole tensors, and step 2 changed them
    rows = run_both(tmp_path, digit_model_dir, tiny_gsm8k, "training.steps=4", "checkpoint.every=1", zero, *LEARNING)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # metrics.jsonl is appended
    assert [r["sampler_step"] for r in rows] == [0, 1, 2, 3]
    assert "resumed from" in (tmp_path / "trainer.log").read_text()
    assert "resuming at step 2" in (tmp_path / "sampler.log").read_text()
    republished = load_file(version_dir(tmp_path / "weights", 2) / "adapter_model.safetensors") \
        if version_dir(tmp_path / "weights", 2).is_dir() else v2
    assert all(torch.equal(v2[k], republished[k]) for k in v2)  # the checkpoint holds the published weights
    assert first[-1]["step"] == 2


def test_a_lora_checkpoint_holds_what_trains_and_resumes_to_the_uninterrupted_run_bit_for_bit(tmp_path, tiny_model_dir,
                                                                                              tiny_gsm8k):
    """The checkpoint of a LoRA run leaves out the frozen base, a tied embedding under both its names
    (smaller than a quarter of the base), and a run stopped after 2 steps and resumed for 2 more
    publishes the adapter of 4 uninterrupted steps, bit for bit (at staleness 0 each step samples
    with the version before it, so the runs are alike)."""
    exact = [*LEARNING, "sampling.max_staleness=0", "checkpoint.every=2"]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    whole.mkdir()
    stopped.mkdir()
    run_both(whole, tiny_model_dir, tiny_gsm8k, "training.steps=4", *exact)
    run_both(stopped, tiny_model_dir, tiny_gsm8k, "training.steps=2", *exact)
    states = stopped / "checkpoints" / "step000002" / "mp_rank_00_model_states.pt"
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)  # tied embeddings, as SmolLM2's
    base_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    assert states.stat().st_size < base_bytes / 4, (states.stat().st_size, base_bytes)
    saved = torch.load(states, map_location="cpu", weights_only=False)["module"]
    assert saved and all("lora_" in name for name in saved)  # the adapter alone: no frozen base weight
    run_both(stopped, tiny_model_dir, tiny_gsm8k, "training.steps=4", *exact)
    assert "resumed from" in (stopped / "trainer.log").read_text()
    resumed, uninterrupted = (load_file(version_dir(run / "weights", 4) / "adapter_model.safetensors")
                              for run in (stopped, whole))
    assert resumed.keys() == uninterrupted.keys()
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


@pytest.mark.parametrize("served", [True, False], ids=["served-teacher", "teacher-in-the-sampler"])
def test_a_users_estimator_and_loss_a_teacher_and_the_kl_in_the_reward_train_two_steps(tmp_path, digit_model_dir,
                                                                                      tiny_model_dir, tiny_gsm8k,
                                                                                      served):
    """training.advantage and training.loss as import paths (tests/test_advantages.py:double_the_centred,
    tests/test_losses.py:my_ppo_clip) with the entropy bonus, a teacher (distill.teacher, with the rewards'
    advantage) and the KL in the reward: the sampler makes the advantages with the user's estimator and ships
    the teacher's log-probs, the trainer recomputes the advantages with the estimator before it trains, and two
    steps update the adapter.
    The teacher (the tiny model before its head was taught digits), loaded in the sampler or served
    (distill.teacher_url: a server in vLLM's answer shape, tests/teacher_server.py), finds the digits the student
    samples unlikely: the reverse KL is large. A served one is asked once at start, then for each step's
    completions."""
    teacher = load_model(ModelConfig(name_or_path=str(tiny_model_dir), dtype="float32")).eval()
    with serve_teacher(teacher, name=str(tiny_model_dir)) as (url, requests):
        rows = run_both(tmp_path, digit_model_dir, tiny_gsm8k, "training.steps=2",
                        "training.advantage=tests/test_advantages.py:double_the_centred",
                        "training.loss=tests/test_losses.py:my_ppo_clip", "training.entropy_coef=0.01",
                        f"distill.teacher={tiny_model_dir}", "distill.with_rewards=true", "training.kl_in=reward",
                        "training.kl_estimator=k1", "training.reference_on=sampler", "training.beta=0.5", *LEARNING,
                        *([f"distill.teacher_url={url}", "sampling.temperature=1.0"] if served else []))
    assert [r["step"] for r in rows] == [1, 2] and all(r["entropy"] > 0 for r in rows)
    sent = [len(r["prompt"]) for r in requests[1:]]  # after the check at start: each step's 2 x 8 completions
    assert (len(sent) >= 2 and all(n == 16 for n in sent)) if served else not requests, sent
    assert all(r["distill/reverse_kl"] > 1.0 for r in rows), rows
    # the KL penalty column, recomputed by the trainer from the batch's log-probs before it trained on it:
    # -beta x the summed KL of the engine's log-probs to the reference's (those of the weights served, the
    # adapter off); at version 0 the adapter is the identity, so its only part is the engine/trainer gap
    assert abs(rows[0]["rewards/kl_penalty/mean"]) < 1e-4 and "kl" in rows[0], rows
    adapter = load_file(version_dir(tmp_path / "weights", 2) / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapter.items())  # LoRA B starts at 0
