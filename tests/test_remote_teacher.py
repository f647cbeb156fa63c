"""distill.teacher_url (grpo/sampler/remote_teacher.py): the teacher's log-probs from a server, over a real
socket (tests/teacher_server.py: vLLM's answer shape, a real tiny model's forward), equal to the teacher's own
forward; a hostile or broken answer refused by name, never trained on; a slow server named while it is waited
for. The same client against vLLM's real server: tests/test_vllm_server.py."""

import logging
import math

import pytest
import torch
from conftest import tiny_model
from teacher_server import serve_teacher

from grpo.model.logprobs import completion_logprobs
from grpo.sampler import remote_teacher
from grpo.sampler.remote_teacher import RemoteTeacher, TeacherServerError, answer_logprobs

GROUPS = [3, 2]


def inputs(seed: int = 0):
    """Two prompts (5 and 3 tokens) with 3 and 2 completions of 1 to 6 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 101, (n,), generator=g) for n in (5, 3)]
    completions = [torch.randint(1, 101, (n,), generator=g) for n in (4, 1, 6, 2, 3)]
    return prompts, completions


@pytest.fixture(scope="module")
def teacher_model():
    return tiny_model(seed=3).eval()


def test_the_served_log_probs_are_the_teachers_forward_at_temperature_1_in_order_across_requests(teacher_model,
                                                                                                 monkeypatch):
    """Cut into requests of at most 12 tokens (4 in flight), each completion gets its own tokens' log-probs in
    the order given, equal to the shared-prefix forward of the same model at temperature 1; every row went as
    prompt + completion token ids with prompt_logprobs 0."""
    monkeypatch.setattr(remote_teacher, "REQUEST_TOKENS", 12)
    prompts, completions = inputs()
    with serve_teacher(teacher_model) as (url, requests):
        served = RemoteTeacher(url, "teacher", 30).completion_logprobs(prompts, completions, GROUPS)
    with torch.no_grad():
        expected = completion_logprobs(teacher_model, prompts, completions, GROUPS, temperature=1.0)
    assert [len(x) for x in served] == [4, 1, 6, 2, 3] and all(x.dtype == torch.float32 for x in served)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(served, expected))
    # rows of 9, 6, 11, 5 and 6 tokens: [9], [6], [11] (alone, over the budget), [5, 6]; in flight together,
    # they arrive in any order
    assert sorted([len(ids) for ids in r["prompt"]] for r in requests) == [[5, 6], [6], [9], [11]]
    rows = [prompts[i].tolist() + c.tolist() for i, c in zip([0, 0, 0, 1, 1], completions)]
    assert sorted(ids for r in requests for ids in r["prompt"]) == sorted(rows)
    assert all(r["prompt_logprobs"] == 0 and r["max_tokens"] == 1 and r["model"] == "teacher" for r in requests)


def corrupt(choice_change):
    def answer(reply, n):
        choice_change(reply["choices"])
        return reply
    return answer


def first_completion_entry(choices, value):
    """The first completion token's entry of sequence 0 (its prompt has 5 tokens) set to `value`."""
    choices[0]["prompt_logprobs"][5] = value


HOSTILE = {
    "no prompt_logprobs (an OpenAI-style server)": (
        corrupt(lambda cs: [c.pop("prompt_logprobs") for c in cs]), "does not return prompt log-probs"),
    "another token's log-prob": (corrupt(lambda cs: first_completion_entry(cs, {"0": {"logprob": -0.1}})),
                                 "no log-prob of that token"),
    "a log-prob above 0": (corrupt(lambda cs: first_completion_entry(cs, {"TOKEN": {"logprob": 0.5}})),
                           r"not a number in \[-1000, 0\]"),
    "vLLM's -inf": (corrupt(lambda cs: first_completion_entry(cs, {"TOKEN": {"logprob": -9999.0}})),
                    "vLLM writes -9999 for a token the teacher cannot produce"),
    "-1e39, -inf in float32": (corrupt(lambda cs: first_completion_entry(cs, {"TOKEN": {"logprob": -1e39}})),
                               r"not a number in \[-1000, 0\]"),
    "an integer past a float": (corrupt(lambda cs: first_completion_entry(cs, {"TOKEN": {"logprob": -10**400}})),
                                r"not a number in \[-1000, 0\]"),
    "NaN": (corrupt(lambda cs: first_completion_entry(cs, {"TOKEN": {"logprob": math.nan}})),
            r"not a number in \[-1000, 0\]"),
    "true for a number": (corrupt(lambda cs: first_completion_entry(cs, {"TOKEN": {"logprob": True}})),
                          r"not a number in \[-1000, 0\]"),
    "a short entry list": (corrupt(lambda cs: cs[1]["prompt_logprobs"].pop()),
                           "sequence 1: 5 prompt log-probs for 6 tokens"),
    "a choice missing": (corrupt(lambda cs: cs.pop()), "choices for 3 sequences"),
    "two choices of one index": (corrupt(lambda cs: cs[1].update(index=0)), "not indexed 0 .. 2"),
    "a list for an index": (corrupt(lambda cs: cs[1].update(index=[1])), "not indexed 0 .. 2"),
}


@pytest.mark.parametrize("case", HOSTILE, ids=list(HOSTILE))
def test_an_answer_that_is_not_one_log_prob_per_completion_token_is_refused_by_name(teacher_model, case):
    make, message = HOSTILE[case]
    prompts, completions = inputs()
    first_token = str(int(completions[0][0]))

    def answer(reply, n):
        for c in make(reply, n)["choices"]:  # the placeholder of the entries above: the completion's own token
            for entry in c.get("prompt_logprobs") or []:
                if isinstance(entry, dict) and "TOKEN" in entry:
                    entry[first_token] = entry.pop("TOKEN")
        return reply

    with serve_teacher(teacher_model, answer=answer) as (url, _):
        with pytest.raises(TeacherServerError, match=message):
            RemoteTeacher(url, "teacher", 30).completion_logprobs(prompts[:1], completions[:3], [3])


def test_at_start_the_server_must_serve_the_name_with_room_for_the_longest_row_and_answer_log_probs(
        teacher_model, monkeypatch):
    """Checked before the first step: the name in the server's model list, its max_model_len above the longest
    row (one token more: the server generates one), log-probs of a few tokens whose top 5 cannot sum past
    probability 1 (a server started with --logprobs-mode raw_logits sends logits), the API key's variable set."""
    with serve_teacher(teacher_model, name="teacher", max_model_len=64) as (url, requests):
        RemoteTeacher(url, "teacher", 30).check([5, 6, 7], longest_row=63)
        assert requests[-1]["prompt_logprobs"] == 5 and requests[-1]["prompt"] == [[5, 6, 7]]
        with pytest.raises(TeacherServerError, match=rf"distill.teacher_url={url} serves \['teacher'\], not "
                                                     r"Qwen/Qwen3-8B: set distill.served_name"):
            RemoteTeacher(url, "Qwen/Qwen3-8B", 30).check([5, 6, 7], 10)
        with pytest.raises(TeacherServerError, match=r"with max_model_len=64, but a row .* may be 64 tokens: start "
                                                     r"it with --max-model-len 65 or more"):
            RemoteTeacher(url, "teacher", 30).check([5, 6, 7], longest_row=64)

    for shift in (3.0, 20.0):  # what --logprobs-mode raw_logits sends: logits, negative or (as usual) not
        def logits(reply, n):
            for entry in reply["choices"][0]["prompt_logprobs"][1:]:
                for value in entry.values():
                    value["logprob"] += shift
            return reply

        with serve_teacher(teacher_model, answer=logits) as (url, _):
            with pytest.raises(TeacherServerError, match="answers numbers that are not log-probs .* start it without "
                                                         "--logprobs-mode raw_logits"):
                RemoteTeacher(url, "teacher", 30).check([5, 6, 7], 10)
    for models in ([{"id": "teacher"}], {"data": [{"id": ["teacher"]}]}):  # a list; an id that is not a name
        with serve_teacher(teacher_model, models=models) as (url, _):
            with pytest.raises(TeacherServerError, match="serves no model, not teacher"):
                RemoteTeacher(url, "teacher", 30).check([5, 6, 7], 10)
    monkeypatch.delenv("TEACHER_KEY", raising=False)
    with pytest.raises(TeacherServerError, match="distill.api_key_env=TEACHER_KEY, but that environment variable is "
                                                 "unset or empty"):
        RemoteTeacher("http://127.0.0.1:9/v1", "teacher", 30, api_key_env="TEACHER_KEY")
    monkeypatch.setenv("TEACHER_KEY", "sk-abc\n")
    with pytest.raises(TeacherServerError, match="holds a character an HTTP header cannot carry"):
        RemoteTeacher("http://127.0.0.1:9/v1", "teacher", 30, api_key_env="TEACHER_KEY")


def test_a_server_whose_tokenizer_names_an_id_otherwise_is_refused_at_start(teacher_model):
    """The server's decoded_token of every id it answered (the probe's and the top 5) against the model's
    tokenizer: the same text passes (spaces at the ends aside); one other word is a teacher of another
    vocabulary, refused naming the id; a server that names no text is not checked."""
    def ours(token):
        return f" w{token}"

    with serve_teacher(teacher_model, decode=lambda t: f"w{t} ") as (url, _):
        RemoteTeacher(url, "teacher", 30).check([5, 6, 7], 10, decode=ours)
    with serve_teacher(teacher_model, decode=lambda t: "other" if t == 6 else f"w{t}") as (url, _):
        with pytest.raises(TeacherServerError, match="serves teacher with another tokenizer than the model's: token "
                                                     "id 6 is 'other' there, ' w6' here"):
            RemoteTeacher(url, "teacher", 30).check([5, 6, 7], 10, decode=ours)
    with serve_teacher(teacher_model) as (url, _):
        RemoteTeacher(url, "teacher", 30).check([5, 6, 7], 10, decode=ours)


def test_an_overloaded_server_is_asked_again_and_one_that_stays_down_stops_with_the_reason(teacher_model,
                                                                                           monkeypatch):
    """Two 503s are retried (here RETRIES = 2) and the third answer is used; a third 503 in a row is the end. A
    failure stops the batch at once: no later request is sent."""
    monkeypatch.setattr(remote_teacher, "RETRIES", 2)
    monkeypatch.setattr(remote_teacher, "REQUEST_TOKENS", 1)  # a request a row, one at a time
    monkeypatch.setattr(remote_teacher, "IN_FLIGHT", 1)
    prompts, completions = inputs()
    with serve_teacher(teacher_model, fail_first=2) as (url, requests):
        served = RemoteTeacher(url, "teacher", 30).completion_logprobs(prompts[:1], completions[:3], [3])
        assert len(requests) == 5 and [len(x) for x in served] == [4, 1, 6]
    with serve_teacher(teacher_model, fail_after=1) as (url, requests):
        with pytest.raises(TeacherServerError, match=r"HTTP 503.*3 attempts"):
            RemoteTeacher(url, "teacher", 30).completion_logprobs(prompts[:1], completions[:3], [3])
        assert len(requests) == 4  # the first row, then the second's 3 attempts; the third row never sent
    with pytest.raises(TeacherServerError, match="cannot be reached"):
        RemoteTeacher(url, "teacher", 5).check([5, 6, 7], 10)  # the server is gone


def test_a_slow_server_is_named_while_it_is_waited_for(teacher_model, monkeypatch, caplog):
    monkeypatch.setattr(remote_teacher, "WAIT_NOTE_S", 0.05)
    prompts, completions = inputs()
    with serve_teacher(teacher_model, delay_s=0.5) as (url, _), caplog.at_level(logging.INFO):
        RemoteTeacher(url, "teacher", 30).completion_logprobs(prompts[:1], completions[:3], [3])
    assert f"waiting for the teacher at {url} to score 3 completions (11 tokens) (distill.timeout_s=30 a request)" \
        in caplog.text


def test_answer_logprobs_reads_vllms_shape_on_worked_numbers():
    """Prompt [7, 8], completion [9, 4]: entries [None, {8: ..}, {9: -0.5}, {4: -1.25}] give [-0.5, -1.25]; a
    log-prob rounded a hair above 0 is 0."""
    answer = {"choices": [{"index": 0, "prompt_logprobs": [
        None, {"8": {"logprob": -2.0}}, {"9": {"logprob": -0.5, "rank": 1}, "3": {"logprob": -0.9}},
        {"4": {"logprob": -1.25}}]}, {"index": 1, "prompt_logprobs": [None, {"4": {"logprob": 5e-7}}]}]}
    assert answer_logprobs(answer, [2, 1], [[9, 4], [4]]) == [[-0.5, -1.25], [0.0]]
