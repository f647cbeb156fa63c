"""The environments' child-process pool (grpo/environments/pool.py): a step that hangs or raises, a child
that dies, and episodes rebuilt by replaying their messages, checked against what they were shown."""


import re

import pytest
from episode_helpers import ENVS, prompts_of
from transformers import AutoTokenizer

from grpo.environments import Reply
from grpo.environments.pool import EnvironmentPool
from grpo.sampler.batches import environment_failures
from grpo.sampler.episode_records import episode_metrics
from grpo.sampler.episodes import EpisodeRunner


def test_a_new_child_rebuilds_the_other_episodes_by_replaying_their_messages(tmp_path):
    pool = EnvironmentPool(f"{ENVS}:Counter", {}, timeout_s=1.0)
    try:
        assert pool.step("a", {}, [], "x")[0].text == "count 1"
        assert pool.step("b", {}, [], "x")[0].text == "count 1"
        reply, failure = pool.step("b", {}, ["x"], "hang")
        assert failure == "no reply within env.timeout_s=1 s" and reply.text.startswith("error: ")
        assert pool.restarts == 1
        assert pool.step("a", {}, ["x"], "y")[0].text == "count 2"  # rebuilt: one message replayed, then this one
        reply, failure = pool.step("a", {}, ["x", "y"], "raise")
        # the failure names the environment's line that raised (the model reads the error alone)
        assert failure == "RuntimeError: the tool broke (tests/scripted_envs.py:49, in step)" and pool.restarts == 1
        assert reply.text == "error: the environment failed: RuntimeError: the tool broke"
        assert pool.step("a", {}, ["x", "y"], "z")[0].text == "count 3"
    finally:
        pool.close()


def test_a_child_that_died_between_calls_costs_no_episode_its_step():
    pool = EnvironmentPool(f"{ENVS}:Counter", {}, timeout_s=5.0)
    try:
        assert pool.step("a", {}, [], "x")[0].text == "count 1"
        pool._child._process.kill()  # killed from outside (out of memory, say) while no call was under way
        pool._child._process.join()
        assert pool.step("a", {}, ["x"], "y") == (Reply(text="count 2"), None) and pool.restarts == 1
    finally:
        pool.close()


def test_one_hung_episode_fails_alone_while_the_others_are_rebuilt_after_it():
    """Steps of 1 s, a 2.5 s limit: after episode a hangs and the child is replaced, b and c each
    replay two messages and take a third (3 s in all, more than one limit), each call within its own
    limit, and get their replies; only a's message failed."""
    pool = EnvironmentPool(f"{ENVS}:SlowCounter", {"delay": 1.0}, timeout_s=2.5)
    try:
        for key in "abc":
            assert [pool.step(key, {}, [], "x")[0].text,
                    pool.step(key, {}, ["x"], "y")[0].text] == ["count 1", "count 2"]
        reply, failure = pool.step("a", {}, ["x", "y"], "hang")
        assert failure == "no reply within env.timeout_s=2.5 s" and pool.restarts == 1
        for key in "bc":
            assert pool.step(key, {}, ["x", "y"], "z") == (Reply(text="count 3"), None)
        assert pool.step("a", {}, ["x", "y"], "z") == (Reply(text="count 3"), None)  # the hung message is not replayed
        assert pool.restarts == 1
    finally:
        pool.close()

# ----------------------------------------------------------------------------- rebuilt episodes are checked

SECRET_SCRIPTS = [["ep0 hello", "ep0 hang", "ep0 bye"], ["ep1 hello", "ep1 again", "ep1 bye"],
                  ["ep2 hello", "ep2 again", "ep2 bye"], ["ep3 hello", "ep3 again", "ep3 bye"]]


def secret_episodes(tiny_model_dir, seeded: bool):
    """2 prompts x 2 episodes of the Secret environment, 3 scripted messages each (a turn limit of 3);
    at turn 2 episode 0 hangs: the child is replaced, every other episode is rebuilt in the new one."""
    from test_tools import ScriptedModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    pool = EnvironmentPool(f"{ENVS}:Secret", {"seeded": seeded}, timeout_s=1.0)
    try:
        runner = EpisodeRunner(pool, tokenizer, 400, 3)
        run = runner.run(ScriptedModel(tokenizer, SECRET_SCRIPTS), prompts_of(tokenizer), 2)
        assert pool.restarts == 1
    finally:
        pool.close()
    return tokenizer, run


def secrets_shown(tokenizer, episode) -> list[str]:
    return re.findall(r"secret=(\d+)", tokenizer.decode(episode.tokens))


def test_an_unseeded_environment_rebuilt_after_another_episode_hung_fails_its_live_episodes(tiny_model_dir):
    """Turn 2: episode 0 hangs; episodes 1-3, rebuilt in the new child, replay their first message and
    are told another secret: each ends there, failed. Episode 0's own third message is rebuilt too, and
    fails alike. No episode is ever shown a second secret."""
    tokenizer, run = secret_episodes(tiny_model_dir, seeded=False)
    episodes = run.episodes
    mismatch = ("its environment, rebuilt after it was lost, replied to message 1 otherwise than the episode was "
                "shown: the environment is not deterministic given its seed and messages (docs/environments.md)")
    assert [e.replay_mismatch for e in episodes] == [True] * 4
    assert [e.environment_failed for e in episodes] == [True] * 4  # the step's accounting: failed
    assert [e.turns for e in episodes] == [3, 2, 2, 2] and [e.env_errors for e in episodes] == [2, 1, 1, 1]
    assert episodes[0].env_error == "no reply within env.timeout_s=1 s" and episodes[1].env_error == mismatch
    assert [e.messages for e in episodes] == [["ep0 hello"], ["ep1 hello"], ["ep2 hello"], ["ep3 hello"]]
    assert [len(secrets_shown(tokenizer, e)) for e in episodes] == [1, 1, 1, 1]  # the first reply only
    assert all(e.model[-1] for e in episodes)  # each ended on its own message: nothing shown after it
    metrics = episode_metrics(episodes)
    assert {k: metrics[k] for k in ("env/child_restarts", "env/rebuilds", "env/replayed_steps",
                                    "env/replay_mismatches", "env/env_errors")} == {
        "env/child_restarts": 1.0, "env/rebuilds": 4.0, "env/replayed_steps": 4.0, "env/replay_mismatches": 4.0,
        "env/env_errors": 5.0}
    assert [(e.child_restarts, e.rebuilds, e.replayed_steps) for e in episodes] == [(1, 1, 1)] + [(0, 1, 1)] * 3
    # episode 0's own hang cost it its environment: a failure of its own (the batch's worst); the
    # others did nothing wrong: their environment could not be asked, they are left out
    assert environment_failures(episodes) == [("no reply within env.timeout_s=1 s", False)] + [(mismatch, True)] * 3


def test_a_deterministic_environment_rebuilt_after_another_episode_hung_replays_exactly_and_goes_on(tiny_model_dir):
    """The same episodes with the secret drawn from the row: the rebuilt episodes replay their first
    message to the same reply and go on to their turn limit, each shown one secret throughout."""
    tokenizer, run = secret_episodes(tiny_model_dir, seeded=True)
    episodes = run.episodes
    assert [e.replay_mismatch for e in episodes] == [False] * 4 and [e.turns for e in episodes] == [3] * 4
    assert [e.env_errors for e in episodes] == [1, 0, 0, 0] and not any(e.environment_failed for e in episodes)
    assert [e.messages for e in episodes] == [["ep0 hello", "ep0 bye"], *(s for s in SECRET_SCRIPTS[1:])]
    shown = [secrets_shown(tokenizer, e) for e in episodes]
    # episode 0 read an error at turn 2; the reply to each third message is not shown (the turn limit)
    assert [len(s) for s in shown] == [1, 2, 2, 2] and all(len(set(s)) == 1 for s in shown)
    assert "secret=" + shown[1][0] + ", message 2" in tokenizer.decode(episodes[1].tokens)  # went on where it was
    metrics = episode_metrics(episodes)
    assert {k: metrics[k] for k in ("env/child_restarts", "env/rebuilds", "env/replayed_steps",
                                    "env/replay_mismatches", "env/env_errors")} == {
        "env/child_restarts": 1.0, "env/rebuilds": 4.0, "env/replayed_steps": 4.0, "env/replay_mismatches": 0.0,
        "env/env_errors": 1.0}


def test_a_rebuilt_episode_checks_its_opening_and_each_replayed_reply_against_what_it_was_shown():
    """The pool alone: a digest per reply, recorded as the episode goes; a rebuild that opens or replies
    otherwise raises ReplayMismatch and drops the environment; without digests nothing is checked."""
    from grpo.environments.pool import ReplayMismatch, shown_digest

    pool = EnvironmentPool(f"{ENVS}:Counter", {}, timeout_s=1.0)
    try:
        opening = pool.open("a", {})[0]
        first = pool.step("a", {}, [], "x")[0]
        shown = [shown_digest(opening), shown_digest(first)]
        assert first.text == "count 1" and shown[0] == shown_digest(None)
        assert pool.step("b", {}, [], "hang")[1] == "no reply within env.timeout_s=1 s"  # a's environment is lost
        assert pool.step("a", {}, ["x"], "y", shown) == (Reply(text="count 2"), None)  # replayed exactly
        assert (pool.rebuilds, pool.replayed_steps, pool.replay_mismatches) == (2, 1, 0)  # b was made at its step
        pool.forget(["a"])
        with pytest.raises(ReplayMismatch, match="replied to message 1 otherwise than the episode was shown"):
            pool.step("a", {}, ["x"], "y", [shown[0], shown_digest(Reply(text="count 9"))])
        with pytest.raises(ReplayMismatch, match="opened with another message than it first did"):
            pool.step("a", {}, ["x"], "y", [shown_digest("a board"), shown[1]])
        assert (pool.rebuilds, pool.replayed_steps, pool.replay_mismatches) == (4, 2, 2)
        assert pool.step("a", {}, ["x"], "y") == (Reply(text="count 2"), None)  # no digests: not checked
    finally:
        pool.close()
