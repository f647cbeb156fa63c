"""New weights while a step decodes (grpo/sampler/in_flight.py): the HF engine's next version verified and read on
a thread of its own and copied in at a poll; newer versions only; an eval.every mark on the way, held until the
step ends; LATEST read at most every LATEST_READ_S. Real published folders, a real WeightWatcher and HF engine."""

import threading
import types
from dataclasses import replace

import pytest
import torch
from conftest import tiny_model
from engine_helpers import DigitTokenizer

from grpo.config import load_config
from grpo.sampler import in_flight
from grpo.sampler.batches import SamplerModels
from grpo.sampler.in_flight import InFlightLoads, in_flight_poll
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.weights.folder import LATEST, WeightWatcher, publish, version_dir


@pytest.fixture
def published(tmp_path, monkeypatch):
    """Versions 1-3 of a tiny model (each its own weights) in a folder, an HF engine serving v0 of another, and
    the thread names its stager ran on."""
    monkeypatch.setattr(in_flight, "LATEST_READ_S", 0.0)
    models = {v: tiny_model(seed=v) for v in (1, 2, 3)}
    for version, model in models.items():
        publish(model, tmp_path, version, version)
    engine = HFEngine(tiny_model(seed=0), DigitTokenizer(), load_config(None, []).sampling)
    threads = []

    def stage(folder, manifest, version):
        threads.append(threading.current_thread().name)
        return engine.stage_weights(folder, manifest, version)
    return tmp_path, models, engine, stage, threads


def write_latest(root, version: int) -> None:
    (root / LATEST).write_text(str(version))


def serves(engine, model) -> bool:
    return torch.equal(engine.model.lm_head.weight, model.lm_head.weight)


def test_the_next_version_is_read_off_the_decode_thread_and_served_from_the_poll_after(published):
    root, models, engine, stage, threads = published
    loads = InFlightLoads(WeightWatcher(root, [stage]))
    assert loads() is False and engine.version == 0  # started: verified and read on its own thread
    loads.pending.join()
    assert engine.version == 0 and threads == ["weights-in-flight"]  # read, not served: the rows decode on v0
    assert loads() is True and engine.version == 3 and serves(engine, models[3])
    assert loads() is False and threads == ["weights-in-flight"]  # nothing newer


def test_a_version_loaded_between_steps_meanwhile_drops_the_one_read_in_flight(published):
    root, models, engine, stage, _ = published
    write_latest(root, 2)
    watcher = WeightWatcher(root, [stage])
    loads = InFlightLoads(watcher)
    assert loads() is False
    loads.pending.join()  # v2 read for v0
    write_latest(root, 3)
    assert watcher.poll().loaded and engine.version == 3  # the step's end loads v3
    assert loads() is False and engine.version == 3 and serves(engine, models[3])  # v2 dropped, not served


def mark_loaded_in_flight(published) -> InFlightLoads:
    """LATEST at 3 and the next eval.every mark 2: the poll that serves v2, the mark, on the way."""
    root, _, engine, stage, _ = published
    loads = InFlightLoads(WeightWatcher(root, [stage]), types.SimpleNamespace(next_mark=2))
    loads()
    loads.pending.join()
    assert loads() is True and engine.version == 2
    return loads


def test_only_newer_versions_load_in_flight_and_an_eval_mark_is_loaded_on_the_way_and_held(published):
    """LATEST at 3 with the next eval.every mark 2: v2 loads (not v3), nothing more until the mark is evaluated;
    a LATEST that moved back (a trainer restarted from an older checkpoint) waits for the step's end."""
    root, models, engine, _, _ = published
    loads = mark_loaded_in_flight(published)
    assert serves(engine, models[2])
    assert loads() is False and loads.pending is None  # held: the mark is evaluated when the step ends
    loads.evaluator.next_mark = 4
    loads()
    loads.pending.join()
    assert loads() is True and engine.version == 3
    write_latest(root, 1)
    assert loads() is False and loads.pending is None and engine.version == 3


def test_latest_is_read_at_most_every_latest_read_s(published, monkeypatch):
    root, _, engine, stage, _ = published
    monkeypatch.setattr(in_flight, "LATEST_READ_S", 3600.0)
    watcher = WeightWatcher(root, [stage], initial_version=3)
    reads = []
    watcher.latest = lambda: reads.append(1) or 3
    loads = InFlightLoads(watcher)
    assert [loads() for _ in range(5)] == [False] * 5 and reads == [1]


def test_an_engine_with_its_own_copy_of_the_weights_loads_where_it_polls_and_episodes_load_between_steps(published):
    """On vLLM (its own copy of the weights, its own episode loop) a version loads where it is polled, and episodes
    load new weights between steps; on the HF engine episodes load them in flight too (its loop records each token's
    version)."""
    root, models, engine, stage, threads = published
    cfg = load_config(None, ["sampling.in_flight_updates=true"])
    policy = SamplerModels.of(cfg, engine, None, None, DigitTokenizer(), {})
    assert isinstance(in_flight_poll(cfg.sampling, replace(policy, episodes=object()), None), InFlightLoads)
    engine.generates_with_scoring_model = False  # as vLLM: its copies are staged where they are polled
    poll = in_flight_poll(cfg.sampling, policy, WeightWatcher(root, [stage]))
    assert poll() is True and engine.version == 3 and threads == [threading.current_thread().name]
    assert in_flight_poll(load_config(None, []).sampling, None, None) is None
    engine.run_episodes = lambda *args, **kwargs: None  # vLLM's episode loop
    assert in_flight_poll(cfg.sampling, replace(policy, episodes=object()), None) is None


def test_a_mark_held_in_flight_is_still_served_when_the_step_ends_and_waits_for_its_weights(published):
    """The step's own wait for weights (sampling.max_staleness) loads no version past a mark not yet evaluated."""
    from grpo.wire.staleness import wait_for_version

    _, models, engine, _, _ = published
    loads = mark_loaded_in_flight(published)
    watcher = loads.watcher
    wait_for_version(watcher, 1, timeout_s=5, prefer=loads.evaluator.next_mark)
    assert engine.version == 2 and serves(engine, models[2])  # evaluated next, then v3 loads
    wait_for_version(watcher, 2, timeout_s=5, prefer=4)
    assert engine.version == 3


def test_a_version_still_being_read_when_the_step_ends_is_served_by_settle_and_read_once(published):
    from grpo.sampler.in_flight import settle_in_flight

    root, models, engine, stage, threads = published
    watcher = WeightWatcher(root, [stage])
    engine.poll_weights = InFlightLoads(watcher)
    assert engine.poll_weights() is False and engine.poll_weights.pending is not None
    settle_in_flight(engine)  # the step's end: waited for, served
    assert engine.poll_weights.pending is None and engine.version == 3 and serves(engine, models[3])
    assert watcher.poll() is None and threads == ["weights-in-flight"]  # not read again


def test_a_refused_version_is_read_once_in_flight_not_at_every_poll(published):
    root, _, engine, stage, threads = published
    (version_dir(root, 3) / "model.safetensors").write_bytes(b"not weights")
    watcher, prepared = WeightWatcher(root, [stage], initial_version=2), []
    prepare = watcher.prepare
    watcher.prepare = lambda prefer=None: prepared.append(prefer) or prepare(prefer)
    loads = InFlightLoads(watcher)
    for _ in range(4):
        loads()
        if loads.pending is not None:
            loads.pending.join()
    assert engine.version == 0 and loads.nothing_at == 3 and threads == []  # refused at its verify
    assert len(prepared) == 1 and watcher.failures == 1
