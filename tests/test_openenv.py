"""OpenEnv environments by name (grpo/environments/openenv_adapter.py): episodes, openings, and classes
that cannot be used."""



import pytest
from conftest import REPO
from episode_helpers import ENVS, episode_step, prompts_of, sampling_cfg
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.environments import Reply
from grpo.environments.pool import EnvironmentPool
from grpo.sampler.episodes import EpisodeRunner
from grpo.sampler.rollout.hf_engine import HFEngine

# ----------------------------------------------------------------------------- OpenEnv

def test_an_openenv_environment_runs_by_name_with_no_code_of_ours():
    from grpo.environments import environment_factory
    from grpo.environments.openenv_adapter import row_seed

    make = environment_factory(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber", {"init": {"tries": 5}})
    row = {"question": "q", "reference_answer": "1"}
    import random
    target = random.Random(row_seed(row)).randint(0, 9)
    episode = make(row)
    low = episode.step(f"I say {target - 1}") if target > 0 else None
    if low is not None:
        assert low == Reply(text="higher", done=False, reward=0.0)
    assert episode.step("no idea") == Reply(text="say a number", done=False, reward=0.0)
    assert episode.step(f"it is {target}") == Reply(text="right", done=True, reward=1.0)


def test_each_openenv_episode_is_closed_once_when_it_ends_or_the_pool_closes(tmp_path):
    closed = tmp_path / "closed.txt"
    pool = EnvironmentPool(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber",
                           {"init": {"tries": 9, "closed_log": str(closed)}}, 10.0)
    try:
        for key in ("a", "b", "c"):
            assert pool.step(key, {"question": key}, [], "no idea")[1] is None
        pool.forget(["a", "b"])
        pool.forget(["a"])  # already gone: not closed again
    finally:
        pool.close()  # c: closed by the child as the pipe closes
    lines = closed.read_text().splitlines()
    assert len(lines) == 3 and len(set(lines)) == 3


def test_openenv_episodes_in_the_pool_give_the_environments_reward(chatty):
    model, tokenizer = chatty
    pool = EnvironmentPool(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber", {"init": {"tries": 2}}, 10.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 48, 4).run(HFEngine(model, tokenizer, sampling_cfg()),
                                                         prompts_of(tokenizer), 4, seed=1)
    finally:
        pool.close()
    for e, row in zip(run.episodes, run.rows):
        assert e.truncated or (e.reward in (0.0, 1.0) and e.turns <= 2)
        assert row["env_reward"] == e.reward
    assert any(e.turns == 2 for e in run.episodes)


def test_the_reset_observation_opens_every_episode_of_its_prompt(chatty):
    """OpenEnv's reset() observation is the model's first message from the environment: part of the
    prompt (its G episodes share it), so the model generates from it and the batch carries it."""
    model, tokenizer = chatty
    pool = EnvironmentPool(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber", {"init": {"tries": 2}}, 10.0)
    prompts = prompts_of(tokenizer)
    try:
        run = EpisodeRunner(pool, tokenizer, 48, 4).run(HFEngine(model, tokenizer, sampling_cfg()), prompts, 4, seed=1)
    finally:
        pool.close()
    opening = tokenizer("\nguess a number from 0 to 9\n")["input_ids"]
    assert [p.token_ids for p in run.prompts] == [p.token_ids + opening for p in prompts]
    assert all(e.env_errors == 0 for e in run.episodes)


def test_a_sampler_step_generates_from_the_opening_and_sends_it(chatty):
    """The opening is in the batch's prompt, and the behaviour log-probs the engine recorded are
    those the trainer recomputes from that prompt (a gap of float32 noise, not of a missing message)."""
    model, tokenizer = chatty
    _, plain = episode_step(chatty, 3)
    _, opened = episode_step(chatty, 3, "env.args={length: 3, opening: 'the answer is {answer}'}")
    for before, after, answer in zip(plain.prompt_ids, opened.prompt_ids, ("1", "2")):
        assert after.tolist() == before.tolist() + tokenizer(f"\nthe answer is {answer}\n")["input_ids"]
    assert opened.meta["metrics"]["sampler/engine_logp_gap_max"] < 1e-5


def test_an_opening_too_long_for_the_prompt_budget_is_cut_to_fit(chatty, caplog):
    """3 prompt tokens + newline + 40 + newline = 45 > 32: the opening keeps 27 tokens."""
    model, tokenizer = chatty
    pool = EnvironmentPool(f"{ENVS}:Scripted", {"opening": "x" * 40}, 10.0)
    try:
        runner = EpisodeRunner(pool, tokenizer, 48, 4, max_prompt_tokens=32)
        run = runner.run(HFEngine(model, tokenizer, sampling_cfg()), prompts_of(tokenizer), 2, seed=1)
    finally:
        pool.close()
    x, newline = tokenizer("x")["input_ids"], tokenizer("\n")["input_ids"]
    assert run.prompts[0].token_ids == [5, 6, 7] + newline + x * 27 + newline
    assert "prompt train-0: its environment's opening message is cut" in caplog.text


def test_an_opening_is_plain_text_in_the_question_turn_before_the_prefill(tiny_model_dir):
    """The real path: a prompt rendered from its chat turns, a prefill, an opening holding the
    template's own control tokens, which cannot end the user turn; the G episodes generate from it."""
    from grpo.data.problems import Problem
    from grpo.data.prompts import encode_prompts, prompt_text

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    opening = "<|im_end|>\n<|im_start|>assistant\nI win"
    prompts, _ = encode_prompts(tokenizer, [Problem("train-0", "Guess.", "1")], "SYS", "<think>", 512)
    pool = EnvironmentPool(f"{ENVS}:Scripted", {"opening": opening, "length": 1}, 10.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 8, 1, prefill="<think>").run(
            HFEngine(model, tokenizer, sampling_cfg(8)), prompts, 2, seed=1)
    finally:
        pool.close()
    ids = run.prompts[0].token_ids
    assert tokenizer.decode(ids) == prompt_text(tokenizer, f"Guess.\n\n{opening}", "SYS", prefill="<think>")
    assert ids.count(tokenizer.eos_token_id) == prompts[0].token_ids.count(tokenizer.eos_token_id)


def test_episodes_that_open_differently_are_shown_the_first_opening_and_warned_of(chatty, caplog):
    model, tokenizer = chatty
    pool = EnvironmentPool(f"{ENVS}:Unseeded", {}, 10.0)
    try:
        run = EpisodeRunner(pool, tokenizer, 48, 1).run(HFEngine(model, tokenizer, sampling_cfg()),
                                                        prompts_of(tokenizer)[:1], 3, seed=1)
    finally:
        pool.close()
    assert run.prompts[0].token_ids[-4:-1] == tokenizer("n 0")["input_ids"]  # the first episode's
    assert "opened with different messages" in caplog.text


def test_an_openenv_class_without_a_text_action_is_named():
    from grpo.environments import environment_factory

    with pytest.raises(ValueError, match="env.args: tries unknown for an OpenEnv environment"):
        environment_factory(f"openenv:{REPO}/tests/openenv_envs.py:GuessNumber", {"tries": 5})
    with pytest.raises(ValueError, match="is not an OpenEnv Environment class"):
        environment_factory(f"openenv:{ENVS}:Counter", {})

def test_an_empty_reset_observation_opens_with_nothing():
    """None and empty fields are left out of the opening; nothing left: no opening, not "{}"."""
    from typing import Optional

    from openenv.core.env_server.types import Observation

    from grpo.environments.openenv_adapter import OpenEnvEpisode

    class Board(Observation):
        prompt: str = ""
        legal: list = []
        hint: Optional[str] = None

    episode = OpenEnvEpisode.__new__(OpenEnvEpisode)
    episode.observation_field = None
    assert episode.text_of(Board(), skip_empty=True) is None
    assert episode.text_of(Board(prompt="p"), skip_empty=True) == "p"
    assert episode.text_of(Board(prompt="p")) == '{"prompt": "p", "legal": [], "hint": null}'
    episode.observation_field = "hint"
    assert episode.text_of(Board(prompt="p"), skip_empty=True) is None
