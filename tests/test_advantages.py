"""Group-relative advantages: worked numbers, degenerate groups, scale modes."""

import pytest
import torch

from grpo.objective.advantages import group_advantages


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
