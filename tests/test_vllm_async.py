"""The vLLM engine's event loop and environment calls, without vLLM: a real asyncio loop in its thread,
real threads for the environment calls (the engine itself: tests/test_vllm_engine.py)."""

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo.sampler.rollout.vllm_async import EngineLoop, EnvironmentCalls, StepCounts
from grpo.sampler.rollout.vllm_tasks import all_of


@pytest.fixture
def loop():
    engine_loop = EngineLoop()
    yield engine_loop
    engine_loop.close()


def test_a_failing_episode_stops_the_others_after_their_environment_calls_end(loop):
    """Episode 0's environment raises at once while episode 1's call takes 0.3 s: the step raises episode
    0's error itself (not a group of them), and only once episode 1's call has ended; episode 1 never
    goes on to its next message."""
    calls, events = EnvironmentCalls(), []
    executor = ThreadPoolExecutor(2)

    def on_turn(j):
        if j == 0:
            time.sleep(0.05)
            raise ValueError("the environment broke")
        time.sleep(0.3)
        events.append("call 1 ended")
        return [1]

    async def episode(j):
        await calls.call(executor, on_turn, j)
        events.append(f"episode {j} went on")

    with pytest.raises(ValueError, match="the environment broke"):
        try:
            loop.run(all_of([lambda: episode(0), lambda: episode(1)]))
        finally:
            events.append("raised")
    executor.shutdown()
    assert events == ["call 1 ended", "raised"]
    assert not calls.in_flight


def test_the_loop_runs_coroutines_from_other_threads_and_raises_their_errors(loop):
    async def where():
        return threading.current_thread().name

    async def fails():
        raise KeyError("missing")
    assert loop.run(where()) == "vllm-engine-loop"
    with pytest.raises(KeyError, match="missing"):
        loop.run(fails())


def test_vllm_idle_time_counts_only_while_calls_wait_and_no_sequence_decodes(loop):
    """On a clock the test moves: a call from t=0 to t=5, another sequence in vLLM until t=2: vLLM idle
    3 s (2 to 5), one episode waiting 5 s of the 10 s the step took."""
    now, release = [0.0], threading.Event()
    calls = EnvironmentCalls(clock=lambda: now[0])
    executor = ThreadPoolExecutor(1)

    def environment():
        release.wait(5)
        now[0] = 5.0
        return [1]

    async def step():
        calls.request(1)  # another sequence decodes
        waiting = asyncio.ensure_future(calls.call(executor, environment))
        await asyncio.sleep(0)  # the call is in flight
        now[0] = 2.0
        calls.request(-1)
        release.set()
        return await waiting
    assert loop.run(step()) == [1]
    executor.shutdown()
    now[0] = 10.0
    assert (calls.idle_s, calls.waiting_s) == (3.0, 5.0)
    assert calls.metrics() == {"env/waiting_mean": 0.5, "timing/env_idle_s": 3.0}


def test_step_counts_add_times_over_calls_and_keep_the_last_of_others():
    counts = StepCounts()
    counts.add({"timing/env_idle_s": 1.5, "env/waiting_mean": 2.0})
    counts.add({"timing/env_idle_s": 0.5, "env/waiting_mean": 3.0})
    assert counts.take() == {"timing/env_idle_s": 2.0, "env/waiting_mean": 3.0}
    assert counts.take() == {}
