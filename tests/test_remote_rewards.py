"""Remote rewards and the LLM judge against real HTTP servers on loopback: the exact request each
sends, the scores each gives, and every way a service fails (slow, 5xx, a wrong answer, nothing
listening) costing that batch's scores (rewards.fallback, counted), never the run or a stall."""

import json
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from conftest import REPO, tiny_model
from data.problems import Problem
from data.prompts import Prompt
from grpo.config import load_config
from grpo.model.loading import add_lora
from grpo.sampler.step import SamplerPolicy, make_batch
from grpo.settings.tree import ConfigError
from rewards import score_completions
from rewards.sandbox import RewardSandbox
from rewards.services import JudgeSettings, ServiceSettings
from test_sampler_step import DigitTokenizer, FakeEngine, config

GOOD = "<think>\n3 + 4 = 7\n</think>\n<answer>\n7\n</answer>"
TURNS = ({"role": "system", "content": "Answer in tags."}, {"role": "user", "content": "What is 3 + 4?"})
FAST = ServiceSettings(timeout_s=2.0, retries=1)


class Service:
    """A real HTTP server in a thread: records every request (path, headers, JSON body) and answers
    each path its own way (`answers[path]`: a function of the request's JSON and its count so far)."""

    def __init__(self, answers: dict):
        self.requests, self.release = [], threading.Event()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen = sum(path == self.path for path, _, _ in service.requests)
                service.requests.append((self.path, dict(self.headers), body))
                status, payload = answers[self.path](body, seen, service)
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up on a slow answer
                    pass

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server.server_port}{path}"

    def bodies(self, path: str) -> list:
        return [body for p, _, body in self.requests if p == path]

    def close(self):
        self.release.set()  # slow handlers stop waiting
        self.server.shutdown()
        self.server.server_close()


def lengths(body, seen, service):
    return 200, [float(len(c)) for c in body["completions"]]


def slow(body, seen, service):
    service.release.wait(30)
    return 200, [0.0] * len(body["completions"])


def fails_once(body, seen, service):
    return (500, {"error": "warming up"}) if seen == 0 else (200, {"rewards": [2.0] * len(body["completions"])})


REMOTE_ANSWERS = {
    "/score": lengths,
    "/slow": slow,
    "/flaky": fails_once,
    "/short": lambda body, seen, service: (200, [1.0]),
    "/html": lambda body, seen, service: (200, b"<html>Bad gateway</html>"),
    "/nulls": lambda body, seen, service: (200, [None if r.get("skip") else 3.0 for r in body["rows"]]),
    "/forbidden": lambda body, seen, service: (403, {"error": "no"}),
}


@pytest.fixture
def service():
    s = Service(REMOTE_ANSWERS)
    yield s
    s.close()


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_remote_reward_gets_prompts_completions_and_rows_in_one_post_and_its_scores_count(service):
    completions, rows = [GOOD, "7", "no"], [{"reference_answer": "7", "id": i} for i in range(3)]
    scores = score_completions(completions, rows, [service.url("/score"), "gsm8k_answer"], [0.5, 1.0], fallback=-9.0,
                               prompts=[TURNS] * 3, services=FAST)
    assert service.bodies("/score") == [{"prompts": [list(TURNS)] * 3, "completions": completions, "rows": rows}]
    assert scores.per_function.tolist() == [[len(GOOD), 1.0], [1.0, -1.0], [2.0, -1.0]]
    assert scores.total.tolist() == [len(GOOD) / 2 + 1.0, -0.5, 0.0]
    assert scores.failures == {service.url("/score"): 0, "gsm8k_answer": 0}


def test_a_null_from_the_service_means_the_reward_does_not_apply(service):
    scores = score_completions(["a", "b"], [{"skip": True}, {}], [service.url("/nulls")], [1.0], fallback=-9.0,
                               prompts=[TURNS] * 2, services=FAST)
    assert scores.applies.tolist() == [[False], [True]] and scores.total.tolist() == [0.0, 3.0]


def test_a_5xx_is_retried_with_backoff_and_the_second_answer_counts(service):
    started = time.monotonic()
    scores = score_completions(["a", "b"], [{}, {}], [service.url("/flaky")], [1.0], fallback=-9.0,
                               prompts=[TURNS] * 2, services=FAST)
    assert scores.per_function[:, 0].tolist() == [2.0, 2.0] and scores.failures == {service.url("/flaky"): 0}
    assert len(service.bodies("/flaky")) == 2 and time.monotonic() - started >= 0.5  # BACKOFF_S before the retry


@pytest.mark.parametrize("path, attempts", [
    ("/slow", 2),  # past the time limit: tried again, then given up
    ("/short", 1),  # one value for three completions: the contract is broken, no retry
    ("/html", 1),  # not JSON
    ("/forbidden", 1),  # a 4xx other than 408/429 will not change
])
def test_a_service_that_fails_costs_its_batch_the_fallback_counted_in_bounded_time(service, path, attempts):
    started = time.monotonic()
    scores = score_completions(["a", "b", "c"], [{"reference_answer": "7"}] * 3,
                               [service.url(path), "think_answer_format_partial"], [1.0, 1.0], fallback=-9.0,
                               prompts=[TURNS] * 3, services=ServiceSettings(timeout_s=0.5, retries=1))
    elapsed = time.monotonic() - started
    assert scores.per_function.tolist() == [[-9.0, -1.0]] * 3  # the rule reward is scored as ever
    assert scores.failures == {service.url(path): 3, "think_answer_format_partial": 0}
    assert len(service.bodies(path)) == attempts
    assert elapsed < 3.0  # slow: 2 x 0.5 s time limit + 0.5 s backoff, not the server's 30 s


def test_nothing_listening_is_retried_then_falls_back():
    url = f"http://127.0.0.1:{closed_port()}/score"
    started = time.monotonic()
    scores = score_completions(["a", "b"], [{}, {}], [url], [1.0], fallback=-9.0, prompts=[TURNS] * 2,
                               services=ServiceSettings(timeout_s=1.0, retries=2))
    assert scores.per_function[:, 0].tolist() == [-9.0, -9.0] and scores.failures == {url: 2}
    assert 1.5 <= time.monotonic() - started < 5  # backoff 0.5 s + 1 s between the three attempts


def test_service_rewards_run_in_the_sampler_not_in_the_sandbox_child(service):
    """The forked child could not score them (it has no prompts or settings): their scores prove the route."""
    sandbox = RewardSandbox(timeout_s=5)
    try:
        scores = score_completions([GOOD, "x"], [{"reference_answer": "7"}] * 2, [service.url("/score"), "gsm8k_answer"],
                                   [1.0, 1.0], fallback=-9.0, call=sandbox, prompts=[TURNS] * 2, services=FAST)
    finally:
        sandbox.close()
    assert scores.per_function.tolist() == [[len(GOOD), 1.0], [1.0, -1.0]]


def test_a_sampler_step_sends_each_samples_prompt_turns_and_logs_the_service_reward(service):
    """make_batch -> score_completions: the prompts' chat turns go with each of the G completions."""
    cfg = config(f"rewards.names=[{service.url('/score')}]")
    questions = [({"role": "user", "content": f"q{i}"},) for i in range(2)]
    prompts = [Prompt(Problem(f"train-{i}", f"q{i}", str(7 + i)), [3, 4, 5 + i], questions[i]) for i in range(2)]
    policy = SamplerPolicy(FakeEngine(), add_lora(tiny_model(), cfg.lora).eval(), None, DigitTokenizer(), {})
    batch = make_batch(cfg, policy, prompts, step=1, metrics_so_far={}, check_recorded=False)
    [body] = service.bodies("/score")
    assert body["prompts"] == [list(questions[0])] * 2 + [list(questions[1])] * 2
    assert body["completions"] == ["7", "8", "7", "8"]  # FakeEngine's tokens 7 + j, decoded
    assert [row["reference_answer"] for row in body["rows"]] == ["7", "7", "8", "8"]
    assert batch.rewards[:, 0].tolist() == [1.0] * 4
    m = batch.meta["metrics"]
    assert (m[f"rewards/{service.url('/score')}/mean"], m[f"rewards/{service.url('/score')}/failures"]) == (1.0, 0.0)


def test_the_example_reward_server_scores_with_gsm8k_answer():
    """scripts/reward_server.py, as CI starts it: a process on a free port."""
    process = subprocess.Popen([sys.executable, str(REPO / "scripts" / "reward_server.py"), "--port", "0"],
                               stderr=subprocess.PIPE, text=True)
    try:
        started = None
        while started is None:  # its start-up line names the port it got
            line = process.stderr.readline()
            assert line, "scripts/reward_server.py ended before it listened"
            started = re.search(r"http://127.0.0.1:\d+/score", line)
        url = started.group(0)
        scores = score_completions([GOOD, "<answer>8</answer>", "7"], [{"reference_answer": "7"}, {"reference_answer": "7"},
                                                                      {"id": 3}],
                                   [url], [1.0], fallback=-9.0, prompts=[TURNS] * 3, services=FAST)
    finally:
        process.kill()
        process.wait()
    assert scores.per_function[:, 0].tolist() == [1.0, -1.0, 0.0] and scores.applies[:, 0].tolist() == [True, True, False]
    assert scores.failures == {url: 0}


# ----------------------------------------------------------------------------- the judge

def chat_completions(body, seen, service):
    """A judge that says Score: 10 when the answer given is 7, refuses to score 'dunno', and is
    down (503) for the first request of a completion that says 'flaky'."""
    text = body["messages"][0]["content"]
    if "flaky" in text and not any("flaky" in b["messages"][0]["content"] for b in service.bodies("/v1/chat/completions")[:-1]):
        return 503, {"error": "busy"}
    verdict = "I cannot judge this." if "dunno" in text else f"Reasoning... Score: 2\nScore: {10 if '<answer>7' in text else 0}"
    return 200, {"id": "x", "object": "chat.completion", "model": body["model"],
                 "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": verdict}}]}


@pytest.fixture
def judge_server():
    s = Service({"/v1/chat/completions": chat_completions})
    yield s
    s.close()


def judge_settings(server, **kw):
    judge = JudgeSettings(url=server.url("/v1"), model="judge-model", prompt="Q: {question}\nRef: {answer}\nA: {completion}\n"
                          "{not a placeholder}", pattern=r"Score:\s*(\d+)", api_key_env="JUDGE_TEST_KEY", max_tokens=16,
                          concurrency=2)
    return ServiceSettings(timeout_s=2.0, retries=1, judge=JudgeSettings(**{**vars(judge), **kw}))


def test_the_judge_fills_its_prompt_reads_the_last_score_and_fails_alone_per_sample(judge_server, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    completions = ["<answer>7</answer>", "<answer>8</answer> {answer}", "dunno", "<answer>7</answer> flaky"]
    scores = score_completions(completions, [{"reference_answer": "7"}] * 4, ["judge"], [0.1], fallback=-1.0,
                               prompts=[TURNS] * 4, services=judge_settings(judge_server))
    assert scores.per_function[:, 0].tolist() == [10.0, 0.0, -1.0, 10.0]  # the last match; 'dunno' has none
    assert scores.failures == {"judge": 1}
    requests = [(h, b) for p, h, b in judge_server.requests]
    first = next(b for h, b in requests if "<answer>8" in b["messages"][0]["content"])
    assert first == {"model": "judge-model", "max_tokens": 16, "temperature": 0.0, "messages": [
        {"role": "user", "content": "Q: What is 3 + 4?\nRef: 7\nA: <answer>8</answer> {answer}\n{not a placeholder}"}]}
    assert {h["Authorization"] for h, b in requests} == {"Bearer sk-test"}
    assert len(requests) == 5  # the 503 was retried


def test_a_judge_that_is_not_there_falls_back_for_every_sample_in_bounded_time():
    url = f"http://127.0.0.1:{closed_port()}/v1"
    settings = ServiceSettings(timeout_s=0.5, retries=1, judge=JudgeSettings(url=url, model="m", prompt="{completion}",
                                                                             pattern=r"(\d+)", concurrency=4))
    started = time.monotonic()
    scores = score_completions(["a"] * 4, [{}] * 4, ["judge"], [1.0], fallback=-2.0, prompts=[TURNS] * 4,
                               services=settings)
    assert scores.per_function[:, 0].tolist() == [-2.0] * 4 and scores.failures == {"judge": 4}
    assert time.monotonic() - started < 3  # four in parallel, each one 0.5 s backoff


# ----------------------------------------------------------------------------- config errors at start

@pytest.mark.parametrize("overrides, message", [
    (["rewards.names=[htp://127.0.0.1:8000/score]"],
     "rewards.names: 'htp://127.0.0.1:8000/score' is not an http:// or https:// URL"),
    (["rewards.names=[http:/127.0.0.1:8000/score]"],
     "rewards.names: 'http:/127.0.0.1:8000/score' is not an http:// or https:// URL"),
    (["rewards.names=[http://127.0.0.1:80000/score]"],
     "rewards.names: 'http://127.0.0.1:80000/score' has a port that is not a number in 0-65535"),
    (["rewards.names=[judge]"], "rewards.names holds 'judge', which needs rewards.judge.url"),
    (["rewards.names=[judge]", "rewards.judge.url=http://127.0.0.1:8000/v1"], "rewards.judge.model is empty"),
    (["rewards.names=[judge]", "rewards.judge.url=http://127.0.0.1:8000/v1/chat/completions", "rewards.judge.model=m"],
     "rewards.judge.url=http://127.0.0.1:8000/v1/chat/completions names the endpoint; give its base, e.g. "
     "http://127.0.0.1:8000/v1 (/chat/completions is added)"),
    (["rewards.names=[judge]", "rewards.judge.url=http://127.0.0.1:8000/v1", "rewards.judge.model=m",
      "rewards.judge.pattern=Score=\\d+"], "rewards.judge.pattern 'Score=\\\\d+' has 0 groups; it needs exactly one"),
    (["rewards.names=[judge]", "rewards.judge.url=http://127.0.0.1:8000/v1", "rewards.judge.model=m",
      "rewards.judge.prompt=Grade it"], "rewards.judge.prompt has no {completion}"),
    (["rewards.names=[http://127.0.0.1:8000/score]", "rewards.accuracy_reward=http://127.0.0.1:8000/score"],
     "rewards.accuracy_reward=http://127.0.0.1:8000/score is a service reward; the reported rates are decided by a "
     "rule function"),
    (["rewards.names=[http://127.0.0.1:8000/score]", "rewards.remote_timeout_s=0"],
     "rewards.remote_timeout_s must be in (0, 86400] and rewards.remote_retries >= 0; got 0.0 and 2"),
])
def test_a_mistyped_service_reward_is_one_config_error_at_start(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["rewards.weights=[1.0]", *overrides])


def test_a_judges_api_key_is_looked_for_by_the_sampler_at_start_not_by_every_config_load():
    """The trainer, an export or an evaluation of the run load its config without the key."""
    from rewards.services import ServiceSettings, ServiceStartError, start_services

    cfg = load_config(None, ["rewards.names=[judge]", "rewards.weights=[1.0]", "rewards.judge.url=http://127.0.0.1:8000/v1",
                             "rewards.judge.model=m", "rewards.judge.api_key_env=NO_SUCH_KEY_HERE"])
    with pytest.raises(ServiceStartError, match="rewards.judge.api_key_env names NO_SUCH_KEY_HERE, which is not set"):
        start_services(cfg.rewards.names, ServiceSettings.of(cfg))


def test_a_service_reward_config_loads_without_calling_anything():
    cfg = load_config(None, ["rewards.names=[http://127.0.0.1:1/score,judge,think_answer_format_partial]",
                             "rewards.weights=[1,0.1,1]", "rewards.judge.url=https://api.example.com/v1",
                             "rewards.judge.model=gpt-judge", "rewards.reward_model_device=cpu"])
    settings = ServiceSettings.of(cfg)
    assert (settings.device, settings.dtype, settings.timeout_s, settings.retries) == ("cpu", "float32", 30.0, 2)
    assert (settings.judge.url, settings.judge.model, settings.judge.pattern) == (
        "https://api.example.com/v1", "gpt-judge", r"Score:\s*(-?\d+(?:\.\d+)?)")
    assert torch.equal(torch.tensor(cfg.rewards.weights), torch.tensor([1.0, 0.1, 1.0]))


def test_check_run_flags_a_service_reward_that_failed_on_every_sample_of_every_step():
    """scripts/check_run.py, as CI runs it after training against the example server."""
    sys.path.insert(0, str(REPO / "scripts"))
    from check_run import service_problems

    url = "http://127.0.0.1:8123/score"
    cfg = load_config(None, [f"rewards.names=[{url},think_answer_format_partial]"])  # 2 prompts x 8 per step
    assert service_problems(cfg, [{f"rewards/{url}/failures": 16.0}, {f"rewards/{url}/failures": 3.0}]) == []
    assert service_problems(cfg, [{f"rewards/{url}/failures": 16.0}] * 2) == [
        f"the reward {url} failed on every sample of every step ([16.0, 16.0]): it trained on rewards.fallback alone; "
        "see sampler.log"]
