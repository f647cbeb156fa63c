"""SkippingAdamW in one process: a non-finite step changes nothing, a finite one is plain AdamW."""

import copy

import pytest
import torch

from grpo.trainer.training_step import SkippingAdamW


def params_and_grads(grad_values):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    for p, g in zip(params, grad_values):
        p.grad = g.clone()
    return params


def one_step(grads, clip_norm: float | None = None, skip_next: bool = False, plain: bool = False):
    """A warm-up step (non-zero moments), then one step with `grads`: (before, after, optimizer)."""
    params = params_and_grads(grads)
    optimizer = (torch.optim.AdamW(params, lr=0.1, weight_decay=0.01) if plain else
                 SkippingAdamW(params, lr=0.1, weight_decay=0.01, clip_norm=clip_norm))
    for p in params:
        p.grad = torch.full_like(p, 0.1)  # norm 0.41: below any clip_norm used here
    optimizer.step()
    before = [p.detach().clone() for p in params], copy.deepcopy(optimizer.state_dict())
    for p, g in zip(params, grads):
        p.grad = g.clone()
    if plain and clip_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, clip_norm)
    optimizer.skip_next = skip_next
    optimizer.step()
    return before, [p.detach().clone() for p in params], optimizer


def assert_unchanged(before, after, optimizer):
    params, state = before
    assert all(torch.equal(a, b) for a, b in zip(params, after))
    for i, s in state["state"].items():  # Adam's moments and step count untouched
        assert all(torch.equal(s[k], optimizer.state_dict()["state"][i][k]) for k in s)


def test_nan_gradient_skips_the_step():
    grads = [torch.randn(3, 4), torch.tensor([1.0, float("nan"), 0.0, 2.0, 3.0])]
    before, after, optimizer = one_step(grads)
    assert optimizer.skipped is True
    assert_unchanged(before, after, optimizer)


def test_an_overflowing_norm_is_caught_before_clipping_would_zero_it():
    grads = [torch.full((3, 4), 1e30), torch.ones(5)]  # finite values, but the norm overflows float32
    before, after, optimizer = one_step(grads, clip_norm=1.0)
    assert optimizer.grad_norm == float("inf") and optimizer.skipped is True
    assert_unchanged(before, after, optimizer)


def test_a_non_finite_loss_flag_skips_a_step_with_finite_gradients():
    before, after, optimizer = one_step([torch.randn(3, 4), torch.randn(5)], skip_next=True)
    assert optimizer.skipped is True
    assert_unchanged(before, after, optimizer)


def test_a_finite_step_is_exactly_adamw():
    grads = [3 * torch.randn(3, 4), 3 * torch.randn(5)]  # norm > 1: clipped
    _, ours, optimizer = one_step(grads, clip_norm=1.0)
    _, plain, _ = one_step(grads, clip_norm=1.0, plain=True)  # a plain AdamW exists now: no double clipping
    _, again, _ = one_step(grads, clip_norm=1.0)
    norm = torch.cat([g.flatten() for g in grads]).norm().item()
    assert optimizer.skipped is False and norm > 1 and optimizer.grad_norm == pytest.approx(norm, rel=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(again, plain))
    assert all(torch.equal(a, b) for a, b in zip(ours, plain))
    assert not all(torch.equal(a, b) for a, b in zip(ours, params_and_grads(grads)))  # and it moved
