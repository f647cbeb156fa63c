"""Environment lanes (grpo/environments/lanes.py): several child-process pools of one environment, an
episode always in the same one, each made when first used, a rebuild's cost counted for its own call."""

from conftest import REPO

from grpo.environments.lanes import Lanes, lane_of
from grpo.environments.pool import EnvironmentPool

ENVS = str(REPO / "tests" / "scripted_envs.py")


def test_an_episode_keeps_its_lane_and_lanes_start_when_first_used():
    made = []

    def make(first: bool):
        made.append(first)
        return EnvironmentPool(f"{ENVS}:Counter", {}, 5.0)

    lanes = Lanes(make, 4)
    try:
        assert [lane_of(f"1/{j}", 4) for j in range(6)] == [0, 1, 2, 3, 0, 1]
        assert made == [True]  # the first at start: a bad environment fails there
        for j in (0, 1, 4):
            assert lanes.call(f"1/{j}", "open", {}) == (None, None)
        assert made == [True, False]  # episodes 0 and 4 share lane 0; episode 1 started lane 1
        counts = [lanes.call(f"1/{j}", "step", {}, [], "go")[0].text for j in (0, 4, 0, 1)]
        assert counts == ["count 1", "count 1", "count 2", "count 1"]  # each episode its own environment
    finally:
        lanes.close()


def test_a_rebuild_is_counted_for_the_call_that_made_it():
    """Episode 1/0 is lost with its lane's child (a hang); its next step rebuilds it from its 2 earlier
    messages: that call's counts are (0 restarts, 1 rebuild, 2 replayed steps), the other lane's none."""
    lanes = Lanes(lambda first: EnvironmentPool(f"{ENVS}:Counter", {}, 1.0), 2)
    costs = []
    try:
        for key in ("1/0", "1/1"):
            lanes.call(key, "open", {})
        lanes.call("1/0", "step", {}, [], "a")
        lanes.call("1/0", "step", {}, ["a"], "b")
        _, failure = lanes.call("1/0", "step", {}, ["a", "b"], "hang", counted=costs.append)
        assert failure == "no reply within env.timeout_s=1 s" and costs == [(1, 0, 0)]
        reply, _ = lanes.call("1/0", "step", {}, ["a", "b"], "c", counted=costs.append)
        assert reply.text == "count 3" and costs[-1] == (0, 1, 2)
        lanes.call("1/1", "step", {}, [], "x", counted=costs.append)
        assert costs[-1] == (0, 0, 0) and (lanes.restarts, lanes.rebuilds, lanes.replayed_steps) == (1, 1, 2)
    finally:
        lanes.close()
