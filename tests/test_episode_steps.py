"""Sampler steps of episodes (grpo/sampler/batches.py with env.name): the batch they send, a restart that
makes the same batch, the real processes, evaluation, and an environment that never works stopping the run."""


import json

import pytest
import torch
from conftest import REPO
from episode_helpers import ENVS, episode_step, prompts_of, sampling_cfg
from transformers import AutoTokenizer

from grpo.config import load_config
from grpo.data.problems import Problem
from grpo.environments import Reply
from grpo.environments.pool import EnvironmentPool
from grpo.objective import Objective
from grpo.sampler.episode_records import episode_metrics
from grpo.sampler.episodes import EpisodeRunner
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.trainer.training_step import denominators_of

# ----------------------------------------------------------------------------- a sampler step of episodes

def test_a_sampler_step_of_episodes_sends_the_model_mask_and_counts_only_the_models_tokens(chatty):
    from helpers import assert_batches_equal

    from grpo.trainer.groups import select_groups
    from grpo.wire.codec import decode_batch, encode_batch

    # the cut episodes stay in the loss (scored 0): most of the tiny model's episodes run out of tokens
    cfg, batch = episode_step(chatty, 0, "sampling.dynamic_sampling=true", "env.truncated_reward=0")
    masks = batch.model_mask
    assert [len(m) for m in masks] == [len(c) for c in batch.completion_ids]
    counted = denominators_of(batch, Objective.of(cfg)).tokens
    assert counted == sum(int(m.sum()) for m in masks) < sum(len(c) for c in batch.completion_ids)
    metrics = batch.meta["metrics"]
    assert metrics["sampler/engine_logp_gap_max"] < 1e-5  # recorded vs recomputed, over the model's tokens
    done = [j for j, c in enumerate(batch.completion_ids) if not batch.truncated[j]]
    assert all(batch.rewards[j, 0] == 3.0 for j in done)  # env_reward: the scripted environment's count
    assert metrics["env/turns/mean"] > 1 and metrics["env/tool_calls/mean"] > 0
    assert 0 < metrics["env/model_token_fraction"] < 1
    shown = batch.meta["completions"]  # logging.completions_per_step: the first group, each whole conversation
    assert len(shown) == 4 and {r["sample_id"] for r in shown} == {batch.meta["sample_ids"][0]}
    replied = [j for j in range(4) if len(batch.model_mask[j]) > int(batch.model_mask[j].sum())]
    _, tokenizer = chatty
    assert replied
    for j in replied:  # the environment's first turn is in the text: the tokens the model did not draw, decoded
        ids, drawn = batch.completion_ids[j].tolist(), batch.model_mask[j].tolist()
        start = drawn.index(False)
        end = drawn.index(True, start) if True in drawn[start:] else len(drawn)
        assert tokenizer.decode(ids[start:end], skip_special_tokens=False) in shown[j]["completion"]
    assert [r["rewards"]["env_reward"] for r in shown] == batch.rewards[:4, 0].tolist()
    assert [r["advantage"] for r in shown] == batch.advantages[:4].tolist()
    decoded = decode_batch(encode_batch(batch))
    assert_batches_equal(batch, decoded)
    assert all(torch.equal(a, b) for a, b in zip(batch.model_mask, decoded.model_mask))
    part = select_groups(batch, [1])
    assert all(torch.equal(a, b) for a, b in zip(part.model_mask, batch.model_mask[batch.group_slices()[1]]))


def test_a_step_of_episodes_spanning_an_in_flight_load_sends_each_tokens_version(chatty, tmp_path):
    """A version loaded mid-step (sampling.in_flight_updates, the HF engine): the batch's token_versions hold each
    model token's version (the environment's tokens none), its policy_version is the oldest, it goes over the
    wire as it is, and the engine's log-probs are checked against the recompute over the newest version's tokens."""
    import copy

    from helpers import assert_batches_equal, new_version_loader

    from grpo.wire.codec import decode_batch, encode_batch

    model, tokenizer = chatty
    model = copy.deepcopy(model)  # the module's model stays as it is: the load below changes this one
    _, _, polling = new_version_loader(tmp_path, model, at_poll=10)
    _, batch = episode_step((model, tokenizer), 0, "sampling.in_flight_updates=true", engine_of=polling)
    versions = batch.token_versions
    assert all(torch.equal(v < 0, ~m) for v, m in zip(versions, batch.model_mask, strict=True))
    assert {int(x) for v in versions for x in v[v >= 0]} == {0, 1} and batch.policy_version == 0
    assert batch.meta["metrics"]["sampler/in_flight_loads"] == 1.0
    assert batch.meta["metrics"]["sampler/engine_logp_gap_max"] < 1e-5  # v1's tokens against the recompute with v1
    decoded = decode_batch(encode_batch(batch))
    assert_batches_equal(batch, decoded)
    assert all(torch.equal(a, b) for a, b in zip(batch.token_versions, decoded.token_versions))


def test_a_step_made_again_after_a_restart_is_the_same_batch(chatty):
    """A sampler killed mid-episode makes its step again on restart (the cursor is saved after the
    send): a fresh pool and runner give the same episodes, so nothing is lost or changed. On-policy, bit
    for bit: the environment calls of a decode step are all in before the next (off-policy they overlap
    the decoding, and the rows sharing a forward follow their timing)."""
    _, first = episode_step(chatty, 7, "sampling.max_staleness=0")
    _, again = episode_step(chatty, 7, "sampling.max_staleness=0")
    for name in ("completion_ids", "model_mask", "old_logps"):
        assert all(torch.equal(a, b) for a, b in zip(getattr(first, name), getattr(again, name))), name
    assert torch.equal(first.rewards, again.rewards)

# ----------------------------------------------------------------------------- the real processes

def test_a_sampler_killed_mid_episode_restarts_and_loses_nothing(tmp_path, chatty_model_dir, tiny_gsm8k):
    """kill -9 the sampler while an environment step of an episode is under way (after two trained
    steps): the restarted sampler makes that step again, and every step is trained once."""
    import signal

    from helpers import free_tcp_address
    from test_faults import (
        COMMON,
        finish_with_each_step_trained_and_generated_once,
        kill_both,
        rows,
        start_trainer,
        wait_for,
    )
    from test_sampling_worker import start_sampler

    pause = tmp_path / "pause"
    episodes = [f"env.name={ENVS}:PausesOnce", f"env.args={{pause_file: {pause}}}", "env.timeout_s=600",
                "sampling.max_new_tokens=24"]
    address = free_tcp_address()
    trainer = start_trainer(tmp_path, chatty_model_dir, tiny_gsm8k, address, *episodes)
    sampler = start_sampler(tmp_path, chatty_model_dir, tiny_gsm8k, address, *COMMON, *episodes)
    try:
        wait_for(lambda: len(rows(tmp_path)) >= 2, "two trained steps")
        pause.touch()  # the next second message of an episode waits in the environment
        wait_for(lambda: (tmp_path / "pause.hit").exists(), "an episode's second environment step")
        sampler.send_signal(signal.SIGKILL)
        sampler.wait()
        pause.unlink()
        sampler = start_sampler(tmp_path, chatty_model_dir, tiny_gsm8k, address, *COMMON, *episodes)
    except BaseException:
        kill_both(trainer, sampler)
        raise
    finish_with_each_step_trained_and_generated_once(tmp_path, trainer, sampler)
    trained = rows(tmp_path)
    assert max(r["env/turns/mean"] for r in trained) > 1 and all(r["env/env_errors"] == 0 for r in trained)
    # each trained step's first completions, once, each an episode's whole conversation: the environment's turns
    shown = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [r["step"] for r in shown] == [r["step"] for r in trained for _ in range(4)]
    assert any("reply 1 to " in r["completion"] for r in shown)


def test_evaluation_runs_greedy_episodes_and_judges_their_last_message(chatty):
    from grpo.sampler.evaluation import TrainingEvaluator

    model, tokenizer = chatty
    eval_cfg = load_config(None, ["eval.every=1", "eval.batch_size=2"]).eval
    pool = EnvironmentPool(f"{ENVS}:Scripted", {"length": 2}, 10.0)
    try:
        runner = EpisodeRunner(pool, tokenizer, 40, 4)
        evaluator = TrainingEvaluator(eval_cfg, prompts_of(tokenizer), tokenizer, "", episodes=runner,
                                      checks=("env_reward", "env_reward"))
        result = evaluator.run(HFEngine(model, tokenizer, sampling_cfg(40)), 0)
        again = runner.run(HFEngine(model, tokenizer, sampling_cfg(40)), prompts_of(tokenizer), 1, greedy=True)
    finally:
        pool.close()
    samples = evaluator.last_samples
    assert [s["turns"] for s in samples] == [e.turns for e in again.episodes]  # greedy: the same episodes
    assert [s["completion"] for s in samples] == again.texts
    # env_reward 2.0 (>= 1) when the episode ended at its second message, None (not met) when cut short
    assert [s["correct"] for s in samples] == [not e.truncated for e in again.episodes]
    assert result["eval/mean_turns"] == sum(e.turns for e in again.episodes) / 2


def test_the_environment_written_from_scratch_in_the_docs_runs_as_written(tmp_path, chatty):
    import re

    text = (REPO / "docs" / "environments.md").read_text()
    code = re.search(r"### Written from scratch.*?```python\n(.*?)```", text, re.DOTALL).group(1)
    (tmp_path / "guess_number.py").write_text(code)
    cfg = load_config(None, [f"env.name={tmp_path}/guess_number.py:GuessNumber", "env.args={tries: 3}",
                             "rewards.names=[env_reward]", "rewards.weights=[1.0]"])
    pool = EnvironmentPool(cfg.env.name, cfg.env.args, cfg.env.timeout_s)
    try:
        row = {"reference_answer": "42"}
        assert pool.step("a", row, [], "I guess 40")[0] == Reply(text="higher", tool_calls=1)
        assert pool.step("a", row, ["I guess 40"], "hmm")[0] == Reply(text="Say a number.", tool_calls=1, tool_errors=1)
        assert pool.step("a", row, ["I guess 40", "hmm"], "50")[0] == Reply(done=True, reward=0.0)
        assert pool.step("b", row, [], "it is 42")[0] == Reply(done=True, reward=1.0)
    finally:
        pool.close()

# ----------------------------------------------------------------------------- what never works stops the run

BOARD_ENV = '''\
"""An environment that needs a column the data does not have (with only_one: on the problems whose answer is "1")."""
from grpo.environments import Reply


class Board:
    def __init__(self, row, only_one: bool = False):
        if not only_one or row.get("reference_answer") == "1":
            self.board = row["board"]

    def step(self, message):
        return Reply(done=True)
'''


def board_steps(chatty, tmp_path, count, *overrides):
    """`count` sampler steps of 2 prompts x 4 episodes of the Board environment, counted in one FailureStreaks."""
    from grpo.sampler.batches import SamplerModels, make_batch
    from grpo.sampler.failures import FailureStreaks

    model, tokenizer = chatty
    (tmp_path / "board.py").write_text(BOARD_ENV)
    cfg = load_config(None, ["sampling.group_size=4", "sampling.max_new_tokens=12", "training.beta=0",
                             "lora.enabled=false", "training.reference_on=sampler",
                             f"env.name={tmp_path}/board.py:Board", "rewards.names=[env_reward]",
                             "rewards.weights=[1.0]", "rewards.accuracy_reward=env_reward",
                             "rewards.format_reward=env_reward", "data.prefill=", *overrides])
    pool = EnvironmentPool(cfg.env.name, cfg.env.args, cfg.env.timeout_s)
    try:
        runner = EpisodeRunner(pool, tokenizer, cfg.sampling.max_new_tokens, cfg.env.max_turns)
        policy = SamplerModels.of(cfg, HFEngine(model, tokenizer, cfg.sampling), model, None, tokenizer, {},
                                  episodes=runner)
        streaks = FailureStreaks()
        return [make_batch(cfg, policy, prompts_of(tokenizer), step=k, metrics_so_far={}, measure_logp_gap=False,
                           streaks=streaks) for k in range(count)]
    finally:
        pool.close()


def test_an_environment_that_fails_on_every_episode_stops_the_sampler_with_its_error(chatty, tmp_path):
    from grpo.sampler.failures import EnvironmentAlwaysFails

    with pytest.raises(EnvironmentAlwaysFails) as stopped:
        board_steps(chatty, tmp_path, 2, "env.max_failed_steps=2")
    env = f"{tmp_path}/board.py"
    assert str(stopped.value) == (
        f"environment {env}:Board failed on all 8 episodes in each of the last 2 steps: KeyError: 'board' "
        f"({env}:8, in __init__); stopped. Fix the environment, or set env.max_failed_steps=0 to train on with its "
        "errors shown to the model")
    assert len(board_steps(chatty, tmp_path, 2, "env.max_failed_steps=0")) == 2  # 0: the model reads the errors


def test_an_environment_that_fails_on_some_episodes_only_goes_on(chatty, tmp_path):
    """Prompt 0's 4 episodes cannot open, prompt 1's can: those are the episodes' errors, not a stop."""
    batch, = board_steps(chatty, tmp_path, 1, "env.max_failed_steps=1", "env.args={only_one: true}")
    assert batch.step == 0
    model, tokenizer = chatty
    pool = EnvironmentPool(f"{tmp_path}/board.py:Board", {"only_one": True}, 5.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 12, 4).run(HFEngine(model, tokenizer, sampling_cfg(12)),
                                                        prompts_of(tokenizer), 4, seed=3)
    finally:
        pool.close()
    assert [e.environment_failed for e in run.episodes] == [True] * 4 + [False] * 4
    assert ([e.env_error for e in run.episodes]
            == [f"KeyError: 'board' ({tmp_path}/board.py:8, in __init__)"] * 4 + [""] * 4)


def test_the_well_formed_rate_counts_the_model_messages_that_made_a_tool_call(tiny_model_dir):
    """Worked episodes: 2 call messages, both well-formed; 2, of which the first is unreadable; 1 holding a good
    and an unreadable call (not well-formed); none (an answer at once): 3 of 5. Per episode (any call that
    could be read) it is 3 of 4."""
    from test_tools import CALCULATE, CALL, ScriptedModel

    from grpo.data.prompts import build_prompts
    from grpo.environments import environment_args, prompt_options
    from grpo.model.loading import read_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = read_chat_template("chatml-tools")
    cfg = load_config(None, [f"env.tools=[{CALCULATE}]", "data.few_shot=0"])
    problem = Problem("train-0", "Natalia sold 48 clips in April and half as many in May. How many in all?", "72")
    prompts, _ = build_prompts(tokenizer, cfg.data, [problem], **prompt_options(cfg.env))
    scripts = [["ep0 half\n" + CALL.format("48 / 2"), "ep0 sum\n" + CALL.format("48 + 24"), "<answer>72</answer>"],
               ["ep1 <tool_call>{oops}</tool_call>", "ep1 again\n" + CALL.format("48 / 2"), "<answer>24</answer>"],
               ["ep2 " + CALL.format("48 / 0") + " and <tool_call>{oops}</tool_call>", "<answer>0</answer>"],
               ["ep3 <answer>72</answer>"]]
    pool = EnvironmentPool(cfg.env.name, environment_args(cfg.env), 5.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 400, 4, prefill="<think>\n", roles=("tool",)).run(
            ScriptedModel(tokenizer, scripts), prompts, 4)
    finally:
        pool.close()
    assert [(e.call_messages, e.well_formed_messages) for e in run.episodes] == [(2, 2), (2, 1), (1, 0), (0, 0)]
    metrics = episode_metrics(run.episodes)
    assert (metrics["env/tool_messages/well_formed_rate"], metrics["env/well_formed_call_rate"]) == (3 / 5, 3 / 4)
    assert "env/tool_messages/well_formed_rate" not in episode_metrics(run.episodes[3:])  # no message made a call
