"""The delivery protocol (grpo/wire/delivery.py): the spool and re-delivery on real files, the trainer's
inbox on real sockets, the sampler's resume position."""

import json

import pytest

from grpo.wire.delivery import Inbox, Redelivery, Spool, SpoolError, TrainerState, resume_step


def frames_of(step: int) -> list[bytes]:
    return [f'{{"step": {step}}}'.encode(), bytes(range(step % 7)), b""]  # an empty frame too


def test_frames_round_trip_bit_exact_and_prune_keeps_the_rest(tmp_path):
    spool = Spool(tmp_path / "spool")
    for step in (3, 1, 2, 10):
        spool.put(step, frames_of(step))
    assert spool.steps() == [1, 2, 3, 10]
    assert all(spool.get(s) == frames_of(s) for s in spool.steps())
    spool.prune(below=3)
    assert spool.steps() == [3, 10]


@pytest.mark.parametrize("data, message", [
    (b"PK\x03\x04zipfile", "is not a spool file"),
    (b"GRPOSPL1" + (5).to_bytes(4, "little"), "header names 5 frames but the file ends at byte 12"),
    (b"GRPOSPL1" + (1).to_bytes(4, "little") + (9).to_bytes(8, "little") + b"abc", "frames add up to 29 bytes"),
])
def test_a_damaged_spool_file_is_named(tmp_path, data, message):
    spool = Spool(tmp_path)
    (tmp_path / "step00000004.batch").write_bytes(data)
    with pytest.raises(SpoolError, match=message):
        spool.get(4)


def six_spooled_steps(tmp_path):
    """A spool holding steps 0-5, the frames re-sent (a list), the trainer state path, the redelivery."""
    spool, sent = Spool(tmp_path / "spool"), []
    for step in range(6):
        spool.put(step, frames_of(step))
    state = tmp_path / "trainer_state.json"
    return spool, sent, state, Redelivery(spool, sent.append, state)


def test_each_new_trainer_gets_the_steps_after_its_checkpoint_once(tmp_path):
    spool, sent, state, redelivery = six_spooled_steps(tmp_path)
    assert redelivery.check(next_step=6) == [] and sent == []  # no trainer yet
    state.write_text(json.dumps({"step": 2, "next_steps": {"0": 2}, "incarnation": "a"}))
    assert redelivery.check(next_step=6) == [2, 3, 4, 5]
    assert sent == [frames_of(s) for s in (2, 3, 4, 5)] and spool.steps() == [2, 3, 4, 5]  # 0, 1 pruned
    assert redelivery.check(next_step=6) == []  # the same trainer: nothing again
    state.write_text(json.dumps({"step": 4, "next_steps": {"0": 4}, "incarnation": "a"}))  # it checkpointed
    assert redelivery.check(next_step=6) == [] and spool.steps() == [4, 5]
    state.write_text(json.dumps({"step": 4, "next_steps": {"0": 4}, "incarnation": "b"}))  # it restarted
    assert redelivery.check(next_step=6) == [4, 5]


def test_after_the_last_step_the_sampler_serves_a_restarted_trainer_until_it_checkpoints_everything(tmp_path):
    spool, sent, state, redelivery = six_spooled_steps(tmp_path)
    redelivery.wait_until_checkpointed(6, timeout_s=0)  # no trainer ever started: nothing to wait for
    state.write_text(json.dumps({"step": 4, "next_steps": {"0": 4}, "incarnation": "a"}))
    redelivery.check(next_step=6)
    sent.clear()

    def trainer_restarts_then_finishes():  # what the poll sees, one file state per poll
        yield {"step": 4, "next_steps": {"0": 4}, "incarnation": "a"}  # killed after its checkpoint at 4
        yield {"step": 4, "next_steps": {"0": 4}, "incarnation": "b"}  # restarted: wants 4 and 5 again
        yield {"step": 6, "next_steps": {"0": 6}, "incarnation": "b"}  # trained and checkpointed them

    states = trainer_restarts_then_finishes()
    original_check = redelivery.check

    def check_after_the_next_write(next_step):
        state.write_text(json.dumps(next(states)))
        return original_check(next_step)

    redelivery.check = check_after_the_next_write
    redelivery.wait_until_checkpointed(6, timeout_s=60, poll_s=0)
    assert sent == [frames_of(4), frames_of(5)] and spool.steps() == []


def test_a_trainer_that_never_finishes_times_out_naming_the_spool(tmp_path):
    spool = Spool(tmp_path / "spool")
    spool.put(5, frames_of(5))
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"step": 5, "next_steps": {"0": 5}, "incarnation": "a"}))
    redelivery = Redelivery(spool, lambda frames: None, state)
    with pytest.raises(TimeoutError, match=r"checkpointed only sampler steps below 5 of 6; the rest stay in .*spool"):
        redelivery.wait_until_checkpointed(6, timeout_s=0.3, poll_s=0.05)
    assert spool.steps() == [5]  # nothing lost


def test_each_sampler_has_its_own_position_and_spool(tmp_path):
    """The key is (sampler, step): sampler 1's re-delivery follows its own position only."""
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"step": 5, "next_steps": {"0": 4, "1": 1}, "incarnation": "a"}))
    spools = {i: Spool.of_sampler(tmp_path, i) for i in (0, 1)}
    for i, spool in spools.items():
        for step in range(5):
            spool.put(step, frames_of(10 * i + step))
    assert spools[1].folder == tmp_path / "spool" / "sampler1"
    sent = {0: [], 1: []}
    assert Redelivery(spools[0], sent[0].append, state, sampler=0).check(next_step=5) == [4]
    assert Redelivery(spools[1], sent[1].append, state, sampler=1).check(next_step=5) == [1, 2, 3, 4]
    assert sent[1] == [frames_of(10 + s) for s in (1, 2, 3, 4)] and spools[1].steps() == [1, 2, 3, 4]
    loaded = TrainerState.load(state)
    assert (loaded.next_step(0), loaded.next_step(1), loaded.next_step(7)) == (4, 1, 0)


def test_a_restarted_sampler_generates_again_only_what_the_spool_lost(tmp_path):
    spool = Spool.of_sampler(tmp_path, 0)
    trainer = TrainerState(step=3, next_steps={0: 3}, incarnation="a")
    for step in (3, 4, 5):
        spool.put(step, frames_of(step))
    assert resume_step(spool, None, 0, saved_next_step=6) == 6  # no trainer yet
    assert resume_step(spool, trainer, 0, saved_next_step=6) == 6  # 3..5 are re-sent from the spool
    spool.prune(below=5)  # someone deleted steps 3 and 4
    assert resume_step(spool, trainer, 0, saved_next_step=6) == 3


def test_the_inbox_trains_the_global_steps_of_two_samplers_once_and_in_order_on_real_sockets():
    """Sampler 0 sends 1, 0, 0 (early, then a duplicate); sampler 1 sends 1, 0. The inbox hands over
    global steps 0-3, i.e. 0:0, 1:0, 0:1, 1:1, each once and in that order."""
    from helpers import free_tcp_address, make_batch

    from grpo.wire.transport import BatchReceiver, BatchSender

    address = free_tcp_address()
    receiver = BatchReceiver(address)
    sender = BatchSender(address)
    try:
        for sampler, step in [(0, 1), (1, 1), (0, 0), (0, 0), (1, 0)]:
            batch = make_batch(step=step, seed=step)
            batch.sampler = sampler
            sender.send(batch)

        def receive(timeout_s):
            frames, batch = receiver.receive_frames(timeout_s)
            return frames, (batch.sampler, batch.step)

        inbox, state, order = Inbox(receive, address, num_samplers=2), TrainerState(), []
        for _ in range(4):
            frames = inbox.next(state, timeout_s=10)
            header = json.loads(frames[0])
            order.append((header["sampler"], header["step"]))
            state.delivered(header["sampler"], header["step"])
            state.step += 1
        assert order == [(0, 0), (1, 0), (0, 1), (1, 1)]
        assert inbox.pending == {}  # the duplicate of 0:0 was dropped, not held
        with pytest.raises(TimeoutError, match="no batch \\(sampler 0 step 2\\) arrived"):
            inbox.next(state, timeout_s=0.3)
    finally:
        sender.close()
        receiver.close()


def test_n_samplers_split_the_global_steps_between_them():
    from grpo.wire.delivery import global_step, owner, steps_of_sampler

    assert [owner(g, 3) for g in range(7)] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (0, 2)]
    assert all(global_step(*owner(g, 3), 3) == g for g in range(20))
    assert [steps_of_sampler(i, 7, 3) for i in range(3)] == [3, 2, 2]
    assert [steps_of_sampler(i, 4, 1) for i in range(1)] == [4] and steps_of_sampler(2, 2, 3) == 0
