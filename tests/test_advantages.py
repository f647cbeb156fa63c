"""Group-relative advantages: worked numbers, degenerate groups, scale modes."""

import pytest
import torch

from grpo.objective.advantages import advantages_problem, failures_below_honest, group_advantages, worst_of_batch


def test_worked_numbers_group_scale():
    # group [1, 2, 3]: mean 2, unbiased std 1 -> (r - 2) / (1 + 1e-4)
    # group [0, 4]:    mean 2, unbiased std sqrt(8) = 2.8284271 -> +-2 / 2.8285271
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 0.0, 4.0]), [3, 2])
    expected = torch.tensor([-1 / 1.0001, 0.0, 1 / 1.0001, -2 / (8 ** 0.5 + 1e-4), 2 / (8 ** 0.5 + 1e-4)])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_all_equal_groups_and_single_samples_get_exactly_zero():
    rewards = torch.tensor([0.1, 0.1, 0.1, -1.0, -1.0, 5.0, 2.0, 3.0])
    adv = group_advantages(rewards, [3, 2, 1, 2])
    assert adv[:6].tolist() == [0.0] * 6
    assert adv[6] < 0 < adv[7]


def test_equal_groups_from_an_int_size():
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0])
    torch.testing.assert_close(group_advantages(rewards, 2), group_advantages(rewards, [2, 2]))


def test_batch_scale_divides_by_the_whole_batch_std():
    rewards = torch.tensor([1.0, 3.0, 10.0, 30.0])
    batch_std = rewards.std()  # unbiased, over all four
    adv = group_advantages(rewards, 2, scale="batch")
    expected = torch.tensor([-1.0, 1.0, -10.0, 10.0]) / (batch_std + 1e-4)
    torch.testing.assert_close(adv, expected)


def test_none_scale_only_centres():
    adv = group_advantages(torch.tensor([1.0, 3.0, 10.0, 30.0, 6.0]), [2, 3], scale="none")
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, -5.333333, 14.666667, -9.333333]))


def test_each_group_sums_to_zero_and_order_is_kept():
    torch.manual_seed(0)
    rewards = torch.randn(23)
    sizes = [5, 1, 8, 2, 7]
    adv = group_advantages(rewards, sizes)
    for a, r in zip(adv.split(sizes), rewards.split(sizes)):
        assert abs(a.sum().item()) < 1e-5
        if len(r) > 1:  # the ranking inside the group is the rewards' ranking
            assert torch.equal(a.argsort(), r.argsort())


@pytest.mark.parametrize("sizes, message", [
    ([2, 2], "must be >= 1 and sum to the number of rewards \\(5\\)"),
    (2, "5 rewards cannot be split into groups of 2"),
    ([3, 0, 2], "must be >= 1"),
])
def test_bad_group_sizes_are_rejected(sizes, message):
    with pytest.raises(ValueError, match=message):
        group_advantages(torch.zeros(5), sizes)


def test_unknown_scale_is_rejected():
    with pytest.raises(ValueError, match="scale must be one of"):
        group_advantages(torch.zeros(4), 2, scale="rank")


# ----------------------------------------------------------------------------- samples a reward failed on

def reference_advantages(rewards: list[float], sizes: list[int], scored: list[bool], scale: str,
                         eps: float = 1e-4) -> list[float]:
    """The slow loop, sample by sample in Python floats: each group's mean and unbiased std over its
    scored samples; 0 for an unscored sample and for a group whose scored rewards do not differ."""
    kept = [r for r, s in zip(rewards, scored) if s]
    batch_mean = sum(kept) / len(kept) if kept else 0.0
    batch_std = (sum((r - batch_mean) ** 2 for r in kept) / (len(kept) - 1)) ** 0.5 if len(kept) > 1 else 0.0
    out, start = [], 0
    for size in sizes:
        group = [(rewards[i], scored[i]) for i in range(start, start + size)]
        values = [r for r, s in group if s]
        mean = sum(values) / len(values) if values else 0.0
        std = (sum((r - mean) ** 2 for r in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else 0.0
        spread = len(values) > 1 and max(values) != min(values)
        for r, s in group:
            a = r - mean if s and spread else 0.0
            out.append(a / (std + eps) if scale == "group" else a / (batch_std + eps) if scale == "batch" else a)
        start += size
    return out


def test_a_failed_sample_leaves_its_groups_mean_and_std_and_gets_zero():
    # group [2, (failed 100), 4, 6]: mean of the scored 4, unbiased std sqrt((4 + 0 + 4) / 2) = 2
    #   -> [-2 / 2.0001, 0, 0, 2 / 2.0001]; the failed 100 would have dragged the mean to 28
    # group [1, 3, 5]: all scored, mean 3, std 2 -> [-1, 0, 1] / 1.00005
    rewards = torch.tensor([2.0, 100.0, 4.0, 6.0, 1.0, 3.0, 5.0])
    scored = torch.tensor([True, False, True, True, True, True, True])
    adv = group_advantages(rewards, [4, 3], scored=scored)
    expected = torch.tensor([-2 / 2.0001, 0.0, 0.0, 2 / 2.0001, -2 / 2.0001, 0.0, 2 / 2.0001])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_a_group_whose_samples_all_failed_or_all_but_one_gets_exactly_zero():
    rewards = torch.tensor([5.0, -3.0, 7.0, 1.0, 9.0, 2.0, 4.0])
    scored = torch.tensor([False, False, False, True, False, True, True])
    adv = group_advantages(rewards, [3, 2, 2], scored=scored, scale="none")
    assert adv.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, -1.0, 1.0]  # a lone scored sample has no baseline


def test_batch_scale_divides_by_the_std_of_the_scored_samples_only():
    # scored [1, 3, 10, 30]: unbiased std of the four = 13.0384; the failed -50 does not widen it
    rewards = torch.tensor([1.0, 3.0, -50.0, 10.0, 30.0])
    scored = torch.tensor([True, True, False, True, True])
    adv = group_advantages(rewards, [3, 2], scored=scored, scale="batch")
    std = torch.tensor([1.0, 3.0, 10.0, 30.0]).std()
    torch.testing.assert_close(adv, torch.tensor([-1.0, 1.0, 0.0, -10.0, 10.0]) / (std + 1e-4))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_masked_advantages_equal_the_slow_loop_over_groups_of_different_sizes(scale):
    torch.manual_seed(1)
    sizes = [4, 1, 6, 3, 2, 5]
    rewards = torch.randn(21).round(decimals=1)  # ties: some groups' scored rewards are all equal
    rewards[4:11] = 0.5
    scored = torch.rand(21) > 0.3
    adv = group_advantages(rewards, sizes, scale=scale, scored=scored)
    expected = reference_advantages(rewards.tolist(), sizes, scored.tolist(), scale)
    torch.testing.assert_close(adv, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert adv[~scored].eq(0).all() and adv[4:11].eq(0).all()



def test_a_sample_a_reward_failed_on_takes_the_batchs_worst_honest_reward():
    """Groups [2, failed, 4, 6] and [failed, 7, -3] and [failed, failed] (sizes 4, 3, 2): every failed
    sample takes -3, the lowest of what was graded in the batch, so a group with nothing graded is
    scored too. A sample left out already (could not be asked) stays out and does not set the worst."""
    rewards = torch.tensor([2.0, 0.0, 4.0, 6.0, 0.0, 7.0, -3.0, 0.0, 0.0])
    worst = torch.tensor([False, True, False, False, True, False, False, True, True])
    out, kept = worst_of_batch(rewards, torch.ones(9, dtype=torch.bool), worst)
    assert out.tolist() == [2.0, -3.0, 4.0, 6.0, -3.0, 7.0, -3.0, -3.0, -3.0] and kept.all()
    # [2, failed, (could not be asked: -100 must not be the worst), 6] -> the failed one takes 2
    out, kept = worst_of_batch(torch.tensor([2.0, 0.0, -100.0, 6.0]), torch.tensor([True, True, False, True]),
                               torch.tensor([False, True, False, False]))
    assert out.tolist() == [2.0, 2.0, -100.0, 6.0] and kept.tolist() == [True, True, False, True]
    # nothing graded in the whole batch: the failed samples are left out, advantage 0
    out, kept = worst_of_batch(torch.tensor([0.0, 5.0]), torch.ones(2, dtype=torch.bool), torch.tensor([True, False]))
    assert kept.tolist() == [True, True] and out.tolist() == [5.0, 5.0]
    out, kept = worst_of_batch(torch.zeros(2), torch.ones(2, dtype=torch.bool), torch.ones(2, dtype=torch.bool))
    assert kept.tolist() == [False, False]


def test_failing_never_earns_more_than_the_worst_graded_answer():
    """The policy's view. In a group [wrong 0, right 10, right 10, made the judge fail], the failed
    sample's advantage equals the wrong answer's, never above it. In a group of right answers
    [10, 10, 10, failed] beside a group with a wrong one, failing still scores below the right
    answers: it takes the batch's worst, 0, so [2.5, 2.5, 2.5, -7.5] / (5 + eps) (unbiased std
    sqrt(75 / 3) = 5), where the worst of its own group would give it 0 like them."""
    rewards, worst = torch.tensor([0.0, 10.0, 10.0, 0.0]), torch.tensor([False, False, False, True])
    out, kept = worst_of_batch(rewards, torch.ones(4, dtype=torch.bool), worst)
    advantages = group_advantages(out, 4, scored=kept)
    assert advantages[3] == advantages[0] < 0
    rewards = torch.tensor([10.0, 10.0, 10.0, 0.0, 0.0, 10.0, 10.0, 10.0])
    worst = torch.tensor([False, False, False, True, False, False, False, False])
    out, kept = worst_of_batch(rewards, torch.ones(8, dtype=torch.bool), worst)
    advantages = group_advantages(out, 4, scored=kept)
    assert out[3] == 0.0
    torch.testing.assert_close(advantages[:4], torch.tensor([2.5, 2.5, 2.5, -7.5]) / (5 + 1e-4), rtol=0, atol=1e-6)


def test_a_failure_stays_below_its_own_groups_honest_totals_after_a_penalty():
    """Totals after a penalty column, two groups of four: group 0's failure (index 3, 0.9 before the cap) is capped
    at its group's lowest honest total, 0.5; group 1's honest sample penalised to -6 does not drag it there (its
    wrong answers would then gain). Group 1's failure is already below; an unscored sample and a group with no
    honest sample keep theirs."""
    totals = torch.tensor([1.0, 0.5, 1.0, 0.9, -6.0, 1.0, -7.0, 2.0, 3.0, 4.0, 0.0, 0.0])
    worst = torch.tensor([False, False, False, True, False, False, True, False, True, True, False, False])
    scored = torch.tensor([True, True, True, True, True, True, True, True, True, True, False, False])
    assert failures_below_honest(totals, scored, worst, 4).tolist() == \
        [1.0, 0.5, 1.0, 0.5, -6.0, 1.0, -7.0, 2.0, 3.0, 4.0, 0.0, 0.0]


def sampler_made(scale: str = "group"):
    """What the sampler sends for two groups of three, rewards [answer, format] weighted [2, 0.5] plus
    the overlong penalty (weight 1, added after the worst): sample 1 failed the answer reward (it
    scores the batch's worst honest total, 0.5, then its own penalty -0.25), sample 5 could not be
    asked (unscored), the rest honest."""
    rewards = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, -0.25], [0.0, 0.0, 0.0],
                            [1.0, 0.0, -1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    weights = torch.tensor([2.0, 0.5, 1.0], dtype=torch.float64)
    after_worst = torch.tensor([False, False, True])
    base = (rewards[:, :2].double() @ weights[:2]).float()  # [2.5, 0.5, 0, 2, 2.5, 0]
    worst = torch.tensor([False, True, False, False, False, False])
    scored = torch.tensor([True, True, True, True, True, False])
    base, scored = worst_of_batch(base, scored & ~worst, worst)
    totals = base + rewards[:, 2]
    return rewards, weights, after_worst, totals, scored, worst, group_advantages(totals, [3, 3], scale=scale,
                                                                                  scored=scored)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantages_the_sampler_makes_follow_from_their_rewards(scale):
    rewards, weights, after_worst, totals, scored, worst, advantages = sampler_made(scale)
    assert totals.tolist() == [2.5, 0.0 - 0.25, 0.0, 1.0, 2.5, 0.0]  # the failed one: the worst honest total, 0
    assert advantages_problem(advantages, totals, scored, worst, rewards, weights, after_worst, [3, 3], scale,
                              1e15) == ""


def forged(change):
    rewards, weights, after_worst, totals, scored, worst, advantages = sampler_made()
    parts = dict(advantages=advantages, totals=totals, scored=scored, worst=worst, rewards=rewards)
    change(parts)
    return advantages_problem(parts["advantages"], parts["totals"], parts["scored"], parts["worst"],
                              parts["rewards"], weights, after_worst, [3, 3], "group", 1e15)


def remade(parts):  # a forger who also makes the advantages agree with the totals it forged
    parts["advantages"] = group_advantages(parts["totals"], [3, 3], scored=parts["scored"])


def test_forged_advantages_totals_failures_and_unscored_samples_are_each_named():
    def advantages(p):
        p["advantages"][2] = 1e4

    def total(p):
        p["totals"][2] = 9.0
        remade(p)

    def reward_without_total(p):  # the reward raised, the total left: also caught
        p["rewards"][3, 0] = 5.0

    def failed_above_its_group(p):
        p["totals"][1] = 3.0
        remade(p)

    def unscored_advantage(p):
        p["advantages"][5] = 0.5

    assert forged(advantages) == ("sample 2's advantage 10000 is not the group-scaled grpo one of its totals "
                                  f"({float(sampler_made()[6][2]):.9g})")
    assert forged(total) == "sample 2's total 9 is not its weighted rewards 0"
    assert forged(reward_without_total) == "sample 3's total 1 is not its weighted rewards 9"
    assert forged(failed_above_its_group) == \
        "sample 1 failed a reward but scores 3.25, above an honest answer of its group"
    assert forged(unscored_advantage) == "sample 5 was not scored but has advantage 0.5"


def test_a_total_beyond_the_limit_or_nan_never_passes():
    """Two failed samples of a group claiming -3e38 would make the recomputed advantages NaN, which
    compares false against anything: the totals' limit and NaN-safe comparisons refuse both."""
    def failed_far_below(p):
        p["worst"][3:5], p["totals"][3:5] = True, -3e38
        p["advantages"][3:6] = torch.tensor([-1e4, 1e4, 0.0])

    assert forged(failed_far_below) == "sample 3's total -3.00000001e+38 is beyond the rewards' limit 1e+15"

    def nan_advantage(p):
        p["advantages"][0] = float("nan")

    assert forged(nan_advantage).startswith("sample 0's advantage nan is not the group-scaled grpo one")


def test_a_large_overlong_penalty_is_not_a_rounding_error():
    """A penalty of 300 in float32 with a small base: compared at the scale of the largest part."""
    rewards = torch.tensor([[1.0, -299.82345], [0.0, 0.0]])
    weights, after_worst = torch.tensor([2.0, 1.0], dtype=torch.float64), torch.tensor([False, True])
    totals = torch.tensor([2.0], dtype=torch.float32) + rewards[:1, 1]
    totals = torch.cat([totals, torch.zeros(1)])
    scored, worst = torch.ones(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool)
    advantages = group_advantages(totals, [2], scored=scored)
    assert advantages_problem(advantages, totals, scored, worst, rewards, weights, after_worst, [2], "group",
                              1e15) == ""


# ----------------------------------------------------------------------------- the other estimators

def slow_advantages(estimator: str, rewards: list[float], sizes: list[int], scored: list[bool]) -> list[float]:
    """Each estimator written sample by sample, straight from its paper, over the scored samples."""
    out, start, centred_all = [], 0, []
    for size in sizes:
        group = [(r, s) for r, s in zip(rewards[start:start + size], scored[start:start + size])]
        kept = [r for r, s in group if s]
        spread = len(set(kept)) > 1
        for r, s in group:
            if not (s and spread):
                out.append(0.0)
            elif estimator == "rloo":  # the mean of the other scored samples of the group
                out.append(r - (sum(kept) - r) / (len(kept) - 1))
            else:  # reinforce_pp: less the group's mean here, over the batch's std below
                out.append(r - sum(kept) / len(kept))
        start += size
    if estimator == "reinforce_pp":
        centred_all = [a for a, s in zip(out, scored) if s]
        mean = sum(centred_all) / len(centred_all)
        std = (sum((a - mean) ** 2 for a in centred_all) / (len(centred_all) - 1)) ** 0.5
        out = [a / (std + 1e-4) for a in out]
    return out


def test_rloo_worked_numbers():
    # group [1, 2, 6]: 1 - (2 + 6) / 2 = -3, 2 - 3.5 = -1.5, 6 - 1.5 = 4.5; group [0, 4]: -4, 4
    from grpo.objective.advantages import estimate_advantages

    adv = estimate_advantages("rloo", torch.tensor([1.0, 2.0, 6.0, 0.0, 4.0]), [3, 2])
    assert adv.tolist() == [-3.0, -1.5, 4.5, -4.0, 4.0]


def test_reinforce_pp_worked_numbers():
    # centred in each group: [-1, 0, 1] and [-2, 2]; their batch mean is 0 and their unbiased std
    # sqrt((1 + 0 + 1 + 4 + 4) / 4) = sqrt(2.5) = 1.5811388, so A = centred / (1.5811388 + 1e-4)
    from grpo.objective.advantages import estimate_advantages

    adv = estimate_advantages("reinforce_pp", torch.tensor([1.0, 2.0, 3.0, 0.0, 4.0]), [3, 2])
    expected = torch.tensor([-1.0, 0.0, 1.0, -2.0, 2.0]) / (2.5 ** 0.5 + 1e-4)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-7)


def test_dr_grpo_is_grpo_without_a_std_and_grpo_is_the_default_estimator():
    from grpo.objective.advantages import estimate_advantages

    rewards = torch.tensor([1.0, 3.0, 10.0, 30.0, 6.0])
    assert estimate_advantages("dr_grpo", rewards, [2, 3]).tolist() == \
        group_advantages(rewards, [2, 3], scale="none").tolist()
    for scale in ("group", "batch", "none"):
        assert estimate_advantages("grpo", rewards, [2, 3], scale=scale).tolist() == \
            group_advantages(rewards, [2, 3], scale=scale).tolist()


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp"])
@pytest.mark.parametrize("seed", range(5))
def test_each_estimator_equals_the_slow_loop_with_unscored_and_equal_groups(estimator, seed):
    """Random rewards in uneven groups, some samples unscored, one group all equal, one with one scored sample."""
    from grpo.objective.advantages import estimate_advantages

    g = torch.Generator().manual_seed(seed)
    sizes = [4, 3, 5, 2, 4]
    rewards = torch.randint(0, 4, (18,), generator=g).float() / 2
    rewards[7:12] = 1.5  # the third group's rewards are all equal
    scored = torch.rand(18, generator=g) > 0.2
    scored[12:14] = torch.tensor([True, False])  # the fourth group has one scored sample
    adv = estimate_advantages(estimator, rewards, sizes, scored=scored)
    slow = slow_advantages(estimator, rewards.tolist(), sizes, scored.tolist())
    torch.testing.assert_close(adv, torch.tensor(slow), rtol=1e-6, atol=1e-6)
    assert adv[~scored].tolist() == [0.0] * int((~scored).sum()) and adv[7:14].tolist() == [0.0] * 7


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "dr_grpo"])
def test_a_failed_sample_scores_below_its_groups_honest_answers_under_every_estimator(estimator):
    """The failure rules hold whatever the estimator: a failed sample takes the batch's lowest honest reward
    (worst_of_batch) and so never gets a higher advantage than an honest sample of its group."""
    from grpo.objective.advantages import estimate_advantages

    rewards = torch.tensor([1.0, 1.0, 9.0, 0.0, 1.0, 0.5])  # sample 2 failed a reward: its 9 is not counted
    worst = torch.tensor([False, False, True, False, False, False])
    scored = torch.ones(6, dtype=torch.bool)
    rewards, scored = worst_of_batch(rewards, scored, worst)
    assert rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 0.5]
    adv = estimate_advantages(estimator, rewards, [3, 3], scored=scored)
    assert adv[2] < adv[0] == adv[1] and adv[2] < 0


def double_the_centred(rewards, sizes, scored):
    """A user's estimator (tests/test_advantages.py:double_the_centred): twice the group-centred reward."""
    return 2 * group_advantages(rewards, sizes, scale="none", scored=scored)


def test_a_users_estimator_by_import_path_is_called_and_its_unscored_samples_get_zero():
    from grpo.objective.advantages import estimate_advantages

    rewards, scored = torch.tensor([1.0, 3.0, 5.0, 4.0]), torch.tensor([True, True, False, True])
    adv = estimate_advantages("tests/test_advantages.py:double_the_centred", rewards, [2, 2], scored=scored)
    assert adv.tolist() == [-2.0, 2.0, 0.0, 0.0]


def one_too_few(rewards, sizes, scored):
    return rewards[1:]


def nan_on_the_first(rewards, sizes, scored):
    return torch.where(torch.arange(len(rewards)) == 0, float("nan"), rewards)


def test_a_users_estimator_that_returns_the_wrong_count_or_nan_is_named():
    from grpo.objective.advantages import estimate_advantages

    with pytest.raises(ValueError, match=r"^training.advantage=tests/test_advantages.py:one_too_few returned 3 "
                                         r"values \(all finite\) for 4 samples"):
        estimate_advantages("tests/test_advantages.py:one_too_few", torch.ones(4), [2, 2])
    with pytest.raises(ValueError, match=r"returned 4 values \(not all finite\) for 4 samples"):
        estimate_advantages("tests/test_advantages.py:nan_on_the_first", torch.ones(4), [2, 2])


def test_the_trainers_check_recomputes_with_the_runs_estimator():
    """advantages_problem with estimator=rloo: rloo's own advantages pass, grpo's are named."""
    from grpo.objective.advantages import estimate_advantages

    totals = torch.tensor([1.0, 2.0, 6.0, 0.0, 4.0])
    rewards, weights = totals[:, None], torch.tensor([1.0], dtype=torch.float64)
    scored, worst, after = torch.ones(5, dtype=torch.bool), torch.zeros(5, dtype=torch.bool), torch.tensor([False])
    check = lambda adv: advantages_problem(adv, totals, scored, worst, rewards, weights, after, [3, 2], "group",  # noqa: E731
                                           100.0, "rloo")
    assert check(estimate_advantages("rloo", totals, [3, 2])) == ""
    # grpo's: (1 - 3) / (sqrt(7) + 1e-4) = -0.755900443, where rloo's is 1 - (2 + 6) / 2 = -3
    assert check(group_advantages(totals, [3, 2])) == ("sample 0's advantage -0.755900443 is not the rloo one of its "
                                                       "totals (-3)")


def with_a_graph(rewards, sizes, scored):
    """A user's estimator whose result still carries autograd's graph."""
    return group_advantages(rewards, sizes, scored=scored) * torch.ones((), requires_grad=True)


def test_a_users_estimators_result_is_taken_as_plain_numbers():
    from grpo.objective.advantages import estimate_advantages

    adv = estimate_advantages("tests/test_advantages.py:with_a_graph", torch.tensor([1.0, 3.0]), [2])
    assert not adv.requires_grad and adv.dtype == torch.float32 and adv.tolist() == pytest.approx([-0.70706, 0.70706],
                                                                                                  rel=1e-4)


def test_small_unnormalised_advantages_cannot_be_forged_and_zeros_are_exact():
    """dr_grpo keeps the rewards' scale: with rewards of 1e-4 the check still names sign-flipped advantages,
    and a group without spread must have exactly 0."""
    from grpo.objective.advantages import estimate_advantages

    totals = torch.tensor([0.0, 8e-5, 1.0, 1.0])
    rewards, weights = totals[:, None], torch.tensor([1.0], dtype=torch.float64)
    scored, worst, after = torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.bool), torch.tensor([False])
    check = lambda adv: advantages_problem(adv, totals, scored, worst, rewards, weights, after, [2, 2], "group",  # noqa: E731
                                           100.0, "dr_grpo")
    honest = estimate_advantages("dr_grpo", totals, [2, 2])
    assert check(honest) == "" and honest.tolist()[2:] == [0.0, 0.0]
    assert check(torch.tensor([4e-5, -4e-5, 0.0, 0.0])) == ("sample 0's advantage 3.9999999e-05 is not the dr_grpo "
                                                             "one of its totals (-3.9999999e-05)")
    assert check(torch.tensor([*honest.tolist()[:2], 1e-7, 0.0])).startswith("sample 2's advantage 1.00000001e-07")
