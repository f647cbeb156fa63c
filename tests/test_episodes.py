"""Multi-turn episodes (grpo/sampler/episodes.py): an environment's turns as tokens, episodes on the HF
engine on a tiny model, the token budget, and the trainer's loss on the result."""


import time

import pytest
import torch
from conftest import checked_config
from episode_helpers import ENVS, prompts_of, reply_parts, run_episodes
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.config import load_config
from grpo.environments.pool import EnvironmentPool
from grpo.model.logprobs import completion_logprobs
from grpo.objective import Denominators, Objective, batch_denominators
from grpo.sampler.episodes import EpisodeRunner, turn_seed
from grpo.trainer.training_step import denominators_of, micro_batch_loss
from grpo.wire.batch import RolloutBatch

# ----------------------------------------------------------------------------- the environment's tokens

def test_an_environment_message_is_rendered_between_the_models_eos_and_its_next_turn(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # SmolLM2's, with its chat template
    before, after = reply_parts(tokenizer, "user")  # one message: the pieces before and after it
    assert tokenizer.decode(before) == "\n<|im_start|>user\n"
    assert tokenizer.decode(after) == "<|im_end|>\n<|im_start|>assistant\n"
    runner = EpisodeRunner(None, tokenizer, 64, 4, prefill="<think>")
    ids = runner.reply_tokens("7 <|im_end|>", "tool")  # its text cannot close the turn early
    assert tokenizer.decode(ids) == "\n<|im_start|>tool\n7 <|im_end|><|im_end|>\n<|im_start|>assistant\n<think>"
    assert ids.count(tokenizer.eos_token_id) == 1  # the template's own end of turn only


STRICT_ROLES = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
                "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
                "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_refuses_the_environments_role_stops_the_start(tiny_model_dir):
    """Found at start (the role in env.args), not mid-rollout; a role the environment did not
    declare and the template refuses ends that episode alone."""
    from grpo.config import load_config
    from grpo.sampler.episodes import TemplateRoleError, episode_runner

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = STRICT_ROLES
    cfg = load_config(None, [f"env.name={ENVS}:Scripted", "env.args={role: tool}"])
    with pytest.raises(TemplateRoleError, match="cannot render an environment message in role 'tool'"):
        episode_runner(cfg, tokenizer)
    runner = episode_runner(load_config(None, [f"env.name={ENVS}:Scripted"]), tokenizer)  # user: fine
    runner.pool.close()


def test_a_turn_end_from_the_checkpoints_eos_list_is_rendered_once(tiny_model_dir):
    """Phi-3 style: the template ends the assistant's turn with <|end|>, an EOS of the checkpoint's
    generation_config but not the tokenizer's eos_token. A turn the model ended with <|end|> is
    followed by the reply without a second <|end|>; one it ended with its eos_token keeps the
    template's <|end|>."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>", "<|user|>", "<|assistant|>"]})
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
                               "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    end, eos = tokenizer.convert_tokens_to_ids("<|end|>"), tokenizer.eos_token_id
    assert tokenizer.eos_token != "<|end|>"
    runner = EpisodeRunner(None, tokenizer, 64, 4)
    message = tokenizer("4 + 3 =", add_special_tokens=False)["input_ids"]
    ended = [*message, end, *runner.reply_tokens("7", "user", ended_with=end)]
    assert tokenizer.decode(ended) == "4 + 3 =<|end|>\n<|user|>\n7<|end|>\n<|assistant|>\n"
    stopped = [*message, eos, *runner.reply_tokens("7", "user", ended_with=eos)]
    assert tokenizer.decode(stopped) == f"4 + 3 ={tokenizer.eos_token}<|end|>\n<|user|>\n7<|end|>\n<|assistant|>\n"


def test_each_turn_draws_from_its_own_seed():
    seeds = {turn_seed(5, t) for t in range(50)} | {turn_seed(6, t) for t in range(1, 50)}
    assert len(seeds) == 99 and turn_seed(5, 0) == 5 and turn_seed(None, 3) is None

# ----------------------------------------------------------------------------- episodes on the HF engine

def test_the_model_mask_covers_exactly_the_models_turns_and_their_log_probs_are_the_trainers(chatty):
    runner, run = run_episodes(chatty, "Scripted", length=3)
    model, tokenizer = chatty
    eos = tokenizer.eos_token_id
    multi = 0
    for e, ids, mask, logps in zip(run.episodes, run.rollouts.completion_ids, run.rollouts.model_masks,
                                   run.rollouts.logps):
        # walk the episode: model turn (ends with EOS unless truncated), then the scripted reply's exact tokens
        position, expected = 0, []
        for turn in range(1, e.turns + 1):
            end = position
            while end < len(ids) and ids[end] != eos:
                end += 1
            end = min(end + 1, len(ids))
            expected += [True] * (end - position)
            position = end
            if turn < e.turns or (position < len(ids)):
                reply = runner.reply_tokens(f"reply {turn} to {e.messages[turn - 1][:3]!r}",
                                            "user")[:len(ids) - position]
                assert ids[position:position + len(reply)].tolist() == reply
                expected += [False] * len(reply)
                position += len(reply)
        assert mask.tolist() == expected and position == len(ids)
        assert (logps[~mask] == 0).all()
        multi += e.turns >= 2
        if not e.truncated:
            assert e.turns == 3 and e.reward == 3.0  # done at the third message, rewarded with the count
            assert (e.tool_calls, e.tool_errors) == (2, 1)
    assert multi >= 4, "too few multi-turn episodes to test"
    prompts = [torch.tensor(p.token_ids) for p in prompts_of(tokenizer)]
    with torch.no_grad():
        recomputed = completion_logprobs(model, prompts, run.rollouts.completion_ids, [4, 4])  # shared prefix
    gap = max((a - b)[m].abs().max().item()
              for a, b, m in zip(run.rollouts.logps, recomputed, run.rollouts.model_masks))
    assert gap < 1e-5, gap


def test_episodes_respect_the_token_budget_and_the_turn_limit(chatty):
    _, run = run_episodes(chatty, "Scripted", length=99, max_turns=2, max_new_tokens=30)
    for e, ids in zip(run.episodes, run.rollouts.completion_ids):
        assert len(ids) <= 30 and e.turns <= 2
        assert e.truncated or e.turns == 2  # the scripted environment never ends them itself
    assert any(e.turns == 2 for e in run.episodes)


def test_a_step_that_hangs_or_raises_costs_only_that_step(chatty):
    for on in ("hang", "raise"):
        t = time.monotonic()
        _, run = run_episodes(chatty, "hangs_or_raises", timeout_s=1.0, on=on, turn=2)
        assert time.monotonic() - t < 60
        faulted = [e for e in run.episodes[:4] if e.env_errors]  # prompt 0's answer is "1": its second step fails
        assert faulted and all(e.env_errors == 1 for e in faulted)
        assert not any(e.env_errors for e in run.episodes[4:])
        for e in faulted:  # the failure went back to the model as text; the episode went on
            assert e.turns >= 2 and len(e.messages) == e.turns - 1 - (not e.truncated)

# ----------------------------------------------------------------------------- the loss sees the model's tokens only

def test_the_loss_and_its_counts_see_only_the_models_tokens(chatty):
    """Worked: two episodes [m m e e m] and [m e m]; old log-probs = new - d at model tokens (ratio
    e^d, inside the clip) and wild at environment tokens. GRPO's loss is -mean_j mean_{model t} e^d A_j."""
    model, _ = chatty
    cfg = load_config(None, ["training.beta=0", "sampling.temperature=1.0"])
    prompt = [torch.tensor([5, 6, 7])]
    completions = [torch.tensor([20, 21, 30, 31, 22]), torch.tensor([23, 32, 24])]
    masks = [torch.tensor([1, 1, 0, 0, 1], dtype=torch.bool), torch.tensor([1, 0, 1], dtype=torch.bool)]
    with torch.no_grad():
        new = completion_logprobs(model, prompt, completions, [2])
    d = [torch.tensor([0.1, -0.1, 0.0, 0.0, 0.05]), torch.tensor([0.02, 0.0, -0.15])]
    wild = [torch.tensor([0, 0, 9.0, -9.0, 0]), torch.tensor([0, 9.0, 0])]
    old = [n - x + w for n, x, w in zip(new, d, wild)]
    advantages = torch.tensor([1.0, -0.5])
    counts = batch_denominators(Objective(), completions, torch.tensor([False, False]), masks)
    assert counts == Denominators(sequences=2, tokens=5, completions=2)
    batch = RolloutBatch(step=0, policy_version=0, prompt_ids=prompt, completion_ids=completions, group_sizes=[2],
                         old_logps=old, ref_logps=None, rewards=torch.zeros(2, 1), reward_names=["r"],
                         advantages=advantages, truncated=torch.tensor([False, False]), model_mask=masks)
    loss, metrics, counted = micro_batch_loss(model, batch, cfg)
    e = torch.exp
    expected = -(((e(torch.tensor(0.1)) + e(torch.tensor(-0.1)) + e(torch.tensor(0.05))) / 3 * 1.0
                  + (e(torch.tensor(0.02)) + e(torch.tensor(-0.15))) / 2 * -0.5) / 2)
    assert counted == 5 and abs(loss.item() - expected.item()) < 1e-6
    assert metrics["clip_ratio/region_mean"] == 0.0  # the wild environment log-probs were never looked at
    assert abs(metrics["sampling/sampling_logp_difference/max"] - 0.15) < 1e-5

def test_a_bad_environment_name_is_a_config_error_naming_it():
    from grpo.settings.tree import ConfigError

    with pytest.raises(ConfigError, match="env.name: cannot import 'no_such_module:Env'"):
        checked_config(None, ["env.name=no_such_module:Env"])
    with pytest.raises(ConfigError, match="env.max_turns must be > 0"):
        checked_config(None, ["env.name=calculator", "env.max_turns=0"])

# ----------------------------------------------------------------------------- an episode cut at the token budget

class Budgeted:
    """test_tools.ScriptedModel's messages, each cut at what is left of its episode's token budget
    (then truncated, without its EOS), as an engine cuts them."""

    version, weights_digest = 0, ""

    def __init__(self, tokenizer, scripts, budget: int):
        from test_tools import ScriptedModel

        self.scripted, self.budget = ScriptedModel(tokenizer, scripts), budget

    def generate(self, contexts, group_size, *, seed=None, greedy=False, max_new_tokens=None):
        from grpo.sampler.rollout import Rollouts

        out = self.scripted.generate(contexts, group_size, seed=seed, greedy=greedy, max_new_tokens=max_new_tokens)
        self.asked = list(max_new_tokens) if max_new_tokens is not None else None
        budgets = [b for b in (max_new_tokens or [self.budget] * len(contexts)) for _ in range(group_size)]  # per row
        cut = [ids[:b] for ids, b in zip(out.completion_ids, budgets, strict=True)]
        return Rollouts(completion_ids=cut, truncated=[len(c) < len(ids) for c, ids in zip(cut, out.completion_ids)],
                        logps=[torch.zeros(len(c)) for c in cut])


def test_turn_by_turn_gives_the_first_message_the_whole_episode_budget_whatever_the_engines_default(tiny_model_dir):
    """The runner's budget is the episode's (sampling.max_new_tokens, model and environment tokens
    together): turn 1 asks the engine for all of it, not the engine's own default, so turn by turn and
    the decode loop cut an episode's first message at the same place. Budget 12, engine default 4: a
    script of 23 tokens is cut at 12."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pool = EnvironmentPool(f"{ENVS}:WinOrLose", {}, 5.0)
    try:
        engine = Budgeted(tokenizer, [["e0 " + "on and on " * 5]], budget=4)
        runner = EpisodeRunner(pool, tokenizer, 12, 4, continued=False)
        run = runner.run(engine, prompts_of(tokenizer, answers=("1",)), 1)
    finally:
        pool.close()
    assert engine.asked == [12]
    assert [(e.truncated, e.turns, len(e.tokens)) for e in run.episodes] == [(True, 1, 12)]


# a +-1 game, one prompt's 4 episodes: a win, a loss, a loss after a turn, and one that talks past the budget
GAME_SCRIPTS = [["e0 I win"], ["e1 I lose"], ["e2 first", "e2 I lose"], ["e3 first", "e3 " + "on and on " * 20]]


def game_batch(tiny_model_dir, *overrides):
    """One sampler step of the WinOrLose game (rewarded by env_reward alone, 40 tokens an episode)."""
    from grpo.sampler.batches import SamplerModels, make_batch
    from grpo.sampler.episodes import episode_runner

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = load_config(None, ["sampling.group_size=4", "sampling.prompts_per_step=1", "sampling.max_new_tokens=40",
                             "training.beta=0", "lora.enabled=false", "training.reference_on=sampler",
                             f"env.name={ENVS}:WinOrLose", "rewards.names=[env_reward]", "rewards.weights=[1.0]",
                             "rewards.accuracy_reward=env_reward", "rewards.format_reward=env_reward", "data.prefill=",
                             *overrides])
    runner = episode_runner(cfg, tokenizer)
    try:
        engine = Budgeted(tokenizer, GAME_SCRIPTS, cfg.sampling.max_new_tokens)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        policy = SamplerModels.of(cfg, engine, model, None, tokenizer, {}, episodes=runner)
        batch = make_batch(cfg, policy, prompts_of(tokenizer, answers=("1",)), step=0, metrics_so_far={},
                           measure_logp_gap=False)
    finally:
        runner.pool.close()
    return cfg, batch


def test_an_episode_cut_at_the_budget_scores_the_batchs_worst_by_default(tiny_model_dir):
    """Rewards [1, -1, -1, cut]: the environment never scored the cut episode, so it takes the batch's
    worst graded total, -1, never the free 0 above losing: [1, -1, -1, -1], mean -0.5, unbiased std 1,
    advantages [1.5, -0.5, -0.5, -0.5] / (1 + 1e-4); all 4 in the loss. Running out of tokens is not a
    failure of env_reward's: it counts toward no failure streak."""
    cfg, batch = game_batch(tiny_model_dir)
    assert not cfg.training.mask_truncated_completions
    assert batch.truncated.tolist() == [False, False, False, True]
    assert batch.rewards[:, 0].tolist() == [1.0, -1.0, -1.0, 0.0]  # no value of the environment's
    assert torch.allclose(batch.advantages, torch.tensor([1.5, -0.5, -0.5, -0.5]) / (1 + 1e-4), atol=1e-6)
    m = batch.meta["metrics"]
    assert (m["rewards/env_reward/failures"], m["rewards/worst_fraction"]) == (0.0, 0.25)
    assert denominators_of(batch, Objective.of(cfg)) == Denominators(4, sum(int(m.sum()) for m in batch.model_mask), 4)


def test_an_episode_cut_at_the_budget_scores_the_batchs_worst_whatever_its_earlier_turns_earned(tiny_model_dir):
    """The game pays 0.5 for each message that neither wins nor loses. Episode 3 earns 0.5 at its first
    message and then runs out of tokens: kept, the 0.5 would beat the loser's -1 and e2's 0.5 - 1.
    It scores the batch's worst instead: [1, -1, -0.5, -1], mean -0.375, deviations 1.375, -0.625,
    -0.125, -0.625, unbiased std sqrt(2.6875 / 3) = 0.946485."""
    cfg, batch = game_batch(tiny_model_dir, "env.args={step_reward: 0.5}")
    assert batch.truncated.tolist() == [False, False, False, True]
    assert batch.rewards[:, 0].tolist() == [1.0, -1.0, -0.5, 0.5]  # what the environment gave, on the wire
    std = (2.6875 / 3) ** 0.5
    torch.testing.assert_close(batch.advantages, torch.tensor([1.375, -0.625, -0.125, -0.625]) / (std + 1e-4),
                               rtol=0, atol=1e-6)


def test_an_episode_cut_at_the_budget_scores_env_truncated_reward_when_it_is_set(tiny_model_dir):
    """env.truncated_reward=-1: running out of tokens scores as losing. Rewards [1, -1, -1, -1]: mean
    -0.5, unbiased std 1, advantages [1.5, -0.5, -0.5, -0.5] / (1 + 1e-4); all 4 in the loss."""
    cfg, batch = game_batch(tiny_model_dir, "env.truncated_reward=-1")
    assert not cfg.training.mask_truncated_completions
    assert batch.truncated.tolist() == [False, False, False, True]
    assert batch.rewards[:, 0].tolist() == [1.0, -1.0, -1.0, -1.0]
    assert torch.allclose(batch.advantages, torch.tensor([1.5, -0.5, -0.5, -0.5]) / (1 + 1e-4), atol=1e-6)
    assert denominators_of(batch, Objective.of(cfg)) == Denominators(4, sum(int(m.sum()) for m in batch.model_mask), 4)


def test_a_reply_that_leaves_no_room_to_answer_is_cut_and_scored_alike(tiny_model_dir):
    """An episode whose environment replies past the budget ends there, truncated: its earlier
    rewards give way to env.truncated_reward."""
    from test_tools import ScriptedModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pool = EnvironmentPool(f"{ENVS}:Scripted", {"length": 9}, 5.0)  # no reward before its ninth message
    try:
        scripts = [["a one"], ["b one"]]
        runner = EpisodeRunner(pool, tokenizer, 8, 4, truncated_reward=-1.0)
        run = runner.run(ScriptedModel(tokenizer, scripts), prompts_of(tokenizer, answers=("1",)), 2)
    finally:
        pool.close()
    assert [(e.truncated, e.turns, e.reward, e.model[-1]) for e in run.episodes] == [(True, 1, -1.0, False)] * 2
    assert [row["env_reward"] for row in run.rows] == [-1.0, -1.0] and [len(e.tokens) for e in run.episodes] == [8, 8]


def test_an_environments_reward_that_nothing_trains_on_is_said_once(tiny_model_dir, caplog):
    """env_reward is not among rewards.names: the first reward an environment gives is a warning line;
    env.truncated_reward without env_reward to score is a config error."""
    from test_tools import ScriptedModel

    from grpo.sampler.episodes import episode_runner
    from grpo.settings.tree import ConfigError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = load_config(None, [f"env.name={ENVS}:WinOrLose", "data.prefill="])
    runner = episode_runner(cfg, tokenizer)
    try:
        for _ in range(2):
            runner.run(ScriptedModel(tokenizer, GAME_SCRIPTS[:2]), prompts_of(tokenizer, answers=("1",)), 2)
    finally:
        runner.pool.close()
    said = [r.getMessage() for r in caplog.records if "env_reward" in r.getMessage()]
    assert said == ["the environment gives rewards, and rewards.names does not hold env_reward: they are not trained "
                    "on; add env_reward to rewards.names (and its weight to rewards.weights)"]
    with pytest.raises(ConfigError, match=r"env.truncated_reward=-1 is the env_reward of an episode cut at "
                                          r"sampling.max_new_tokens, and rewards.names \(gsm8k_answer_lenient, "
                                          r"think_answer_format_partial\) does not hold env_reward"):
        load_config(None, [f"env.name={ENVS}:WinOrLose", "env.truncated_reward=-1"])
