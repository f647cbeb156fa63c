"""One sampler step through the engine interface: a fake engine that implements `RolloutEngine`
(no model of its own) and the HF engine drive the same `make_batch`."""

import torch

from data.gsm8k import Problem
from data.prompts import Prompt
from grpo.config import load_config
from grpo.logprobs import completion_logprobs
from grpo.models import add_lora
from grpo.rollout import RolloutEngine, Rollouts
from grpo.rollout.hf_engine import HFEngine
from grpo.sampler_step import SamplerPolicy, make_batch
from conftest import tiny_model


class FakeEngine:
    """Two fixed completions per prompt with fixed log-probs, as a remote engine would return them."""

    def __init__(self):
        self.version, self.weights_digest, self.loaded = 0, "initial", []

    def generate(self, prompts, group_size, *, seed=None, greedy=False):
        n = len(prompts) * group_size
        completions = [torch.tensor([7 + j % group_size, 1]) for j in range(n)]  # token 1 is EOS
        logps = [torch.tensor([-0.5 - j, -0.25]) for j in range(n)]
        return Rollouts(completions, [False] * n, logps)

    def load_weights(self, folder, manifest, version):
        self.loaded.append(version)
        self.version, self.weights_digest = version, manifest["digest"]

    def close(self):
        pass


class DigitTokenizer:
    pad_token_id, eos_token_id = 0, 1

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(str(int(t)) for t in row if int(t) != 1) for row in ids]


def prompts():
    return [Prompt(Problem(f"train-{i}", f"q{i}", str(7 + i)), [3, 4, 5 + i]) for i in range(2)]


def config(*overrides):
    # engine=vllm with the default old_logps=generation: the combination the engine interface unblocked
    return load_config(None, ["sampling.engine=vllm", "sampling.group_size=2", "lora.r=4", "training.beta=0",
                              "rewards.names=[gsm8k_answer_lenient]", "rewards.weights=[1.0]", "data.prefill=",
                              *overrides])


def test_both_engines_implement_the_interface():
    model = tiny_model()
    assert isinstance(FakeEngine(), RolloutEngine)
    assert isinstance(HFEngine(model, DigitTokenizer(), config().sampling), RolloutEngine)


def test_a_step_takes_the_engines_log_probs_and_version_through_the_interface():
    cfg = config()
    assert cfg.sampling.old_logps == "generation"
    model = add_lora(tiny_model(), cfg.lora).eval()
    engine = FakeEngine()
    engine.load_weights(None, {"kind": "lora", "digest": "d3"}, 3)
    policy = SamplerPolicy(engine, model, None, DigitTokenizer(), {"sampling.temperature": 0.9})
    batch = make_batch(cfg, policy, prompts(), step=5, sampler=0, sandbox=None, metrics_so_far={"timing/x": 1.0},
                       check_recorded=True)
    assert (batch.step, batch.policy_version, batch.weights_digest, batch.behaviour) == \
        (5, 3, "d3", {"sampling.temperature": 0.9})
    expected = engine.generate([[0], [0]], 2).logps
    assert all(torch.equal(a, b) for a, b in zip(batch.old_logps, expected))
    # the answer reward reads the last number: completions "7" and "8" against answers 7 and 8
    assert batch.rewards[:, 0].tolist() == [1.0, -1.0, -1.0, 1.0]
    with torch.no_grad():
        recomputed = completion_logprobs(model, batch.prompt_ids, batch.completion_ids, [2, 2],
                                         temperature=cfg.sampling.temperature)
    gap = max((a - b).abs().max().item() for a, b in zip(expected, recomputed))
    metrics = batch.meta["metrics"]
    assert metrics["sampler/engine_logp_gap_max"] == gap and metrics["timing/x"] == 1.0

    recompute = make_batch(config("sampling.old_logps=recompute"), policy, prompts(), step=5, sampler=0,
                           sandbox=None, metrics_so_far={}, check_recorded=False)
    assert all(torch.equal(a, b) for a, b in zip(recompute.old_logps, recomputed))
