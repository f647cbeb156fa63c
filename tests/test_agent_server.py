"""The agent endpoint's HTTP half (grpo/agent/server.py) with the real `openai` SDK as the harness, over real
sockets on loopback; the sessions answer with scripted turns (what the model wrote is the sampler's part)."""

import json
import threading
import time
import urllib.request

import openai
import pytest

from grpo.agent.server import AgentServer, Sessions, Turn
from grpo.sampler.rollout.sequences import TurnLimits

CALLS = [{"id": "call_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}},
         {"id": "call_1", "type": "function", "function": {"name": "mul", "arguments": '{"a": 7, "b": 2}'}}]


@pytest.fixture
def served():
    sessions = Sessions()
    server = AgentServer(sessions, "policy", keepalive_s=0.05)
    yield server, sessions
    server.close()


def scripted(*turns, delay_s: float = 0.0, seen: list | None = None):
    left = list(turns)

    def answer(kind, body, delivery=None, retry=False):
        if seen is not None:
            seen.append((kind, body))
        time.sleep(delay_s)
        return left.pop(0)
    return answer


def client(server, session, key=None, **kwargs):
    return openai.OpenAI(base_url=server.base_url(session), api_key=key or session.token, max_retries=0, **kwargs)


def test_a_chat_turn_with_tool_calls_reaches_the_sdk_whole_and_the_run_sampling_settings_win(served):
    server, sessions = served
    seen = []
    session = sessions.open(scripted(Turn("", "tool_calls", 12, 9, reasoning="I add, then multiply.",
                                          tool_calls=CALLS), seen=seen))
    raw = client(server, session).chat.completions.with_raw_response.create(
        model="anything", messages=[{"role": "user", "content": "3 + 4, times 2?"}], temperature=0.1, top_p=0.5,
        max_tokens=64)
    reply = raw.parse()
    assert raw.headers["x-grpo-ignored"] == "temperature, top_p"  # max_tokens caps the answer (test_agent_runner)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(c.id, c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("call_0", "add", {"a": 3, "b": 4}), ("call_1", "mul", {"a": 7, "b": 2})]
    assert message.model_extra["reasoning_content"] == "I add, then multiply."
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (12, 9, 21)
    assert seen[0][0] == "chat" and seen[0][1]["max_tokens"] == 64 and seen[0][1]["model"] == "anything"


def test_a_stream_keeps_the_connection_alive_while_the_turn_runs_then_is_well_formed_sse(served):
    """0.3 s of generation at 0.05 s keep-alives: comments first (the SDK skips them), then the role, content,
    the two tool calls (whole, with their indices), the finish and the usage; the SDK reassembles the turn."""
    server, sessions = served
    session = sessions.open(scripted(Turn("Let me compute. ", "tool_calls", 5, 7, tool_calls=CALLS), delay_s=0.3))
    stream = client(server, session).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert content == "Let me compute. "
    assert [(t.index, t.id, t.function.name, t.function.arguments) for t in calls] == [
        (0, "call_0", "add", '{"a": 3, "b": 4}'), (1, "call_1", "mul", '{"a": 7, "b": 2}')]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 12
    request = urllib.request.Request(f"{server.base_url(session)}/chat/completions", method="POST",
                                     data=json.dumps({"messages": [{"role": "user", "content": "x"}],
                                                      "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    session.answer = scripted(Turn("ok", "stop", 1, 1), delay_s=1.0)  # 20 keep-alive periods: one at least
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    assert text.startswith(": keep-alive\n\n") and text.endswith("data: [DONE]\n\n")


def test_text_completions_take_token_ids_or_text(served):
    server, sessions = served
    seen = []
    session = sessions.open(scripted(Turn(" 7", "stop", 4, 2), Turn(" 8", "length", 3, 1), seen=seen))
    sdk = client(server, session)
    assert sdk.completions.create(model="policy", prompt=[1, 2, 3, 4]).choices[0].text == " 7"
    out = sdk.completions.create(model="policy", prompt="3 + 5 =", max_tokens=1)
    assert (out.choices[0].text, out.choices[0].finish_reason) == (" 8", "length")
    assert [body["prompt"] for _, body in seen] == [[1, 2, 3, 4], "3 + 5 ="]


@pytest.mark.parametrize("changes, status, message", [
    ({"n": 2}, 400, "n=2 is not served"),
    ({"logit_bias": {"5": 10}}, 400, "logit_bias is not served"),
    ({"seed": 1}, 400, "seed is not served"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}}, 400,
     "response_format json_schema is not served"),
    ({"max_tokens": 0}, 400, "max_tokens must be a positive integer; got 0"),
    ({"max_completion_tokens": 2.5}, 400, "max_completion_tokens must be a positive integer; got 2.5"),
    ({"stop": ["ok", ""]}, 400, r"stop must be a string or a list of at most 16 strings, each of 1 to 256 characters "
                                r"\(stop\[1\] is str of 0 characters\)"),
    ({"stop": ["a"] * 17}, 400, r"\(got list of 17\)"),
], ids=["n", "logit_bias", "seed", "json_schema", "max_tokens", "max_completion_tokens", "stop", "stops"])
def test_what_cannot_be_honoured_is_refused_by_name_as_the_sdk_reads_errors(served, changes, status, message):
    server, sessions = served
    session = sessions.open(scripted(Turn("never", "stop", 1, 1)))
    with pytest.raises(openai.APIStatusError, match=message) as error:
        client(server, session).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}],
                                                        **changes)
    assert error.value.status_code == status


def test_stop_strings_a_json_body_may_hold_but_no_engine_can_match_are_refused():
    """JSON may escape a lone surrogate ("\\ud800"), which no tokenizer's text holds and msgpack cannot send."""
    from grpo.agent.requests import request_limits, stops_problem

    assert stops_problem(json.loads('"\\ud800"')) == "stop[0] is no UTF-8 text (a lone surrogate)"
    assert stops_problem(["</tool_call>", "\n\n"]) == "" and stops_problem({"a": 1}) == "got dict"
    assert request_limits({"stop": "x", "max_tokens": 5, "max_completion_tokens": 3}) == TurnLimits(3, ("x",))
    assert request_limits({}) == TurnLimits()


def test_keys_sessions_and_their_ends(served):
    """An unknown session or a key that is not the path's: 401; one request at a time per session: 409; a
    reward must be a finite number; after /end the session answers 409."""
    server, sessions = served
    release, entered = threading.Event(), threading.Event()

    def slow(kind, body, delivery=None, retry=False):
        entered.set()  # the first request holds its session now
        release.wait(5)
        return Turn("done", "stop", 1, 1)

    session, other = sessions.open(slow), sessions.open(scripted(Turn("x", "stop", 1, 1)))
    chat = {"model": "policy", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(openai.AuthenticationError, match="not the session's"):
        client(server, session, key=other.token).chat.completions.create(**chat)
    stranger = openai.OpenAI(base_url=f"{server.url}/s/{'A' * 32}/v1", api_key="A" * 32, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(**chat)
    first = threading.Thread(target=lambda: client(server, session).chat.completions.create(**chat))
    first.start()
    assert entered.wait(10)
    with pytest.raises(openai.ConflictError, match="one request at a time per session"):
        client(server, session).chat.completions.create(**chat)
    release.set()
    first.join(5)

    def post(path, payload):
        request = urllib.request.Request(f"{server.url}/s/{session.token}{path}", data=json.dumps(payload).encode(),
                                         method="POST", headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    assert post("/reward", {"reward": float("nan")})[0] == 400
    assert post("/reward", {"reward": True})[0] == 400
    assert post("/reward", {"reward": 0.75}) == (200, {"reward": 0.75}) and session.reward == 0.75
    assert post("/reward", {"reward": 0.75}) == (200, {"reward": 0.75})  # the same again: a retried post
    status, refused = post("/reward", {"reward": 1.0})  # posted once: a second reward is not taken
    assert status == 409 and refused["error"]["code"] == "reward_posted" and session.reward == 0.75
    assert post("/end", {}) == (200, {"ended": True})
    with pytest.raises(openai.ConflictError, match="this session has ended"):
        client(server, session).chat.completions.create(**chat)
    assert client(server, other).models.list().data[0].id == "policy"


@pytest.mark.parametrize("messages, message", [
    ([], "messages must be a non-empty list"),
    (["hi"], r"messages\[0\] must be an object whose role is one of"),
    ([{"role": "Assistant", "content": "x"}], r"messages\[0\] must be an object whose role"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "other parts are not served"),
    ([{"role": "assistant", "content": None, "tool_calls": 5}], r"messages\[0\].tool_calls must be a list"),
], ids=["empty", "a-string", "capitalised-role", "an-image", "tool-calls-not-a-list"])
def test_messages_the_template_cannot_render_are_refused_before_the_sampler_sees_them(served, messages, message):
    server, sessions = served
    seen = []
    session = sessions.open(scripted(Turn("never", "stop", 1, 1), seen=seen))
    with pytest.raises(openai.BadRequestError, match=message):
        client(server, session).chat.completions.create(model="policy", messages=messages)
    assert seen == []


def test_a_body_without_a_byte_count_is_refused_and_end_reaches_the_conversation(served):
    import http.client

    server, sessions = served
    ended = []
    session = sessions.open(scripted(), on_end=lambda: ended.append(True))
    host, port = server.url.removeprefix("http://").split(":")
    for headers, status in (({"Content-Length": "-1"}, 400), ({"Content-Length": "abc"}, 400),
                            ({"Transfer-Encoding": "chunked"}, 411)):
        connection = http.client.HTTPConnection(host, int(port), timeout=5)
        connection.putrequest("POST", f"/s/{session.token}/v1/chat/completions", skip_accept_encoding=True)
        for name, value in headers.items():
            connection.putheader(name, value)
        connection.endheaders()
        assert connection.getresponse().status == status
        connection.close()
    request = urllib.request.Request(f"{server.url}/s/{session.token}/end", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200
    assert ended == [True] and session.ended
