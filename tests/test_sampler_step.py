"""One sampler step through the engine interface: a fake engine that implements `RolloutEngine`
(no model of its own) and the HF engine drive the same `make_batch`."""

import dataclasses

import pytest
import torch
from conftest import tiny_model
from engine_helpers import DigitTokenizer, FakeEngine, ScriptedEngine, config, dynamic_batch, numbered_prompts, prompts

from grpo.config import load_config
from grpo.data.cursor import PromptCursor
from grpo.data.problems import Problem
from grpo.data.prompts import Prompt
from grpo.model.loading import add_lora
from grpo.model.logprobs import completion_logprobs
from grpo.objective import Denominators, Objective
from grpo.objective.advantages import group_advantages
from grpo.rewards import score_completions
from grpo.run.ports import free_local_port
from grpo.sampler.batches import SamplerModels, environment_failures, make_batch, step_seed
from grpo.sampler.dynamic_sampling import has_spread
from grpo.sampler.episode_records import Episode
from grpo.sampler.failures import FailedOnAll, FailureStreaks, RewardAlwaysFails
from grpo.sampler.rollout import RolloutEngine, Rollouts
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.trainer.advantage_check import check_advantages
from grpo.trainer.training_step import denominators_of
from grpo.wire.behaviour import BehaviourMismatch
from grpo.wire.codec import MessageError, decode_batch, encode_batch


def test_both_engines_implement_the_interface():
    model = tiny_model()
    assert isinstance(FakeEngine(), RolloutEngine)
    assert isinstance(HFEngine(model, DigitTokenizer(), config().sampling), RolloutEngine)


def test_a_step_takes_the_engines_log_probs_and_version_through_the_interface():
    cfg = config()
    assert cfg.sampling.old_logps == "generation"
    model = add_lora(tiny_model(), cfg.lora).eval()
    engine = FakeEngine()
    engine.load_weights(None, {"kind": "lora", "digest": "d3"}, 3)
    policy = SamplerModels.of(cfg, engine, model, None, DigitTokenizer(), {"sampling.temperature": 0.9})
    batch = make_batch(cfg, policy, prompts(), step=5, metrics_so_far={"timing/x": 1.0},
                       measure_logp_gap=True)
    assert (batch.step, batch.policy_version, batch.weights_digest, batch.behaviour) == \
        (5, 3, "d3", {"sampling.temperature": 0.9})
    expected = engine.generate([[0], [0]], 2).logps
    assert all(torch.equal(a, b) for a, b in zip(batch.old_logps, expected))
    # the answer reward reads the last number: completions "7" and "8" against answers 7 and 8
    assert batch.rewards[:, 0].tolist() == [1.0, -1.0, -1.0, 1.0]
    with torch.no_grad():
        recomputed = completion_logprobs(model, batch.prompt_ids, batch.completion_ids, [2, 2],
                                         temperature=cfg.sampling.temperature)
    gap = max((a - b).abs().max().item() for a, b in zip(expected, recomputed))
    metrics = batch.meta["metrics"]
    assert metrics["sampler/engine_logp_gap_max"] == gap and metrics["timing/x"] == 1.0

    recompute = make_batch(config("sampling.old_logps=recompute"), policy, prompts(), step=5, metrics_so_far={},
                           measure_logp_gap=False)
    assert all(torch.equal(a, b) for a, b in zip(recompute.old_logps, recomputed))


class InFlightEngine(FakeEngine):
    """FakeEngine's completions, each first token drawn by v2 and its EOS by v3 (a version loaded between
    two decode steps), as the HF engine records them with sampling.in_flight_updates."""

    def __init__(self):
        super().__init__()
        self.version, self.weights_digest, self.digests = 3, "d3", {2: "d2", 3: "d3"}

    def generate(self, prompts, group_size, *, seed=None, greedy=False):
        rollouts = super().generate(prompts, group_size)
        rollouts.token_versions = [torch.tensor([2, 3], dtype=torch.int32) for _ in rollouts.completion_ids]
        return rollouts


def test_a_step_whose_weights_changed_while_it_decoded_is_the_batch_of_its_oldest_token():
    """policy_version and the digest are those of the oldest token's version; every token's version
    travels on the wire; the check of the recorded log-probs compares only the tokens of the version
    served now (the recompute's weights)."""
    from grpo.wire.codec import decode_batch, encode_batch

    cfg = config()
    model = add_lora(tiny_model(), cfg.lora).eval()
    policy = SamplerModels.of(cfg, InFlightEngine(), model, None, DigitTokenizer(), {})
    batch = make_batch(cfg, policy, prompts(), step=5, metrics_so_far={}, measure_logp_gap=True)
    assert (batch.policy_version, batch.weights_digest) == (2, "d2")
    assert [v.tolist() for v in decode_batch(encode_batch(batch)).token_versions] == [[2, 3]] * 4
    with torch.no_grad():
        recomputed = completion_logprobs(model, batch.prompt_ids, batch.completion_ids, [2, 2],
                                         temperature=cfg.sampling.temperature)
    eos_gap = max(abs(a[1] - b[1]).item() for a, b in zip(batch.old_logps, recomputed))
    assert batch.meta["metrics"]["sampler/engine_logp_gap_max"] == eos_gap


# ----------------------------------------------------------------------------- what never works stops the run

USER_REWARDS = '''\
"""Rewards for the stop tests: one reads a column the data does not have, one fails on "8"."""


def exact_match(completion, row):
    return float(completion.strip() == row["solution"])


def picky(completion, row):
    if completion.strip() == "8":
        raise ValueError("cannot read 8")
    return float(completion)
'''


def fake_policy(cfg):
    return SamplerModels.of(cfg, FakeEngine(), add_lora(tiny_model(), cfg.lora).eval(), None, DigitTokenizer(), {})


def steps(cfg, count, streaks):
    """`count` steps of the fake engine's batches ("7" and "8" for answers 7 and 8), counted in `streaks`."""
    policy = fake_policy(cfg)
    return [make_batch(cfg, policy, prompts(), step=k, metrics_so_far={}, measure_logp_gap=False, streaks=streaks)
            for k in range(count)]


@pytest.mark.parametrize("on_failure, value, going_on", [
    ("worst", 0.0, "without it (the samples it fails on score the batch's worst, or are left out)"),
    ("fallback", -1.0, "with rewards.fallback"),
])
def test_a_reward_that_fails_on_every_sample_stops_the_sampler_after_max_failed_steps(tmp_path, on_failure, value,
                                                                                     going_on):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    name = f"{tmp_path}/my_rewards.py:exact_match"
    cfg = config(f"rewards.names=[{name}]", "rewards.max_failed_steps=2", f"rewards.on_failure={on_failure}")
    streaks = FailureStreaks()
    first, = steps(cfg, 1, streaks)
    assert first.rewards[:, 0].tolist() == [value] * 4 and first.meta["metrics"][f"rewards/{name}/failures"] == 4.0
    assert first.advantages.tolist() == [0.0] * 4  # all equal: no gradient either way
    with pytest.raises(RewardAlwaysFails) as stopped:
        steps(cfg, 1, streaks)
    assert str(stopped.value) == (
        f"reward {name} failed on all 4 samples in each of the last 2 steps: KeyError: 'solution' "
        f"({tmp_path}/my_rewards.py:5, in exact_match); stopped. Fix the function, or set rewards.max_failed_steps=0 "
        f"to train on {going_on}")
    off = config(f"rewards.names=[{name}]", "rewards.max_failed_steps=0", f"rewards.on_failure={on_failure}")
    assert [b.step for b in steps(off, 3, FailureStreaks())] == [0, 1, 2]  # 0: trains on


def four_per_prompt_steps(tmp_path, *overrides):
    """One step of 2 prompts x G=4 completions "7", "8", "9", "10" scored by `picky` (its value; it raises on "8")."""
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    name = f"{tmp_path}/my_rewards.py:picky"
    batch, = steps(config(f"rewards.names=[{name}]", "sampling.group_size=4", "rewards.max_failed_steps=1", *overrides),
                   1, FailureStreaks())
    return name, batch


def test_a_sample_a_reward_failed_on_scores_its_groups_worst_honest_total(tmp_path):
    """Per group: 7, (failed on "8"), 9, 10. The failed sample takes the group's lowest graded total, 7:
    7, 7, 9, 10, mean 33/4 = 8.25, deviations -1.25, -1.25, 0.75, 1.75, unbiased std
    sqrt((1.5625 * 2 + 0.5625 + 3.0625) / 3) = sqrt(2.25) = 1.5. Raising on a wrong answer never pays."""
    name, batch = four_per_prompt_steps(tmp_path)
    check_advantages(batch, config(f"rewards.names=[{name}]"))  # the trainer recomputes them: 7 is the failure's
    assert batch.totals.tolist() == [7.0, 7.0, 9.0, 10.0] * 2
    assert batch.worst.tolist() == [False, True, False, False] * 2
    expected = [-1.25 / (1.5 + 1e-4), -1.25 / (1.5 + 1e-4), 0.75 / (1.5 + 1e-4), 1.75 / (1.5 + 1e-4)] * 2
    torch.testing.assert_close(batch.advantages, torch.tensor(expected), rtol=0, atol=1e-6)
    assert batch.rewards[:, 0].tolist() == [7.0, 0.0, 9.0, 10.0] * 2  # 0 on the wire where it failed
    m = batch.meta["metrics"]
    assert (m[f"rewards/{name}/failures"], m[f"rewards/{name}/applies"]) == (2.0, 0.75)
    assert (m["rewards/left_out_fraction"], m["rewards/worst_fraction"]) == (0.0, 0.25)
    assert m[f"rewards/{name}/mean"] == pytest.approx(26 / 3)  # the reward's own values: the failure is not one
    assert m["reward"] == pytest.approx(8.25) and m["reward_std"] == pytest.approx(1.5)  # what trains
    assert denominators_of(batch, Objective()) == Denominators(sequences=8, tokens=16, completions=8)  # in the loss


class CutEngine(FakeEngine):
    """Per group "7", "8", "9 2 2" and "10": the third runs to sampling.max_new_tokens=4 (its overlong penalty's)."""

    def generate(self, prompts, group_size, *, seed=None, greedy=False):
        n = len(prompts) * group_size
        completions = [torch.tensor([7 + j % group_size, *([2, 2] if j % group_size == 2 else []), 1])
                       for j in range(n)]  # token 1 is EOS
        return Rollouts(completions, [False] * n, [torch.full((len(c),), -0.5) for c in completions])


def test_a_failure_scores_below_an_honest_answer_the_overlong_penalty_cut(tmp_path):
    """Per group 7, (failed on "8"), 9 less the overlong penalty 5 (4 tokens of 4, buffer 2: -5), 10. The failure
    takes the lowest honest score before the penalty, 7, and keeps its own (0), but 7 would beat the honest 9 - 5 = 4:
    its total is capped there, 4. Failing to be scored never beats being cut for length. The trainer's check
    recomputes it and refuses the uncapped batch."""
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS.replace("return float(completion)",
                                                                 "return float(completion.split()[0])"))
    name = f"{tmp_path}/my_rewards.py:picky"
    cfg = config(f"rewards.names=[{name}]", "sampling.group_size=4", "rewards.max_failed_steps=1",
                 "sampling.max_new_tokens=4", "rewards.overlong_buffer=2", "rewards.overlong_penalty=5")
    policy = SamplerModels.of(cfg, CutEngine(), add_lora(tiny_model(), cfg.lora).eval(), None, DigitTokenizer(), {})
    batch = make_batch(cfg, policy, prompts(), step=0, metrics_so_far={}, measure_logp_gap=False,
                       streaks=FailureStreaks())
    assert batch.reward_names == [name, "overlong_penalty"]
    assert batch.rewards[:, 1].tolist() == [0.0, 0.0, -5.0, 0.0] * 2
    assert batch.totals.tolist() == [7.0, 4.0, 4.0, 10.0] * 2
    check_advantages(batch, cfg)
    uncapped = dataclasses.replace(batch, totals=torch.tensor([7.0, 7.0, 4.0, 10.0] * 2))
    uncapped.advantages = group_advantages(uncapped.totals, [4, 4])
    with pytest.raises(BehaviourMismatch, match="sample 1 failed a reward but its total 7, penalties included, is "
                                                "above an honest answer's of its group"):
        check_advantages(uncapped, cfg)


def test_with_on_failure_fallback_a_failed_sample_is_scored_as_the_fallback(tmp_path):
    """Per group: 7, -1 (the fallback), 9, 10: mean 25/4 = 6.25, deviations 0.75, -7.25, 2.75, 3.75,
    unbiased std sqrt((0.5625 + 52.5625 + 7.5625 + 14.0625) / 3) = sqrt(24.916667) = 4.991660."""
    name, batch = four_per_prompt_steps(tmp_path, "rewards.on_failure=fallback")
    check_advantages(batch, config(f"rewards.names=[{name}]"))
    std = (74.75 / 3) ** 0.5
    expected = [0.75 / (std + 1e-4), -7.25 / (std + 1e-4), 2.75 / (std + 1e-4), 3.75 / (std + 1e-4)] * 2
    torch.testing.assert_close(batch.advantages, torch.tensor(expected), rtol=0, atol=1e-6)
    assert batch.rewards[:, 0].tolist() == [7.0, -1.0, 9.0, 10.0] * 2
    m = batch.meta["metrics"]
    assert m[f"rewards/{name}/mean"] == pytest.approx(26 / 3)  # the reward's own values: a fallback is not one
    assert m["reward"] == pytest.approx(6.25) and m["rewards/left_out_fraction"] == 0.0  # what trains


def test_groups_spread_only_over_their_scored_samples():
    """Dynamic sampling keeps a group for the spread of its scored samples: [1, (0 failed)] has none."""
    totals = torch.tensor([1.0, 0.0, 2.0, 2.0, 5.0, 3.0, 4.0, 4.0])
    scored = torch.tensor([True, False, True, True, True, True, False, False])
    assert has_spread(totals, 2) == [True, False, True, False]
    assert has_spread(totals, 2, scored) == [False, False, True, False]


def test_env_reward_fails_where_the_environment_failed_and_the_environment_alone_stops_the_run():
    """An episode whose environment never answered has no env_reward to give (not a reward of 0): that
    reward fails there, and the episode scores the batch's worst; one whose environment could not open
    (or replayed otherwise after a rebuild) is not the episode's doing: left out. When the environment
    failed on every episode, env.max_failed_steps decides."""
    failed = Episode(env_errors=1, env_error="KeyError: 'board' (board.py:8, in __init__)")
    answered = Episode(env_errors=1, replies=1, env_error="TimeoutError")  # it answered later: not failed
    unopened = Episode(env_errors=1, open_failed=True, env_error="ConnectionRefusedError")
    assert environment_failures([failed, answered, unopened]) == [
        ("KeyError: 'board' (board.py:8, in __init__)", False), None, ("ConnectionRefusedError", True)]
    assert environment_failures(None) is None
    rows = [{"env_reward": None, "reference_answer": "7"}, {"env_reward": 2.0, "reference_answer": "7"},
            {"env_reward": None, "reference_answer": "7"}]
    scores = score_completions(["a", "b", "c"], rows, ["env_reward", "answer_format"], [1.0, 1.0], fallback=None,
                               environment_failures=environment_failures([failed, answered, unopened]))
    assert scores.failed.tolist() == [[True, False], [False, False], [True, False]]
    assert scores.worst.tolist() == [True, False, False] and scores.scored.tolist() == [True, True, False]
    assert scores.failures == {"env_reward": 2, "answer_format": 0}
    assert scores.errors["env_reward"] == "the environment failed: KeyError: 'board' (board.py:8, in __init__)"
    everywhere = score_completions(["a", "b"], [{"env_reward": None}] * 2, ["env_reward"], [1.0], fallback=None,
                                   environment_failures=environment_failures([failed, failed]))
    assert FailedOnAll.of(everywhere, [failed, failed]) == FailedOnAll(2, {}, failed.env_error)
    assert FailedOnAll.of(everywhere, None).rewards == {"env_reward": everywhere.errors["env_reward"]}


def test_a_service_reward_that_fails_on_every_sample_stops_the_sampler_too():
    url = f"http://127.0.0.1:{free_local_port()}/score"  # nothing listens there
    cfg = config(f"rewards.names=[{url}]", "rewards.remote_retries=0", "rewards.max_failed_steps=2")
    with pytest.raises(RewardAlwaysFails) as stopped:
        steps(cfg, 2, FailureStreaks())
    assert str(stopped.value) == (
        f"reward {url} failed on all 4 samples in each of the last 2 steps: Unreachable: {url} cannot be reached: "
        "[Errno 111] Connection refused (1 attempt); stopped. Fix the service, or set rewards.max_failed_steps=0 to "
        "train on without it (the samples it fails on score the batch's worst, or are left out)")


def test_a_step_where_the_reward_works_again_starts_the_count_over():
    cfg = config("rewards.max_failed_steps=2")
    streaks, broken, working = FailureStreaks(), FailedOnAll(4, {"r": "KeyError: 'x'"}), FailedOnAll(4, {})
    for failed in (broken, working, broken, working, broken):
        streaks.observe(cfg, failed)
    with pytest.raises(RewardAlwaysFails, match="reward r failed on all 4 samples in each of the last 2 steps"):
        streaks.observe(cfg, broken)


def test_every_step_reports_the_share_of_groups_whose_rewards_are_all_equal():
    """G = 3 at weight 0.45: prompt 10's completions are all "7" (0.45 each: no spread; their float32
    std is 3.7e-8, not 0), prompt 11's "7", "8", "9" (0.45, -0.45, -0.45). Without dynamic sampling
    the generated groups are the trained ones: both shares are 1 / 2."""
    cfg = config("sampling.group_size=3", "rewards.weights=[0.45]")
    model = add_lora(tiny_model(), cfg.lora).eval()
    policy = SamplerModels.of(cfg, ScriptedEngine(), model, None, DigitTokenizer(), {})
    batch = make_batch(cfg, policy, numbered_prompts(10, 11), step=0, metrics_so_far={}, measure_logp_gap=False)
    assert batch.rewards[:, 0].tolist() == [1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    m = batch.meta["metrics"]
    assert (m["sampling/zero_spread_fraction"], m["frac_reward_zero_std"]) == (0.5, 0.5)


# ----------------------------------------------------------------------------- the next step, started ahead

def next_call_of(tmp_path, step=0, *overrides, episodes=None, end_step=4, version=0, latest=None):
    """`next_call` for a sampler at `step` of `end_step` with the HF engine serving `version` (LATEST: `latest`)."""
    from grpo.sampler.sampling_step import SamplerRun, next_call
    from grpo.weights.folder import WeightWatcher

    cfg = load_config(None, ["sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_staleness=2",
                             *overrides])
    engine = HFEngine(tiny_model(), DigitTokenizer(), cfg.sampling)
    engine.version = version
    if latest is not None:
        (tmp_path / "LATEST").write_text(str(latest))
    table = [Prompt(Problem(f"train-{i}", f"q{i}", "1"), [3, 4, 5 + i]) for i in range(20)]
    policy = SamplerModels.of(cfg, engine, None, None, DigitTokenizer(), {}, episodes=episodes)
    loop = SamplerRun(cfg, policy, table, PromptCursor(len(table), cfg.seed), WeightWatcher(tmp_path, []), None,
                       None, None, None, None, 0, end_step)
    return cfg, loop, next_call(loop, step)


def test_the_next_step_is_started_ahead_with_its_own_prompts_and_seed(tmp_path):
    """Sampler 1 of 2 at its step 0 (global step 1), serving v1: its next step is global step 3 (v1 allowed
    at staleness 2), whose prompts are the stream's from position 3 x 2 and whose seed is step 3's."""
    cfg, loop, then = next_call_of(tmp_path, 0, "sampling.num_workers=2", "sampling.worker_index=1", version=1)
    cursor = PromptCursor(len(loop.prompts), cfg.seed)
    cursor.seek(3 * 2)
    assert then is not None and then.prompts == [loop.prompts[i].token_ids for i in cursor.take(2)]
    assert (then.group_size, then.seed, then.max_new_tokens) == (2, step_seed(cfg, 3), None)


@pytest.mark.parametrize("why, kwargs", [
    ("on-policy: the weights served cannot make the next step", dict(overrides=("sampling.max_staleness=0",))),
    ("the weights served are too old for it", dict(version=0, step=2)),
    ("a newer version is published: the next step loads it", dict(latest=1)),
    ("the last step", dict(step=3)),
    ("dynamic sampling's rounds", dict(overrides=("sampling.dynamic_sampling=true",))),
    ("episodes", dict(episodes=object())),
    ("blocks", dict(overrides=("sampling.continuous_batching=false",))),
])
def test_the_next_step_is_not_started_ahead(tmp_path, why, kwargs):
    overrides = kwargs.pop("overrides", ())
    step = kwargs.pop("step", 0)
    assert next_call_of(tmp_path, step, *overrides, **kwargs)[2] is None, why


def test_the_next_step_is_started_ahead_where_the_weights_served_are_the_newest_and_allowed(tmp_path):
    assert next_call_of(tmp_path, 2, version=1, latest=1)[2] is not None  # step 3 needs v1 at staleness 2


def test_a_batch_scored_by_other_rewards_or_without_totals_is_refused_by_name():
    cfg, _, batch = dynamic_batch([numbered_prompts(10, 11), numbered_prompts(13, 15)])
    foreign = dataclasses.replace(batch, reward_names=["gsm8k_answer"])
    with pytest.raises(BehaviourMismatch, match=r"sampler 0 step 4 was scored with the rewards \['gsm8k_answer'\], "
                                                r"this run's are \['gsm8k_answer_lenient'\]"):
        check_advantages(foreign, cfg)
    with pytest.raises(MessageError, match="missing tensor field 'totals'"):
        decode_batch(encode_batch(dataclasses.replace(batch, totals=None)))
    reweighted = config("sampling.dynamic_sampling=true", "rewards.weights=[2.0]")
    with pytest.raises(BehaviourMismatch, match=r"training.advantage_scale=group: sample 0's total 1 is not its "
                                                r"weighted rewards 2"):
        check_advantages(batch, reweighted)
