"""What the episode tests share: a character tokenizer, a tiny model that ends its messages often, and
episodes run on the HF engine against the scripted environments (tests/scripted_envs.py)."""



import torch
from conftest import REPO, tiny_model

from grpo.config import load_config
from grpo.data.problems import Problem
from grpo.data.prompts import Prompt
from grpo.environments.pool import EnvironmentPool
from grpo.sampler.episodes import EpisodeRunner, reply_template
from grpo.sampler.rollout.hf_engine import HFEngine

ENVS = str(REPO / "tests" / "scripted_envs.py")


class CharTokenizer:
    """Characters as token ids 3..100 for the 101-token tiny models; EOS 1, pad 0, no chat template
    (an environment's message is then put between newlines)."""

    pad_token_id, eos_token_id, eos_token, chat_template = 0, 1, None, None

    def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 98 for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(97 + (int(i) - 3) % 26) for i in ids if int(i) >= 3)

    def batch_decode(self, sequences, skip_special_tokens=False):
        return [self.decode(s) for s in sequences]


def chatty_model(kind: str = "llama"):
    """A tiny random model (Llama or Qwen2) whose head favours EOS (a bias of 2.5: ~11% a token), so
    messages end and episodes go on for several turns; float32, logits of order 1."""
    model = tiny_model(kind, vocab_size=101)
    head = torch.nn.Linear(32, 101, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 10)
        head.bias.zero_()
        head.bias[1] = 2.5
    model.lm_head = head
    return model.eval()


def reply_parts(tokenizer, role: str, ended_with: str | None = None, count: int = 1,
                names: list[str] | None = None) -> list[list[int]]:
    """The template's pieces around an environment turn (reply_template), each tokenized alone."""
    return [tokenizer(piece, add_special_tokens=False)["input_ids"]
            for piece in reply_template(tokenizer, role, ended_with, count, names)]


def prompts_of(tokenizer, answers=("1", "2")):
    return [Prompt(Problem(f"train-{i}", f"What is {answer} plus 0?", answer), [5 + i, 6, 7, 8, 9 + i][:3 + 2 * i])
            for i, answer in enumerate(answers)]


def sampling_cfg(max_new_tokens=48):
    return load_config(None, [f"sampling.max_new_tokens={max_new_tokens}", "sampling.temperature=1.0"]).sampling


def run_episodes(chatty, env, max_turns=4, max_new_tokens=48, timeout_s=5.0, seed=3, **args):
    model, tokenizer = chatty
    pool = EnvironmentPool(f"{ENVS}:{env}", args, timeout_s)
    try:
        runner = EpisodeRunner(pool, tokenizer, max_new_tokens, max_turns)
        engine = HFEngine(model, tokenizer, sampling_cfg(max_new_tokens))
        return runner, runner.run(engine, prompts_of(tokenizer), 4, seed=seed)
    finally:
        pool.close()


def episode_step(chatty, step, *overrides, engine_of=lambda engine: engine):
    """One sampler step (make_batch) of episodes with the Scripted environment: the config and the batch.
    `engine_of`: the HF engine as the step uses it (one polling for new weights, say)."""
    from grpo.sampler.batches import SamplerModels, make_batch

    model, tokenizer = chatty
    cfg = load_config(None, ["sampling.group_size=4", "sampling.max_new_tokens=40", "sampling.temperature=1.0",
                             "training.beta=0", "lora.enabled=false", "training.reference_on=sampler",
                             f"env.name={ENVS}:Scripted",
                             "env.args={length: 3}", "rewards.names=[env_reward]", "rewards.weights=[1.0]",
                             "rewards.accuracy_reward=env_reward", "rewards.format_reward=env_reward", "data.prefill=",
                             *overrides])
    pool = EnvironmentPool(cfg.env.name, cfg.env.args, cfg.env.timeout_s)
    try:
        runner = EpisodeRunner(pool, tokenizer, cfg.sampling.max_new_tokens, cfg.env.max_turns)
        policy = SamplerModels.of(cfg, engine_of(HFEngine(model, tokenizer, cfg.sampling)), model, None, tokenizer,
                                  {}, episodes=runner)
        more = lambda r: prompts_of(tokenizer, answers=(str(3 + 2 * r), str(4 + 2 * r)))  # noqa: E731
        return cfg, make_batch(cfg, policy, prompts_of(tokenizer), step=step,
                               metrics_so_far={}, measure_logp_gap=True, more_prompts=more)
    finally:
        pool.close()
