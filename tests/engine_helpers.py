"""What the sampler-step tests share: engines that implement `RolloutEngine` without a model of their own
(fixed or scripted completions), a tokenizer of digits, two prompts and the config they run under."""


import torch
from conftest import tiny_model

from grpo.config import load_config
from grpo.data.problems import Problem
from grpo.data.prompts import Prompt
from grpo.model.loading import add_lora
from grpo.sampler.batches import SamplerModels, make_batch
from grpo.sampler.rollout import Rollouts
from grpo.weights.folder import Staged


class FakeEngine:
    """Two fixed completions per prompt with fixed log-probs, as a remote engine would return them."""

    generates_with_scoring_model = False  # a remote engine holds its own copy of the weights

    def __init__(self):
        self.version, self.weights_digest, self.loaded = 0, "initial", []

    @classmethod
    def build(cls, cfg, model, tokenizer):
        return cls()

    def generate(self, prompts, group_size, *, seed=None, greedy=False):
        n = len(prompts) * group_size
        completions = [torch.tensor([7 + j % group_size, 1]) for j in range(n)]  # token 1 is EOS
        logps = [torch.tensor([-0.5 - j, -0.25]) for j in range(n)]
        return Rollouts(completions, [False] * n, logps)

    def stage_weights(self, folder, manifest, version):
        def commit():
            self.loaded.append(version)
            self.version, self.weights_digest = version, manifest["digest"]
        return Staged(commit)

    def load_weights(self, folder, manifest, version):
        self.stage_weights(folder, manifest, version).commit()

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

class ScriptedEngine(FakeEngine):
    """A prompt whose last token is even gets G equal completions (no reward spread); an odd one
    gets completions "7", "8", ... (the answer reward tells them apart). Records each call's seed."""

    def __init__(self):
        super().__init__()
        self.seeds = []

    def generate(self, prompts, group_size, *, seed=None, greedy=False):
        self.seeds.append(seed)
        ids = [torch.tensor([7 + (j if p[-1] % 2 else 0), 1]) for p in prompts for j in range(group_size)]
        return Rollouts(ids, [False] * len(ids), [torch.tensor([-0.5, -0.25])] * len(ids))

def numbered_prompts(*last_tokens):
    return [Prompt(Problem(f"train-{t}", f"q{t}", "7"), [3, 4, t]) for t in last_tokens]

def dynamic_batch(rounds, *overrides):
    cfg = config("sampling.dynamic_sampling=true", "sampling.dynamic_sampling_max_rounds=3", *overrides)
    engine = ScriptedEngine()
    policy = SamplerModels.of(cfg, engine, add_lora(tiny_model(), cfg.lora).eval(), None, DigitTokenizer(), {})
    batch = make_batch(cfg, policy, rounds[0], step=4, metrics_so_far={},
                       measure_logp_gap=False, more_prompts=lambda r: rounds[r])
    return cfg, engine, batch
