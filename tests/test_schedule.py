"""The learning-rate schedule: worked values, and its clock in the trainer's checkpointed state."""

import math

import pytest

from grpo.trainer.schedule import learning_rate_at
from grpo.wire.delivery import TrainerState


def test_warmup_then_constant():
    assert [learning_rate_at(u, 1.0, "constant", warmup_steps=4, total=10) for u in range(6)] == \
        [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("schedule, expected", [
    # warm-up 2 of 10 updates, then 8 updates of decay to the floor 0.1
    ("linear", [0.5, 1.0, 1.0, 0.8875, 0.775, 0.1, 0.1]),
    ("cosine", [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 8)),
                0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)),
                0.1, 0.1]),
])
def test_decay_from_the_end_of_warmup_to_the_floor(schedule, expected):
    updates = [0, 1, 2, 3, 4, 10, 12]
    assert [learning_rate_at(u, 1.0, schedule, 2, 10, 0.1) for u in updates] == pytest.approx(expected, abs=1e-15)
    assert learning_rate_at(6, 3e-4, schedule, 2, 10) == pytest.approx(3e-4 * (0.5 if schedule == "linear" else 0.5))


def test_unknown_schedule_names_the_choices():
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'; one of constant, linear, cosine"):
        learning_rate_at(0, 1.0, "step")


def test_the_update_count_survives_the_checkpointed_state(tmp_path):
    state = TrainerState(step=7, next_steps={0: 7}, incarnation="x", updates=5)  # two of seven steps skipped
    state.save(tmp_path / "s.json")
    assert TrainerState.load(tmp_path / "s.json") == state
    assert TrainerState.from_dict(vars(state)).updates == 5  # the form the DeepSpeed checkpoint's client state holds
    old = {"step": 7, "next_steps": {}, "incarnation": "x"}  # a checkpoint from before the schedule counted updates
    assert TrainerState.from_dict(old).updates == 7
