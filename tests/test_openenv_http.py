"""OpenEnv environments as services (grpo/environments/remote.py): a real OpenEnv server (OpenEnv's own
create_app under uvicorn: tests/openenv_server.py, serving tests/openenv_envs.py's SlowGuessNumber) in a
subprocess on loopback, and its sessions through the pool the sampler uses."""

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, checked_config, wait_until_healthy
from episode_helpers import prompts_of

from grpo.config import load_config
from grpo.environments import Reply, remote
from grpo.environments.openenv_adapter import row_seed
from grpo.environments.pool import EnvironmentPool
from grpo.environments.remote import RemotePool
from grpo.run.ports import free_local_port
from grpo.sampler.episodes import episode_runner
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.settings.tree import ConfigError

SERVE = ["uvicorn", "--app-dir", "tests", "openenv_server:app", "--host", "127.0.0.1", "--port"]  # docs/environments.md
IN_PROCESS = f"openenv:{REPO}/tests/openenv_envs.py:SlowGuessNumber"  # the class the server serves
START_S = 90.0  # a server's start at most (it imports OpenEnv's web stack: seconds on a loaded machine)


class Server:
    """The OpenEnv server in a subprocess, on one loopback port for its life (restarts included)."""

    def __init__(self, folder, app: str = "openenv_server:app"):
        self.port, self.waiting, self.log = free_local_port(), folder / "waiting", folder / "server.log"
        self.name = f"openenv+http://127.0.0.1:{self.port}"
        self.process, self.serve = None, [*SERVE[:3], app, *SERVE[4:]]

    def start(self) -> None:
        env = {**os.environ, "OPENENV_TEST_WAITING": str(self.waiting)}
        with open(self.log, "ab") as log:
            command = [sys.executable, "-m", *self.serve, str(self.port), "--log-level", "warning"]
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=log)
        wait_until_healthy(self.process, f"http://127.0.0.1:{self.port}/health", START_S, 0.1, self.log.read_text)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def ensure_running(self) -> None:
        if self.process is None or self.process.poll() is not None:
            self.start()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("openenv-server"))
    server.start()
    yield server
    if server.process.poll() is None:
        server.process.terminate()
        server.process.wait(timeout=10)


@pytest.fixture
def running(server):
    server.ensure_running()  # a test that killed it and failed before the restart leaves none
    server.waiting.unlink(missing_ok=True)
    return server


def target_of(row: dict) -> int:
    return random.Random(row_seed(row)).randint(0, 9)  # SlowGuessNumber's reset(seed) draws it so


# ----------------------------------------------------------------------------- the same episodes as in-process

def test_served_episodes_open_reply_and_reward_as_the_in_process_adapter_on_the_same_class(running):
    rows = [{"question": f"q{i}", "reference_answer": str(i)} for i in range(4)]
    served, local = RemotePool(running.name, {}, 10.0), EnvironmentPool(IN_PROCESS, {}, 10.0)
    try:
        transcripts = []
        for pool in (served, local):
            transcript = []
            for i, row in enumerate(rows):
                target = target_of(row)
                script = ["no idea", str((target + 1 + i) % 10), f"it is {target}"] if i % 2 else ["1 2", "x", "y"]
                for g in range(2):  # two episodes of one prompt open alike and play alike
                    key = f"{i}/{g}"
                    transcript.append(pool.open(key, row))
                    for n, message in enumerate(script):
                        transcript.append(pool.step(key, row, script[:n], message))
                    pool.forget([key])
            transcripts.append(transcript)
    finally:
        served.close()
        local.close()
    assert transcripts[0] == transcripts[1]
    assert transcripts[0][0] == ("guess a number from 0 to 9", None)
    replies = [reply for reply, failure in transcripts[0] if isinstance(reply, Reply)]
    assert Reply(text="right", done=True, reward=1.0) in replies  # rows 1 and 3
    assert Reply(text="say a number", done=True, reward=0.0) in replies  # rows 0 and 2: out of tries
    assert served.rebuilds == 0 and all(failure is None for _, failure in transcripts[0])


def test_the_docs_start_the_server_the_tests_start():
    text = (REPO / "docs" / "environments.md").read_text()
    assert " ".join(SERVE) + " 8000" in text and "env.name=openenv+http://127.0.0.1:8000" in text


# ----------------------------------------------------------------------------- time limits and failures

def test_a_step_past_the_timeout_is_an_error_for_that_episode_only(running):
    row = {"question": "q"}
    pool = RemotePool(running.name, {}, timeout_s=1.0)
    try:
        assert pool.open("a", row)[1] is None and pool.open("b", row)[1] is None
        start = time.monotonic()
        reply, failure = pool.step("a", row, [], "wait 3")
        assert time.monotonic() - start < 2.5
        assert failure == f"no reply from http://127.0.0.1:{running.port} within env.timeout_s=1 s"
        assert reply == Reply(text=f"error: the environment failed: {failure}")
        assert pool.step("b", row, [], "no idea") == (Reply(text="say a number", reward=0.0), None)  # b goes on
        assert pool.rebuilds == 0
        # a: rebuilt on a new session (the failed message is not replayed), while its old one still sleeps
        assert pool.step("a", row, [], "no idea") == (Reply(text="say a number", reward=0.0), None)
        assert pool.rebuilds == 1
    finally:
        pool.close()


def test_a_server_killed_mid_step_costs_an_error_then_fails_fast_and_a_restart_recovers_by_replay(running):
    """a: stepping when the server dies; b: steps while it is down; c: opens while it is down; d: idle
    throughout, its session lost between calls and rebuilt after the restart at no cost."""
    row = {"question": "q"}
    pool = RemotePool(running.name, {}, timeout_s=10.0)
    try:
        for key in "abd":
            assert pool.open(key, row)[1] is None and pool.step(key, row, [], "no idea")[1] is None
        assert pool.step("b", row, ["no idea"], "no idea")[1] is None
        result = []
        stepping = threading.Thread(target=lambda: result.append(pool.step("a", row, ["no idea"], "wait 60")))
        stepping.start()
        deadline = time.monotonic() + 10
        while not running.waiting.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert running.waiting.exists(), "the step did not reach the server"
        killed = time.monotonic()
        running.kill()
        stepping.join(timeout=5)
        assert not stepping.is_alive() and time.monotonic() - killed < 3  # not env.timeout_s: the connection broke
        reply, failure = result[0]
        assert failure.startswith(f"step at http://127.0.0.1:{running.port}: the connection was lost")
        assert reply.text == f"error: the environment failed: {failure}" and not reply.done

        start = time.monotonic()
        reply, failure = pool.step("b", row, ["no idea"] * 2, "no idea")  # its session is gone too: refused
        assert failure.startswith(f"connecting to http://127.0.0.1:{running.port}: ")
        assert reply.text.startswith("error: the environment failed: ")
        opening, failure = pool.open("c", row)  # the server is down: not tried again for RETRY_AFTER_S
        assert opening is None and failure.endswith(" s)") and "(not tried again for" in failure
        assert time.monotonic() - start < 1.0
        down = time.monotonic()

        running.start()  # the same port
        time.sleep(max(0.0, down + remote.RETRY_AFTER_S - time.monotonic()))
        assert pool.step("a", row, ["no idea"], "no idea") == (Reply(text="say a number", reward=0.0), None)
        # b replays its two earlier messages on a new session (not the failed one): its third is its last try
        assert pool.step("b", row, ["no idea"] * 2, "no idea") == (
            Reply(text="say a number", done=True, reward=0.0), None)
        assert pool.open("c", row) == ("guess a number from 0 to 9", None)
        assert pool._episodes["d"].lost  # the old server's connection, closed since d's last call
        assert pool.step("d", row, ["no idea"], "no idea") == (Reply(text="say a number", reward=0.0), None)
        assert pool.rebuilds == 3  # a, b, d (c opened anew)
    finally:
        pool.close()


# ----------------------------------------------------------------------------- at start

def test_a_url_with_nothing_listening_at_start_is_an_error_naming_it():
    port = free_local_port()
    start = time.monotonic()
    with pytest.raises(ConfigError, match=f"env.name: no OpenEnv server answers at http://127.0.0.1:{port} "):
        RemotePool(f"openenv+http://127.0.0.1:{port}", {}, timeout_s=5.0)
    assert time.monotonic() - start < 5.0


@pytest.mark.parametrize("name", ["openenv+http://", "openenv+ftp://127.0.0.1:8000", "openenv+http://host:port",
                                  "openenv+http://127.0.0.1:99999", "openenv+127.0.0.1:8000"])
def test_a_malformed_server_address_is_a_config_error_saying_the_form(name):
    with pytest.raises(ConfigError, match="is not a server address.*write openenv\\+http://host:port"):
        checked_config(None, [f"env.name={name}"])


def test_the_served_forms_settings_are_checked_against_the_servers_schema(running):
    with pytest.raises(ConfigError, match="env.args: init unknown for an OpenEnv server"):
        checked_config(None, [f"env.name={running.name}", "env.args={init: {tries: 2}}"])
    with pytest.raises(ConfigError, match="the action of .* has no field 'text' \\(its fields: metadata, guess\\)"):
        RemotePool(running.name, {"action_field": "text"}, 10.0)
    assert RemotePool(running.name, {}, 10.0).server.action_field == "guess"  # its one required str field


# ----------------------------------------------------------------------------- episodes, token by token

def test_episodes_on_a_served_environment_are_the_in_process_ones_token_for_token(running, chatty):
    """episode_runner picks the pool from env.name: the served run and the in-process run of the same
    class give the same tokens, mask, log-probs and rewards (the in-process mask is checked token by
    token in tests/test_episodes.py); each environment span is a reply between newlines, then the prefill.
    On-policy, so that the rows sharing each forward, and so the log-probs' last bits, do not follow the
    two environments' timing."""
    model, tokenizer = chatty
    runs = []
    for name in (running.name, IN_PROCESS):
        cfg = load_config(None, [f"env.name={name}", "sampling.max_new_tokens=48", "sampling.temperature=1.0",
                                 "sampling.max_staleness=0"])
        runner = episode_runner(cfg, tokenizer)
        try:
            runs.append(runner.run(HFEngine(model, tokenizer, cfg.sampling), prompts_of(tokenizer), 4, seed=1))
        finally:
            runner.pool.close()
        assert isinstance(runner.pool.first, RemotePool) == (name == running.name)
    served, local = runs
    for name in ("completion_ids", "model_masks", "logps"):
        pairs = zip(getattr(served.rollouts, name), getattr(local.rollouts, name))
        assert all(a.tolist() == b.tolist() for a, b in pairs), name
    assert served.rows == local.rows and [p.token_ids for p in served.prompts] == [p.token_ids for p in local.prompts]
    assert all(e.env_errors == 0 for e in served.episodes) and any(e.turns > 1 for e in served.episodes)
    prefill = tokenizer(load_config(None, []).data.prefill)["input_ids"]
    replies = [tokenizer(f"\n{text}\n")["input_ids"] + prefill for text in ("higher", "lower", "say a number")]
    for e in served.episodes:
        spans, span = [], []
        for token, by_model in zip(e.tokens, e.model):
            if by_model and span:
                spans, span = spans + [span], []
            elif not by_model:
                span.append(token)
        assert all(s in replies for s in spans) and len(spans) == e.turns - 1
        assert not span or e.truncated  # an environment span at the end: cut at the token budget


def test_a_server_that_hangs_costs_a_turn_two_time_limits_not_one_per_episode(running):
    """Two calls in a row past env.timeout_s: the server is not called for RETRY_AFTER_S, so the
    turn's other episodes fail at once; a server that answers again is used again after it."""
    from grpo.environments.remote import RETRY_AFTER_S

    row = {"question": "q"}
    pool = RemotePool(running.name, {}, timeout_s=1.0)
    try:
        for key in "abcd":
            assert pool.open(key, row)[1] is None
        start = time.monotonic()
        failures = [pool.step(key, row, [], "wait 3")[1] for key in "abcd"]
        assert time.monotonic() - start < 2 * 1.0 + 1.5  # two time limits, then at once (four would be 4 s)
        assert failures[0] == failures[1] == f"no reply from http://127.0.0.1:{running.port} within env.timeout_s=1 s"
        assert all(f.endswith("s)") and "not tried again for" in f for f in failures[2:])
        time.sleep(RETRY_AFTER_S + 5)  # the sleeping steps end; the server answers again
        assert pool.step("c", row, [], "no idea") == (Reply(text="say a number", reward=0.0), None)
    finally:
        pool.close()


# ----------------------------------------------------------------------------- rebuilt sessions are checked

@pytest.fixture(scope="module")
def secret_server(tmp_path_factory):
    """tests/openenv_secret_server.py: an environment whose reset ignores its seed."""
    server = Server(tmp_path_factory.mktemp("openenv-secret-server"), app="openenv_secret_server:app")
    server.start()
    yield server
    if server.process.poll() is None:
        server.process.terminate()
        server.process.wait(timeout=10)


class RestartsTheServer:
    """test_tools.ScriptedModel's messages; before turn 2 the server is killed and started again on its
    port, so every live episode's session is lost between two calls."""

    version, weights_digest = 0, ""

    def __init__(self, tokenizer, scripts, server):
        from test_tools import ScriptedModel

        self.scripted, self.server, self.turn = ScriptedModel(tokenizer, scripts), server, 0

    def generate(self, contexts, group_size, **kwargs):
        self.turn += 1
        if self.turn == 2:
            self.server.kill()
            self.server.start()
        return self.scripted.generate(contexts, group_size, **kwargs)


NO_GUESS = [["alpha hmm", "alpha well", "alpha so"], ["beta hmm", "beta well", "beta so"]]  # no digit: no guess


def episodes_across_a_restart(server, tiny_model_dir):
    from transformers import AutoTokenizer

    server.ensure_running()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    runner = episode_runner(load_config(None, [f"env.name={server.name}", "env.max_turns=3", "data.prefill=",
                                               "rewards.names=[env_reward]", "rewards.weights=[1.0]"]), tokenizer)
    try:
        return runner.run(RestartsTheServer(tokenizer, NO_GUESS, server), prompts_of(tokenizer, answers=("1",)), 2)
    finally:
        runner.pool.close()


REBUILD_METRICS = ("env/child_restarts", "env/rebuilds", "env/replayed_steps", "env/replay_mismatches",
                   "env/env_errors")


def test_a_session_lost_on_an_unseeded_server_fails_its_episodes_when_the_replay_differs(secret_server, tiny_model_dir):
    """Both sessions are lost between turns 1 and 2; each new session replays the first message and is
    told another secret: both episodes end there, failed, having been shown one secret."""
    from grpo.sampler.episode_records import episode_metrics

    run = episodes_across_a_restart(secret_server, tiny_model_dir)
    mismatch = ("its environment, rebuilt after it was lost, replied to message 1 otherwise than the episode was "
                "shown: the environment is not deterministic given its seed and messages (docs/environments.md)")
    assert [(e.turns, e.replay_mismatch, e.environment_failed, e.env_error) for e in run.episodes] == \
        [(2, True, True, mismatch)] * 2
    assert [e.messages for e in run.episodes] == [["alpha hmm"], ["beta hmm"]]
    metrics = episode_metrics(run.episodes)
    assert {k: metrics[k] for k in REBUILD_METRICS} == {"env/child_restarts": 0.0, "env/rebuilds": 2.0,
                                                         "env/replayed_steps": 2.0, "env/replay_mismatches": 2.0,
                                                         "env/env_errors": 2.0}


def test_a_session_lost_on_a_deterministic_server_replays_exactly_and_goes_on(running, tiny_model_dir):
    """The guessing game resets from the row's seed: the rebuilt sessions replay the first message to the
    same reply, and both episodes play their three tries out (reward 0: no number was said)."""
    from grpo.sampler.episode_records import episode_metrics

    run = episodes_across_a_restart(running, tiny_model_dir)
    assert [(e.turns, e.replay_mismatch, e.env_errors, e.reward) for e in run.episodes] == [(3, False, 0, 0.0)] * 2
    assert [e.messages for e in run.episodes] == NO_GUESS
    metrics = episode_metrics(run.episodes)
    assert {k: metrics[k] for k in REBUILD_METRICS} == {"env/child_restarts": 0.0, "env/rebuilds": 2.0,
                                                         "env/replayed_steps": 2.0, "env/replay_mismatches": 0.0,
                                                         "env/env_errors": 0.0}
