"""A session's exchange between its harness and the sampler (grpo/agent/bridge.py), each side on its own
thread as in a run: turns handed over, continuations classified, and every wait ended by its time limit or
the session's end."""

import threading
import time

import pytest

from grpo.agent.bridge import ENDED, IDLE, Conversation
from grpo.agent.history import CONTINUES, EDITED
from grpo.agent.server import AgentError, Turn

ASK = [{"role": "user", "content": "3 + 4?"}]
SAID = {"role": "assistant", "content": "7"}


def harness(conversation, bodies, out):
    """Each request in turn, on a thread of its own: the turns or errors it got, in `out`."""
    def run():
        for body in bodies:
            try:
                out.append(conversation.answer("chat", body))
            except AgentError as e:
                out.append(e)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_turns_go_to_the_waiting_request_and_the_next_request_is_read_as_a_continuation():
    conversation, got = Conversation(idle_timeout_s=5, turn_timeout_s=5), []
    follow = [*ASK, SAID, {"role": "user", "content": "Times 2?"}]
    edited = [{"role": "user", "content": "3 + 5?"}, SAID, {"role": "user", "content": "Times 2?"},
              {"role": "assistant", "content": "14"}, {"role": "user", "content": "Plus 1?"}]
    thread = harness(conversation, [{"messages": ASK}, {"messages": follow}, {"messages": edited}], got)
    kind, body = conversation.first(5)
    assert (kind, body["messages"]) == ("chat", ASK)
    conversation.reply(Turn("7", "stop", 5, 2), ASK, SAID)
    kind, body, found = conversation.next()
    assert found.kind == CONTINUES and found.new == ({"role": "user", "content": "Times 2?"},)
    conversation.reply(Turn("14", "stop", 9, 2), follow, {"role": "assistant", "content": "14"})
    kind, body, found = conversation.next()  # the question rewritten: counted, the sampler decides what then
    assert (found.kind, found.at) == (EDITED, 0) and conversation.breaks == {EDITED: 1}
    conversation.refuse(AgentError(409, "history edited"))
    thread.join(5)
    assert [t.text if isinstance(t, Turn) else str(t) for t in got] == ["7", "14", "history edited"]
    assert conversation.requests == 3


def test_every_wait_ends_a_harness_that_goes_quiet_an_end_a_second_request_and_a_turn_never_given():
    quiet = Conversation(idle_timeout_s=0.2, turn_timeout_s=5)
    started = time.monotonic()
    assert quiet.first(0.2) == IDLE and 0.2 <= time.monotonic() - started < 1.0
    with pytest.raises(AgentError, match="this session has ended"):  # a request after it went quiet: told at once
        quiet.answer("chat", {"messages": ASK})

    conversation, got, second = Conversation(idle_timeout_s=5, turn_timeout_s=5), [], []
    thread = harness(conversation, [{"messages": ASK}], got)
    conversation.first(5)
    harness(conversation, [{"messages": ASK}], second).join(5)  # while the first waits for its turn
    assert isinstance(second[0], AgentError) and "one at a time" in str(second[0])
    conversation.end()  # the step ends while the request waits for its turn: told, not left hanging
    thread.join(5)
    assert isinstance(got[0], AgentError) and got[0].status == 409
    assert conversation.next() == ENDED
    with pytest.raises(AgentError, match="this session has ended"):
        conversation.answer("chat", {"messages": ASK})


def test_a_request_that_gave_up_never_gets_a_turn_nor_makes_the_next_one_get_its_turn():
    """The SDK retries a 504 on its own: the turn sampled for the request that timed out reaches no one and is
    not recorded as served (reply is False), and the retry waits for its own turn; a request that gave up
    before the sampler took it is skipped."""
    conversation, got = Conversation(idle_timeout_s=5, turn_timeout_s=0.3), []
    harness(conversation, [{"messages": ASK}], got).join(5)  # nobody took it: 504
    assert isinstance(got[0], AgentError) and got[0].status == 504
    conversation.turn_timeout_s = 1.5  # room for the retry to be taken before it gives up
    retry = harness(conversation, [{"messages": ASK, "retry": 1}], got)
    kind, body = conversation.first(5)
    assert body == {"messages": ASK, "retry": 1}  # the one that gave up was skipped
    retry.join(5)  # the retry gives up too while its turn is generated
    assert not conversation.reply(Turn("7", "stop", 5, 2), ASK, SAID)
    assert conversation.undelivered == 1 and conversation.returned is None
    conversation.turn_timeout_s = 30
    final = harness(conversation, [{"messages": ASK, "retry": 2}], got)
    kind, body = conversation.first(5)
    assert body["retry"] == 2 and conversation.reply(Turn("7!", "stop", 5, 2), ASK, SAID)
    final.join(5)
    assert [getattr(t, "status", None) or t.text for t in got] == [504, 504, "7!"]


def asked(conversation, body, out, delivery=None, retry=False):
    """One request on a thread of its own, with its Delivery and retry flag: its turn or error in `out`."""
    thread = threading.Thread(target=lambda: out.append(_answer(conversation, body, delivery, retry)))
    thread.start()
    return thread


def _answer(conversation, body, delivery, retry):
    try:
        return conversation.answer("chat", body, delivery, retry)
    except AgentError as e:
        return e


def test_a_retry_joins_the_request_it_repeats_and_one_turn_is_sampled_whichever_response_arrives():
    from grpo.agent.server import Delivery

    conversation, got = Conversation(idle_timeout_s=5, turn_timeout_s=5), []
    first_delivery, retry_delivery = Delivery(), Delivery()
    first = asked(conversation, {"messages": ASK}, got, first_delivery)
    kind, body = conversation.first(5)
    others = []
    asked(conversation, {"messages": ASK}, others).join(5)  # the same body, not marked as a retry: a second request
    asked(conversation, {"messages": [*ASK, SAID]}, others, retry=True).join(5)  # a retry of another request
    assert [e.status for e in others] == [409, 409] and all("one at a time" in str(e) for e in others)
    retry = asked(conversation, {"messages": ASK}, got, retry_delivery, retry=True)
    time.sleep(0.1)
    assert conversation.reply(Turn("7", "stop", 5, 2), ASK, SAID)
    first.join(5)
    retry.join(5)
    assert [t.text for t in got] == ["7", "7"] and conversation.requests == 1 and conversation.retries == 1
    first_delivery.done(False)  # the client that gave up: its response fails; the retry's arrives
    retry_delivery.done(True)
    assert conversation.delivered(5) and conversation.undelivered == 0


def test_a_turn_whose_response_failed_waits_for_a_retry_to_fetch_it_and_is_undelivered_without_one(monkeypatch):
    import grpo.agent.bridge as bridge
    from grpo.agent.server import Delivery

    for retried in (True, False):
        monkeypatch.setattr(bridge, "RETRY_GRACE_S", 5.0 if retried else 0.5)  # a retry's thread has room to come
        conversation, got, delivery = Conversation(idle_timeout_s=5, turn_timeout_s=5), [], Delivery()
        asked(conversation, {"messages": ASK}, got, delivery).join(0.1)
        conversation.first(5)
        conversation.reply(Turn("7", "stop", 5, 2), ASK, SAID)
        delivery.done(False)
        replay = Delivery()
        if retried:  # it comes after the turn was written to no one: answered with that turn, nothing sampled
            threading.Timer(0.2, lambda: (_answer(conversation, {"messages": ASK}, replay, True),
                                          replay.done(True))).start()
        started = time.monotonic()
        assert conversation.delivered(5) is retried
        assert conversation.undelivered == (0 if retried else 1) and conversation.requests == 1
        assert (time.monotonic() - started < 3) if retried else (0.5 <= time.monotonic() - started < 3)


def test_retries_are_few_and_each_is_released_when_the_request_they_repeat_expires():
    import grpo.agent.bridge as bridge

    conversation, got = Conversation(idle_timeout_s=5, turn_timeout_s=3), []
    started = time.monotonic()
    first = asked(conversation, {"messages": ASK}, got)
    conversation.first(5)  # taken, never answered
    time.sleep(1.5)  # the retries come late: on their own clocks they would wait until 4.5 s at least
    retries = [asked(conversation, {"messages": ASK}, got, retry=True) for _ in range(bridge.MAX_RETRIES + 1)]
    for thread in [first, *retries]:
        thread.join(10)
    assert 3.0 <= time.monotonic() - started < 4.2  # all released when the first expired
    statuses = sorted(e.status for e in got)
    assert statuses == [409] + [504] * (bridge.MAX_RETRIES + 1) and conversation.retries == bridge.MAX_RETRIES
