"""A verifiers environment by name (grpo/common/verifiers_bridge.py, verifiers_env.py): its dataset's rows as the
run's data, its rollouts run in .venv-verifiers (verifiers 0.3.1) as agent.command's jailed sessions against the HF
engine with a tiny model, its rubric's reward the sample's. The rollout's turns must be the tokens an in-process
harness sending the same messages gets, and its reward the rubric's on those tokens' text. `make test` builds
.venv-verifiers first (make install-verifiers) and tells these tests it did; without it, run by hand, they skip, but
the last."""

import json
import os
import textwrap
from pathlib import Path

import pytest
from conftest import REPO
from episode_helpers import sampling_cfg
from test_agent_runner import chatty_agent, client  # noqa: F401 (a fixture)

from grpo.common import verifiers_bridge
from grpo.common.verifiers_bridge import VerifiersError, env_rows
from grpo.config import load_config
from grpo.data.problems import DataError, load_problems
from grpo.data.prompts import build_prompts
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.settings.tree import ConfigError

HAVE_VERIFIERS = (REPO / ".venv-verifiers" / "bin" / "python").exists()
if os.environ.get("GRPO_TESTS_NEED_VERIFIERS") and not HAVE_VERIFIERS:  # make test built it: its absence is a fault
    raise RuntimeError("make test runs these tests in .venv-verifiers, and it is not there")
needs_verifiers = pytest.mark.skipif(not HAVE_VERIFIERS, reason="verifiers is not installed (make install-verifiers)")
SUMS = str(REPO / "configs" / "verifiers_sums.py")

# An environment of the test's, against verifiers' API: its rubric's reward is a function of the completion's text
# that the test computes again from the sampled tokens (the digit model rarely writes tags). `turns=2`: a
# MultiTurnEnv that answers the model's first message once with a user message, so the rollout's second request
# carries verifiers' record of the first turn back.
ENV = '''
    import os

    import verifiers as vf
    from datasets import Dataset

    def reward_of(text, answer):  # 100 more where the session's key reached the environment's code
        return len(text) / 100 + (1.0 if answer in text else 0.0) + (100 if "OPENAI_API_KEY" in os.environ else 0)

    class Again(vf.MultiTurnEnv):
        async def env_response(self, messages, state, **kwargs):
            return [{"role": "user", "content": "Once more, the sum?"}]

    def load_environment(turns=1, group=False, talk=False):
        rows = [{"question": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(3, 4), (12, 9)]]
        def scored(completion, answer, **kwargs):
            return sum(reward_of(m["content"] or "", answer) for m in completion if m["role"] == "assistant")
        def relative(completions, **kwargs) -> list:
            return [0.0] * len(completions)
        if talk:
            print("loading the environment")  # on stdout: the rows must not take it for one
        rubric = vf.Rubric(funcs=[scored, relative] if group else [scored])
        kind = vf.SingleTurnEnv if turns == 1 else Again
        extra = {} if turns == 1 else {"max_turns": turns}
        return kind(dataset=Dataset.from_list(rows), system_prompt="Add.", rubric=rubric, **extra)
'''


def reward_of(text: str, answer: str) -> float:
    return len(text) / 100 + (1.0 if answer in text else 0.0)


@pytest.fixture
def environment(tmp_path):
    path = tmp_path / "digit_sums.py"
    path.write_text(textwrap.dedent(ENV))
    return str(path)


def verifiers_run(chatty_agent, env: str, args: dict, group=2, max_new_tokens=24, seed=3, entrypoint=None):
    """A step of `group` sessions on the environment's first train row, run by its rollout (or `entrypoint`)."""
    from grpo.agent.runner import AgentRunner

    model, tokenizer = chatty_agent
    cfg = load_config(None, [f"agent.verifiers={env}", f"data.path=verifiers:{env}", "data.prefill=", "data.few_shot=0",
                             f"data.task_args={json.dumps(args)}", "agent.idle_timeout_s=60",
                             "agent.session_timeout_s=120", "agent.max_turns=2"])
    problems, _ = load_problems(cfg.data.path, "train", task_args=cfg.data.task_args)
    prompts, _ = build_prompts(tokenizer, cfg.data, problems[:1])
    runner = AgentRunner(cfg.agent, tokenizer, max_new_tokens, 256, "policy", entrypoint=entrypoint,
                         verifiers_args=cfg.data.task_args)
    try:
        return runner.run(HFEngine(model, tokenizer, sampling_cfg(max_new_tokens)), prompts, group, seed=seed), prompts
    finally:
        runner.close()


def assistant_texts(tokenizer, episode) -> list[str]:
    """The model's messages of a session, from its sampled tokens (each turn's run of drawn tokens)."""
    runs, current = [], []
    for token, drawn in zip(episode.tokens, episode.model, strict=True):
        if drawn:
            current.append(token)
        elif current:
            runs, current = [*runs, current], []
    runs += [current] if current else []
    return [tokenizer.decode(r, skip_special_tokens=True) for r in runs]


@needs_verifiers
def test_an_environments_rows_are_its_datasets_with_its_prompt_and_answer():
    rows = env_rows(SUMS, {"size": 3, "eval_size": 2, "seed": 4}, "train")
    assert [row["example_id"] for row in rows] == [0, 1, 2]
    for row in rows:
        numbers = [int(n) for n in row["question"].removeprefix("What is ").removesuffix("?").split(" + ")]
        assert row["answer"] == str(sum(numbers)) and row["info"] == {"terms": 2}
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert row["prompt"][1]["content"] == row["question"]
    problems, _ = load_problems(f"verifiers:{SUMS}", "test", task_args={"eval_size": 2, "seed": 4})
    assert [p.answer for p in problems] == [r["answer"] for r in env_rows(SUMS, {"eval_size": 2, "seed": 4}, "eval")]
    assert problems[0].messages[0]["content"].startswith("Add the numbers.")  # the run renders the env's prompt
    with pytest.raises(DataError, match="no_such_setting"):
        load_problems(f"verifiers:{SUMS}", "train", task_args={"no_such_setting": 1})
    with pytest.raises(DataError, match="would not give its train rows"):
        load_problems("verifiers:no-such-environment", "train")


@needs_verifiers
def test_an_environment_that_prints_gives_its_rows_and_one_it_cannot_score_alone_is_refused(environment):
    assert [row["answer"] for row in env_rows(environment, {"talk": True}, "train")] == ["7", "21"]
    with pytest.raises(VerifiersError, match="has group reward functions"):
        env_rows(environment, {"group": True}, "train")
    with pytest.raises(VerifiersError, match="has no eval dataset: set eval.every=0"):
        env_rows(environment, {}, "test")  # verifiers would evaluate on its train rows


@needs_verifiers
def test_a_rollout_is_the_tokens_an_in_process_harness_gets_and_its_reward_the_rubrics(chatty_agent, environment):
    _, tokenizer = chatty_agent
    run, prompts = verifiers_run(chatty_agent, environment, {})

    def native(row, base_url, key):  # what the rollout sends: the row's prompt turns
        client(base_url, key).chat.completions.create(model="policy", messages=row["prompt_turns"])
        return 0.0

    same, _ = verifiers_run(chatty_agent, environment, {}, entrypoint=native)
    assert [p.token_ids for p in run.prompts] == [p.token_ids for p in same.prompts] == [prompts[0].token_ids]
    assert [(e.tokens, e.model, e.logps) for e in run.episodes] == [(e.tokens, e.model, e.logps)
                                                                    for e in same.episodes]
    assert all(not e.environment_failed for e in run.episodes)
    texts = [assistant_texts(tokenizer, e) for e in run.episodes]
    assert len({t[0] for t in texts}) == 2  # two samples, two texts: the rewards below differ
    assert [e.reward for e in run.episodes] == [reward_of(t[0], "7") for t in texts]


@needs_verifiers
def test_an_environment_installed_from_a_folder_of_its_own_runs_by_its_id(chatty_agent, environment):
    """As an editable install leaves it (`pip install -e`): a .pth file in .venv-verifiers naming its source folder.
    The jail must read that folder, or the rollout could not import it."""
    folder = str(Path(environment).parent)
    site = next((REPO / ".venv-verifiers" / "lib").glob("python3*/site-packages"))
    link = site / f"__editable__digit_sums_{Path(folder).name}.pth"
    link.write_text(folder + "\n")
    try:
        assert verifiers_bridge.module_folder("digit-sums") == [folder]
        # found as the jail imports it: not from the working folder (this checkout's `data`), nor by a dotted name
        assert verifiers_bridge.module_folder("data") == verifiers_bridge.module_folder("digit_sums.x") == []
        run, _ = verifiers_run(chatty_agent, "digit-sums", {})
    finally:
        link.unlink()
    assert all(not e.environment_failed and e.reward is not None for e in run.episodes)


@needs_verifiers
def test_a_multi_turn_rollout_continues_its_row_and_its_reward_scores_every_turn(chatty_agent, environment):
    _, tokenizer = chatty_agent
    run, _ = verifiers_run(chatty_agent, environment, {"turns": 2}, max_new_tokens=48)
    for e in run.episodes:
        texts = assistant_texts(tokenizer, e)
        assert not e.environment_failed and e.turns == 2 and len(texts) == 2
        assert e.row_starts == [] and sum(e.continued.values()) == 1  # verifiers sent our turn back as we gave it
        assert e.reward == pytest.approx(sum(reward_of(t, "7") for t in texts), abs=1e-12)


@needs_verifiers
def test_the_config_names_the_mistakes(tmp_path):
    def refused(*overrides) -> str:
        with pytest.raises(ConfigError) as refusal:
            load_config(None, ["data.prefill=", "data.few_shot=0", *overrides])
        return str(refusal.value)

    assert "set data.path=verifiers:my-env" in refused("agent.verifiers=my-env")
    assert "agent.command and agent.verifiers are both set" in refused(
        "agent.verifiers=my-env", "data.path=verifiers:my-env", "agent.command=python x.py")
    assert "is not a file" in refused("agent.verifiers=nowhere.py", "data.path=verifiers:nowhere.py")
    assert "data.task_args are the settings of" in refused("data.task_args={terms: 3}")
    assert "set data.few_shot=0" in refused(f"agent.verifiers={SUMS}", f"data.path=verifiers:{SUMS}",
                                            "data.few_shot=2")
    beside_the_runs = tmp_path / "env.py"  # its folder, which its jail reads, holds the run folder
    beside_the_runs.write_text((REPO / "configs" / "verifiers_sums.py").read_text())
    assert (f"agent.verifiers={beside_the_runs}: its jail reads '{tmp_path}', which holds the run folder"
            in refused(f"agent.verifiers={beside_the_runs}", f"data.path=verifiers:{beside_the_runs}",
                       f"run.dir={tmp_path / 'runs'}"))
    cfg = load_config(None, ["data.prefill=", "data.few_shot=0", f"agent.verifiers={SUMS}",
                             f"data.path=verifiers:{SUMS}", "data.task_args={terms: 3}"])
    assert cfg.agent.harness == SUMS


def test_without_its_environment_a_verifiers_run_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(verifiers_bridge, "VENV", tmp_path / ".venv-verifiers")
    with pytest.raises(VerifiersError, match="make install-verifiers"):
        env_rows(SUMS, {}, "train")
    with pytest.raises(DataError, match="make install-verifiers"):
        load_problems(f"verifiers:{SUMS}", "train")
    with pytest.raises(ConfigError, match="make install-verifiers"):
        load_config(None, ["data.prefill=", "data.few_shot=0", f"agent.verifiers={SUMS}",
                           f"data.path=verifiers:{SUMS}"])
