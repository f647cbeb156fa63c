"""The sampler/trainer mismatch metrics (TRL's names), in worked numbers."""

import math

import pytest
import torch

from grpo.trainer.training_step import MetricSums, mismatch_metrics


def test_mismatch_metrics_in_worked_numbers():
    # two completions, the second one token long (its second position is padding)
    trainer = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    behaviour = torch.tensor([[-1.5, -2.0], [-0.25, -9.0]])
    mask = torch.tensor([[True, True], [True, False]])
    # log pi_trainer - log pi_behaviour on the three tokens: 0.5, 0.0, -0.25
    m = mismatch_metrics(trainer, behaviour, mask)
    assert m["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 0.0 + 0.25) / 3)
    assert m["sampling/sampling_logp_difference/max"] == pytest.approx(0.5)
    assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx((math.exp(0.5) + 1 + math.exp(-0.25)) / 3)
    assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-0.25))
    assert m["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.5))
    assert mismatch_metrics(trainer, behaviour, torch.zeros_like(mask)) == {}  # nothing in the loss


def test_the_first_pass_mean_is_not_diluted_by_later_passes():
    """Two passes over the same two micro-batches (3 and 1 loss tokens): the mismatch is measured on
    the first pass only, token-weighted, and reported as that pass's mean."""
    sums, key = MetricSums(), "sampling/sampling_logp_difference/mean"
    for first_pass in (True, False):
        sums.add({"loss": 0.5, **({key: 0.2} if first_pass else {})}, tokens=3)
        sums.add({"loss": 0.25, **({key: 0.6} if first_pass else {})}, tokens=1)
    out = sums.reduce(["loss", key], passes=2, device="cpu")
    assert out[key] == pytest.approx((0.2 * 3 + 0.6 * 1) / 4)
    assert out["loss"] == pytest.approx(0.75)  # additive: the sum over micro-batches, averaged over passes


def test_a_lower_precision_sampler_without_correction_is_pointed_out():
    from grpo.config import load_config
    from grpo.wire.behaviour import uncorrected_precision_gap

    warned = uncorrected_precision_gap(load_config(None, ["sampling.dtype=bfloat16"]))
    assert warned.startswith("the sampler runs in bfloat16 and the trainer in float32") and "token_truncate" in warned
    for quiet in (["sampling.dtype=bfloat16", "training.importance_sampling=token_truncate"], ["sampling.dtype=auto"],
                  ["model.dtype=bfloat16", "sampling.dtype=float32"]):
        assert uncorrected_precision_gap(load_config(None, quiet)) == "", quiet
