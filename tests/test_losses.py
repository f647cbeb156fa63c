"""The objective's loss: worked numbers, a slow per-token reference loop, GSPO, micro-batch invariance."""

import math
import zlib

import pytest
import torch

from grpo.objective import MAX_LOG_RATIO, Denominators, Objective, behaviour_weights, clipped_loss, kl_per_token

LN = math.log


def policy_loss(logps, old, adv, mask, *, ref_logps=None, num_sequences=None, num_tokens=None, num_completions=None,
                is_weights=None, **objective):
    """`clipped_loss` with the objective's settings as keywords (GRPO's defaults otherwise) and the
    denominators this call's own unless given."""
    mask = mask.bool()
    sequences = mask.shape[0] if num_sequences is None else num_sequences
    denominators = Denominators(sequences, mask.sum() if num_tokens is None else num_tokens,
                                sequences if num_completions is None else num_completions)
    return clipped_loss(Objective(**objective), logps, old, adv, mask, ref_logps=ref_logps,
                        denominators=denominators, is_weights=is_weights)


def worked_batch():
    """Two sequences, old log-probs 0, so the token ratios are exp(logps):
    seq 0: ratios [1.5, 0.5, 1.0], advantage +1, 3 tokens
    seq 1: ratios [1.5, 0.5, pad], advantage -2, 2 tokens"""
    logps = torch.tensor([[LN(1.5), LN(0.5), 0.0], [LN(1.5), LN(0.5), -7.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logps, old, adv, mask


# Token level, clip 0.2, per token -min(r A, clip(r, 0.8, 1.2) A):
#   seq 0 (A=+1): min(1.5, 1.2)=1.2, min(0.5, 0.8)=0.5, min(1, 1)=1  -> losses [-1.2, -0.5, -1.0], sum -2.7
#   seq 1 (A=-2): min(-3, -2.4)=-3,  min(-1, -1.6)=-1.6               -> losses [ 3.0,  1.6],      sum  4.6
@pytest.mark.parametrize("aggregation, kwargs, expected", [
    ("grpo", {}, (-2.7 / 3 + 4.6 / 2) / 2),  # (-0.9 + 2.3) / 2 = 0.7
    ("dapo", {}, (-2.7 + 4.6) / 5),  # 0.38
    ("dr_grpo", {"max_completion_length": 4}, (-2.7 + 4.6) / (2 * 4)),  # 0.2375
    ("dr_grpo", {}, (-2.7 + 4.6) / (2 * 3)),  # max_completion_length defaults to T = 3
])
def test_token_level_worked_numbers(aggregation, kwargs, expected):
    loss, metrics = policy_loss(*worked_batch(), aggregation=aggregation, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # clipped low: r < 0.8 with A < 0 (seq 1 token 1); clipped high: r > 1.2 with A > 0 (seq 0 token 0)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/high_mean"] == pytest.approx(1 / 5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(2 / 5)
    assert (metrics["ratio/mean"], metrics["ratio/min"], metrics["ratio/max"]) == pytest.approx((1.0, 0.5, 1.5))
    assert "kl" not in metrics


def test_asymmetric_clip_high():
    # clip_high 0.6: seq 0 token 0 keeps r = 1.5 (< 1.6) -> -1.5 instead of -1.2; seq 1 unchanged
    loss, metrics = policy_loss(*worked_batch(), clip_low=0.2, clip_high=0.6, aggregation="dapo")
    assert loss.item() == pytest.approx((-1.5 - 0.5 - 1.0 + 3.0 + 1.6) / 5, abs=1e-6)
    assert metrics["clip_ratio/high_mean"] == 0.0


# Sequence level (GSPO), s = exp(mean of the token log-ratios):
#   seq 0: s = (1.5 * 0.5 * 1.0) ** (1/3) = 0.9085603, A=+1
#   seq 1: s = (1.5 * 0.5) ** (1/2)      = 0.8660254, A=-2
S0, S1 = 0.75 ** (1 / 3), 0.75 ** 0.5


@pytest.mark.parametrize("clip, expected", [
    # clip 0.2: both inside [0.8, 1.2] -> per-token losses -s0 and +2 s1 -> grpo mean (-0.9085603 + 1.7320508) / 2
    ((0.2, 0.2), (-S0 + 2 * S1) / 2),
    # GSPO clip 3e-4 / 4e-4: seq 0 (A>0, s < 1-eps) is NOT clipped: min(s0, 0.9997) = s0;
    # seq 1 (A<0, s < 1-eps) IS clipped: min(-2 s1, -2 * 0.9997) = -1.9994 -> (-0.9085603 + 1.9994) / 2
    ((3e-4, 4e-4), (-S0 + 2 * 0.9997) / 2),
])
def test_sequence_level_worked_numbers(clip, expected):
    loss, metrics = policy_loss(*worked_batch(), level="sequence", clip_low=clip[0], clip_high=clip[1])
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["ratio/min"] == pytest.approx(S1, abs=1e-6) and metrics["ratio/max"] == pytest.approx(S0, abs=1e-6)
    assert metrics["clip_ratio/low_mean"] == pytest.approx(2 / 5 if clip[0] < 0.01 else 0.0)


def test_clipping_on_both_sides_with_both_signs():
    # one token per sequence: (r, A) = (1.5, +1) clipped to 1.2; (1.5, -1) unclipped -1.5 (pessimistic);
    # (0.5, +1) unclipped 0.5 (pessimistic); (0.5, -1) clipped to -0.8
    logps = torch.tensor([[LN(1.5)], [LN(1.5)], [LN(0.5)], [LN(0.5)]])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, metrics = policy_loss(logps, torch.zeros(4, 1), adv, torch.ones(4, 1), aggregation="dapo")
    assert loss.item() == pytest.approx(-(1.2 - 1.5 + 0.5 - 0.8) / 4, abs=1e-6)
    assert metrics["clip_ratio/region_mean"] == 0.5
    # gradient flows only through the unclipped tokens: d(-r A)/d logp = -r A
    logps.requires_grad_(True)
    policy_loss(logps, torch.zeros(4, 1), adv, torch.ones(4, 1), aggregation="dapo")[0].backward()
    torch.testing.assert_close(logps.grad[:, 0], torch.tensor([0.0, 1.5, -0.5, 0.0]) / 4)


# d = ref - logp with ref - logp = +ln 2 and -ln 2:
#   k1 = -d                 -> -0.6931472, +0.6931472
#   k2 = d^2 / 2            ->  0.2402265,  0.2402265
#   k3 = exp(d) - d - 1     ->  2 - 0.6931472 - 1 = 0.3068528,  0.5 + 0.6931472 - 1 = 0.1931472
@pytest.mark.parametrize("estimator, expected", [
    ("k1", [-LN(2), LN(2)]),
    ("k2", [LN(2) ** 2 / 2, LN(2) ** 2 / 2]),
    ("k3", [2 - LN(2) - 1, 0.5 + LN(2) - 1]),
])
def test_kl_estimators_worked_numbers(estimator, expected):
    logps = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[LN(2), -LN(2)]])
    torch.testing.assert_close(kl_per_token(ref, logps, estimator)[0], torch.tensor(expected))
    # in the loss, at ratio 1 and advantage 0 the policy term is 0 and the loss is beta * mean KL
    loss, metrics = policy_loss(logps, logps, torch.zeros(1), torch.ones(1, 2), ref_logps=ref, beta=0.5,
                                kl_estimator=estimator)
    assert loss.item() == pytest.approx(0.5 * sum(expected) / 2, abs=1e-6)
    assert metrics["kl"] == pytest.approx(sum(expected) / 2, abs=1e-6)


def test_beta_zero_needs_no_reference_and_beta_positive_does():
    logps, old, adv, mask = worked_batch()
    assert policy_loss(logps, old, adv, mask, beta=0.0)[0].item() == pytest.approx(0.7, abs=1e-6)
    with pytest.raises(ValueError, match="beta > 0 needs ref_logps"):
        policy_loss(logps, old, adv, mask, beta=0.1)


def test_padding_holding_minus_inf_gives_finite_values_and_gradients():
    logps, old, adv, mask = worked_batch()
    logps = logps.clone()
    logps[1, 2] = -math.inf
    ref = torch.zeros(2, 3)
    ref[1, 2] = -math.inf
    logps.requires_grad_(True)
    loss, _ = policy_loss(logps, old, adv, mask, ref_logps=ref, beta=0.1)
    loss.backward()
    assert loss.item() == pytest.approx(policy_loss(*worked_batch(), ref_logps=torch.zeros(2, 3), beta=0.1)[0].item())
    assert logps.grad[1, 2].item() == 0.0 and not torch.isnan(logps.grad).any()


# ----------------------------------------------------------------------------- slow reference

def slow_policy_loss(logps, old, adv, mask, ref, *, level, aggregation, clip_low, clip_high, beta, estimator,
                     num_sequences, num_tokens, max_len):
    """The objective written token by token, straight from the formulas."""
    total = torch.zeros(())
    for i in range(logps.shape[0]):
        tokens = [t for t in range(logps.shape[1]) if mask[i, t]]
        if level == "sequence":
            mean_log_ratio = sum(logps[i, t] - old[i, t] for t in tokens) / len(tokens)
        seq = torch.zeros(())
        for t in tokens:
            log_ratio = mean_log_ratio if level == "sequence" else logps[i, t] - old[i, t]
            r = torch.exp(torch.clamp(log_ratio, -MAX_LOG_RATIO, MAX_LOG_RATIO))
            rc = torch.clamp(r, 1 - clip_low, 1 + clip_high)
            term = -torch.minimum(r * adv[i], rc * adv[i])
            if beta:
                d = ref[i, t] - logps[i, t]
                kl = {"k1": -d, "k2": d * d / 2, "k3": torch.exp(d) - d - 1}[estimator]
                term = term + beta * kl
            seq = seq + term
        if aggregation == "grpo":
            total = total + seq / len(tokens) / num_sequences
        elif aggregation == "dapo":
            total = total + seq / num_tokens
        else:
            total = total + seq / (num_sequences * max_len)
    return total


def random_batch(seed, n=7, t=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    logps = (-torch.rand(n, t, generator=g) * 3).requires_grad_(True)
    old = logps.detach() + torch.randn(n, t, generator=g) * 0.3
    ref = logps.detach() + torch.randn(n, t, generator=g) * 0.3
    adv = torch.randn(n, generator=g)
    return logps, old, adv, mask, ref


CASES = [(level, agg) for level in ("token", "sequence") for agg in ("grpo", "dapo", "dr_grpo")]


@pytest.mark.parametrize("level, aggregation", CASES)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_vectorised_loss_equals_the_slow_loop_values_and_gradients(level, aggregation, estimator):
    # hash() is salted
    logps, old, adv, mask, ref = random_batch(seed=zlib.crc32(f"{level}/{aggregation}/{estimator}".encode()) % 1000)
    kwargs = dict(level=level, aggregation=aggregation, clip_low=0.1, clip_high=0.15, beta=0.05)
    loss, _ = policy_loss(logps, old, adv, mask, ref_logps=ref, kl_estimator=estimator, max_completion_length=8,
                          **kwargs)
    (grad,) = torch.autograd.grad(loss, logps)
    slow = slow_policy_loss(logps, old, adv, mask, ref, estimator=estimator, num_sequences=7,
                            num_tokens=int(mask.sum()), max_len=8, **kwargs)
    (slow_grad,) = torch.autograd.grad(slow, logps)
    torch.testing.assert_close(loss, slow, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, slow_grad, rtol=1e-5, atol=1e-7)


def test_gspo_with_equal_token_ratios_equals_the_token_ratio():
    logps = torch.full((1, 4), LN(1.1))
    _, token_metrics = policy_loss(logps, torch.zeros(1, 4), torch.ones(1), torch.ones(1, 4))
    loss_seq, seq_metrics = policy_loss(logps, torch.zeros(1, 4), torch.ones(1), torch.ones(1, 4), level="sequence")
    assert seq_metrics["ratio/mean"] == pytest.approx(1.1) == token_metrics["ratio/mean"]
    assert loss_seq.item() == pytest.approx(-1.1)


def test_gspo_gradient_differs_from_grpo_where_it_should():
    # token ratios [2.0, 0.5] with A=+1, no clipping: GRPO weights each token by its own ratio
    # (grad -r_t / 2 = [-1.0, -0.25]); GSPO's s = sqrt(2 * 0.5) = 1 spreads d s / d logp_t = s / 2
    # evenly (grad -s / 2 / 2 ... per-sequence mean over 2 tokens -> [-0.5, -0.5] / 1 token-mean).
    logps = torch.tensor([[LN(2.0), LN(0.5)]], requires_grad=True)
    kwargs = dict(clip_low=10.0, clip_high=10.0)
    (g_token,) = torch.autograd.grad(policy_loss(logps, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2),
                                                 **kwargs)[0], logps)
    (g_seq,) = torch.autograd.grad(policy_loss(logps, torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2),
                                               level="sequence", **kwargs)[0], logps)
    torch.testing.assert_close(g_token, torch.tensor([[-1.0, -0.25]]))
    torch.testing.assert_close(g_seq, torch.tensor([[-0.5, -0.5]]))


@pytest.mark.parametrize("level, aggregation", CASES)
def test_micro_batch_pieces_with_global_counts_sum_to_the_whole(level, aggregation):
    logps, old, adv, mask, ref = random_batch(seed=7, n=9, t=8)
    common = dict(level=level, aggregation=aggregation, beta=0.04, max_completion_length=8)
    whole, _ = policy_loss(logps, old, adv, mask, ref_logps=ref, **common)
    (whole_grad,) = torch.autograd.grad(whole, logps)
    pieces_loss = torch.zeros(())
    for rows in (slice(0, 2), slice(2, 7), slice(7, 9)):  # 3 uneven pieces
        width = int(mask[rows].sum(-1).max())  # each piece trimmed to its own longest completion
        loss, _ = policy_loss(logps[rows, :width], old[rows, :width], adv[rows], mask[rows, :width],
                              ref_logps=ref[rows, :width], num_sequences=9, num_tokens=mask.sum(), **common)
        pieces_loss = pieces_loss + loss
    (pieces_grad,) = torch.autograd.grad(pieces_loss, logps)
    torch.testing.assert_close(pieces_loss, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(pieces_grad, whole_grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kwargs, message", [
    ({"level": "word"}, "level must be one of"),
    ({"aggregation": "sum"}, "aggregation must be one of"),
    ({"kl_estimator": "k9", "beta": 0.1}, "kl_estimator must be one of"),
])
def test_bad_options_are_named(kwargs, message):
    logps, old, adv, mask = worked_batch()
    with pytest.raises(ValueError, match=message):
        policy_loss(logps, old, adv, mask, ref_logps=old, **kwargs)


# ----------------------------------------------------------------------------- the decoupled objective

IS_PROX = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, 0.0]])
IS_BEHAVIOUR = torch.tensor([[-1.5, -1.0, -0.5], [-1.2, -1.3, -7.0]])
IS_MASK = torch.tensor([[True, True, True], [True, True, False]])
E = math.e


@pytest.mark.parametrize("mode, level, expected", [
    # log pi_prox - log pi_behaviour: row 0 [0.5, -1, 0] (ratios e^0.5 = 1.649, e^-1 = 0.368, 1); row 1 [1, 1]
    ("token_truncate", "token", [[1.5, 1 / E, 1.0], [1.5, 1.5, 0.0]]),  # capped at 1.5
    ("token_mask", "token", [[0.0, 1 / E, 1.0], [0.0, 0.0, 0.0]]),  # above 1.5: zero
    # one weight per completion: the product of its ratios, e^-0.5 = 0.607 and e^2 = 7.39
    ("sequence_truncate", "token", [[E ** -0.5] * 3, [1.5, 1.5, 0.0]]),
    ("sequence_mask", "token", [[E ** -0.5] * 3, [0.0, 0.0, 0.0]]),
    # GSPO: the geometric mean, e^(-0.5 / 3) = 0.846 and e^(2 / 2) = 2.72
    ("sequence_truncate", "sequence", [[E ** (-0.5 / 3)] * 3, [1.5, 1.5, 0.0]]),
    ("sequence_mask", "sequence", [[E ** (-0.5 / 3)] * 3, [0.0, 0.0, 0.0]]),
])
def test_behaviour_weights_in_worked_numbers(mode, level, expected):
    weights = behaviour_weights(IS_PROX, IS_BEHAVIOUR, IS_MASK, mode=mode, cap=1.5, level=level)
    torch.testing.assert_close(weights, torch.tensor(expected), rtol=0, atol=1e-6)


def test_the_decoupled_loss_weighs_each_token_in_worked_numbers():
    """token_truncate, cap 1.5, advantages [1, -1], grpo aggregation, logps at the proximal policy
    (ratio 1, nothing clipped): row 0 -(1.5 + 0.368 + 1) / 3 = -0.956, row 1 +(1.5 + 1.5) / 2 = 1.5,
    loss (-0.956 + 1.5) / 2 = 0.272; d loss / d logp = -A w / len / 2, e.g. -1.5 / 6 = -0.25."""
    logps = IS_PROX.clone().requires_grad_()
    weights = behaviour_weights(IS_PROX, IS_BEHAVIOUR, IS_MASK, mode="token_truncate", cap=1.5)
    loss, metrics = policy_loss(logps, IS_PROX, torch.tensor([1.0, -1.0]), IS_MASK, is_weights=weights)
    row0 = -(1.5 + 1 / E + 1.0) / 3
    assert loss.item() == pytest.approx((row0 + 1.5) / 2, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.25, -1 / E / 6, -1 / 6], [0.375, 0.375, 0.0]]),
                               rtol=0, atol=1e-6)
    assert metrics["importance_sampling/weight_mean"] == pytest.approx((1.5 + 1 / E + 1 + 1.5 + 1.5) / 5)
    assert metrics["importance_sampling/zero_fraction"] == 0.0


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_with_no_mismatch_the_decoupled_loss_is_todays_bit_for_bit(mode, level):
    """Behaviour == proximal (on-policy, no engine mismatch): every weight is exactly 1 and the loss
    and its gradient are today's, bit for bit."""
    logps, old, adv, mask, ref = random_batch(seed=7)
    behaviour = logps.detach().clone()
    kwargs = dict(level=level, ref_logps=ref, beta=0.04)
    today = logps.detach().clone().requires_grad_()
    loss_today, _ = policy_loss(today, behaviour, adv, mask, **kwargs)
    loss_today.backward()
    decoupled = logps.detach().clone().requires_grad_()
    weights = behaviour_weights(decoupled.detach(), behaviour, mask, mode=mode, cap=2.0, level=level)
    assert torch.equal(weights, mask.float())
    loss, _ = policy_loss(decoupled, decoupled.detach(), adv, mask, is_weights=weights, **kwargs)
    loss.backward()
    assert torch.equal(loss, loss_today) and torch.equal(decoupled.grad, today.grad)


# ----------------------------------------------------------------------------- dr_grpo with masked completions

def test_dr_grpo_divides_by_every_completion_of_the_batch_when_truncated_ones_are_masked():
    """Sequence 1 of the worked batch is truncated and masked out: dr_grpo still divides by the
    batch's 2 completions times the length (TRL: the batch size), not by the 1 the loss sees."""
    logps, old, adv, mask = worked_batch()
    kept = mask.clone()
    kept[1] = 0
    loss, _ = policy_loss(logps, old, adv, kept, aggregation="dr_grpo", max_completion_length=4, num_sequences=1,
                          num_tokens=3, num_completions=2)
    assert loss.item() == pytest.approx(-2.7 / (2 * 4), abs=1e-6)


def test_the_trainers_dr_grpo_loss_with_masked_truncation_is_the_loss_without_their_terms():
    """micro_batch_loss on a tiny model (beta 0): masking the truncated completions gives the unmasked
    loss with their advantages zeroed (their terms gone), over the same normaliser, 5 completions x
    max_new_tokens, whole or in micro-batches. Before, it divided by the 3 kept completions."""
    import dataclasses

    from conftest import tiny_model
    from helpers import make_batch

    from grpo.config import load_config
    from grpo.trainer.groups import select_groups
    from grpo.trainer.training_step import denominators_of, micro_batch_loss

    model = tiny_model()
    common = ["training.aggregation=dr_grpo", "training.beta=0", "sampling.max_new_tokens=8"]
    cfg, masked_cfg = (load_config(None, common),
                       load_config(None, [*common, "training.mask_truncated_completions=true"]))
    batch = make_batch(seed=4, with_ref=False)
    truncated = torch.tensor([False, True, False, False, True])
    batch = dataclasses.replace(batch, completion_ids=[c % 101 for c in batch.completion_ids],
                                prompt_ids=[p % 101 for p in batch.prompt_ids], truncated=truncated)
    counts = denominators_of(batch, Objective.of(masked_cfg))  # what the trainer counts for the whole batch
    zeroed = dataclasses.replace(batch, advantages=torch.where(truncated, 0.0, batch.advantages))
    with torch.no_grad():
        expected = micro_batch_loss(model, zeroed, cfg)[0]
        whole = micro_batch_loss(model, batch, masked_cfg)[0]
        pieces = sum(micro_batch_loss(model, select_groups(batch, [g]), masked_cfg, denominators=counts)[0]
                     for g in (0, 1))
    assert counts == Denominators(sequences=3, tokens=sum(len(c) for c, t in zip(batch.completion_ids, truncated)
                                                          if not t), completions=5)
    assert abs(expected.item()) > 1e-3
    torch.testing.assert_close(whole, expected)
    torch.testing.assert_close(pieces, expected)


def test_mask_truncated_completions_drops_whole_rows_only_when_asked():
    from grpo.objective import loss_mask

    mask = torch.ones(2, 3, dtype=torch.bool)
    truncated = torch.tensor([False, True])
    assert loss_mask(Objective(mask_truncated=True), mask, truncated).int().tolist() == [[1, 1, 1], [0, 0, 0]]
    assert torch.equal(loss_mask(Objective(mask_truncated=False), mask, truncated), mask)


def test_the_batch_header_holds_what_the_batch_was_made_for_not_the_loss_settings():
    """A batch depends on which tokens the loss sees and on the advantages' scale; the loss's own
    settings are the trainer's, so a run resumed with another clip still trains on the spooled
    batches (and an unbounded clip needs no place in the header's JSON)."""
    import json

    from grpo.config import load_config

    base = Objective.of(load_config(None, []))
    loss_only = Objective.of(load_config(None, ["training.clip_high=.inf", "training.beta=0.1",
                                                 "training.importance_sampling=token_truncate"]))
    masked = Objective.of(load_config(None, ["training.mask_truncated_completions=true"]))
    scaled = Objective.of(load_config(None, ["training.advantage_scale=batch"]))
    assert (base.header() == loss_only.header()
            and json.loads(json.dumps(loss_only.header(), allow_nan=False)) == base.header())
    assert masked.header() != base.header() != scaled.header()


def test_a_sample_left_out_of_the_advantages_adds_nothing_and_still_counts_in_the_denominators():
    """A sample a reward failed on reaches the loss with advantage 0, as every sample of a group whose
    rewards are all equal does: its tokens add 0 to the policy term and count in the denominators (TRL's
    normaliser, DAPO's token mean), so the loss is exactly the worked batch's sum over one more sequence.
    The worked batch (sums -2.7 over 3 tokens, 4.6 over 2) plus a left-out sequence of 2 tokens:
    grpo (-0.9 + 2.3 + 0) / 3 = 0.4666667; dapo (-2.7 + 4.6 + 0) / 7 = 0.2714286."""
    logps, old, adv, mask = worked_batch()
    logps = torch.cat([logps, torch.tensor([[LN(3.0), LN(0.1), 0.0]])])  # far from 1: it still adds 0
    old, adv = torch.zeros(3, 3), torch.cat([adv, torch.zeros(1)])
    mask = torch.cat([mask, torch.tensor([[1, 1, 0]])])
    for aggregation, expected in (("grpo", 1.4 / 3), ("dapo", 1.9 / 7)):
        loss, _ = policy_loss(logps, old, adv, mask, aggregation=aggregation)
        assert loss.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("aggregation", ["grpo", "dapo"])
def test_a_batch_whose_every_completion_is_masked_has_a_zero_loss_not_nan(aggregation):
    """Every completion truncated and masked (training.mask_truncated_completions): the loss sees no
    sequence and no token; it is 0 with a zero gradient, never 0/0, which would skip the step."""
    from grpo.objective import aggregate

    per_token = torch.tensor([[0.5, -1.0], [2.0, 3.0]], requires_grad=True)  # [N=2, T=2]
    loss = aggregate(per_token, torch.zeros(2, 2, dtype=torch.bool), aggregation, num_sequences=0, num_tokens=0,
                     max_completion_length=2, num_completions=2)
    loss.backward()
    assert loss.item() == 0.0 and per_token.grad.abs().sum().item() == 0.0


def test_tokens_older_than_max_token_age_leave_the_loss_in_worked_numbers():
    """training.max_token_age=1 at trainer version 5: of completions sampled with versions [3 3 4 4], [4 -1 4]
    (an environment's token in the middle) and [3 3] (an in-flight load moved the first from v3 to v4), the
    v3 tokens leave the loss: 4 of 8 model tokens, the last completion whole, so the loss sees 4 tokens of 2
    completions. The environment's token stays out. Nothing that old: the batch itself, untouched."""
    import dataclasses

    from helpers import make_batch

    from grpo.trainer.training_step import denominators_of, within_age

    batch = make_batch(seed=1, group_sizes=(2, 1))
    ids = [torch.arange(4), torch.arange(3), torch.arange(2)]
    versions = [torch.tensor([3, 3, 4, 4], dtype=torch.int32), torch.tensor([4, -1, 4], dtype=torch.int32),
                torch.tensor([3, 3], dtype=torch.int32)]
    batch = dataclasses.replace(batch, completion_ids=ids, token_versions=versions,
                                model_mask=[v >= 0 for v in versions], truncated=torch.zeros(3, dtype=torch.bool))
    assert denominators_of(batch, Objective()) == Denominators(sequences=3, tokens=8, completions=3)
    aged, fraction = within_age(batch, trainer_version=5, max_age=1)
    assert [m.int().tolist() for m in aged.model_mask] == [[0, 0, 1, 1], [1, 0, 1], [0, 0]]
    assert (fraction == 4 / 8
            and denominators_of(aged, Objective()) == Denominators(sequences=2, tokens=4, completions=3))
    assert within_age(batch, trainer_version=5, max_age=2)[0] is batch
    assert within_age(batch, trainer_version=4, max_age=1)[0] is batch


@pytest.mark.parametrize("aggregation", ["grpo", "dapo"])
def test_the_trainers_loss_without_aged_out_tokens_is_the_slow_loop_over_the_young_ones(aggregation):
    """micro_batch_loss on a tiny model, a batch whose completions span versions 2-4 at trainer version 4
    with max_token_age=1: the loss (whole, and summed over its groups as ranks would) equals the per-token
    loop over the tokens of versions 3 and 4 alone, with their own counts as denominators."""
    import dataclasses

    from conftest import tiny_model
    from helpers import make_batch

    from grpo.config import load_config
    from grpo.model.logprobs import completion_logprobs
    from grpo.trainer.groups import select_groups
    from grpo.trainer.training_step import denominators_of, micro_batch_loss, within_age

    model = tiny_model()
    cfg = load_config(None, [f"training.aggregation={aggregation}", "training.beta=0", "training.max_token_age=1"])
    batch = make_batch(seed=5, with_ref=False)
    g = torch.Generator().manual_seed(6)
    versions = [torch.sort(torch.randint(2, 5, (len(c),), generator=g, dtype=torch.int32)).values
                for c in batch.completion_ids]
    batch = dataclasses.replace(batch, completion_ids=[c % 101 for c in batch.completion_ids],
                                prompt_ids=[p % 101 for p in batch.prompt_ids], token_versions=versions,
                                truncated=torch.zeros(5, dtype=torch.bool))
    aged, fraction = within_age(batch, 4, 1)
    young = [v >= 3 for v in versions]
    counts = denominators_of(aged, Objective.of(cfg))
    assert 0 < fraction < 1 and counts.tokens == sum(int(y.sum()) for y in young)
    with torch.no_grad():
        whole = micro_batch_loss(model, aged, cfg)[0]
        pieces = sum(micro_batch_loss(model, select_groups(aged, [k]), cfg, denominators=counts)[0] for k in (0, 1))
        logps = completion_logprobs(model, aged.prompt_ids, aged.completion_ids, aged.group_sizes,
                                    temperature=cfg.sampling.temperature)
    width = max(len(c) for c in aged.completion_ids)

    def pad(rows, value):
        return torch.stack([torch.cat([r, torch.full((width - len(r),), value, dtype=r.dtype)]) for r in rows])

    slow = slow_policy_loss(pad(logps, 0.0), pad(aged.old_logps, 0.0), aged.advantages, pad(young, False), None,
                            level="token", aggregation=aggregation, clip_low=0.2, clip_high=0.2, beta=0, estimator="k3",
                            num_sequences=counts.sequences, num_tokens=counts.tokens, max_len=width)
    assert abs(slow.item()) > 1e-3
    torch.testing.assert_close(whole, slow, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pieces, slow, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- CISPO, SAPO, a user's loss

def test_cispo_worked_numbers_and_gradients():
    # the worked batch (ratios [1.5, 0.5, 1] with A=+1, [1.5, 0.5] with A=-2), per token -sg(w) A log pi:
    # defaults (clip_low 1, clip_high 4: w = clamp(r, 0, 5) = r):
    #   seq 0: -(1.5 ln 1.5 + 0.5 ln 0.5 + 1 * 0) = -0.2616240, seq 1: +2 (1.5 ln 1.5 + 0.5 ln 0.5) = 0.5232481
    #   grpo aggregation: (-0.2616240 / 3 + 0.5232481 / 2) / 2 = 0.0872080
    #   d/d log pi = -w A / (tokens of its sequence) / 2 sequences: [-1.5/6, -0.5/6, -1/6], [+3/4, +1/4]
    # clip_high 0.2 caps w at 1.2 but keeps the token's gradient, where PPO's clip drops it: [-1.2/6, ...], [2.4/4, ...]
    logps, old, adv, mask = worked_batch()
    logps.requires_grad_(True)
    for clip_high, loss_value, gradient in [
            (4.0, 0.0872080177, [[-0.25, -1 / 12, -1 / 6], [0.75, 0.25, 0.0]]),
            (0.2, 0.0466615185, [[-0.2, -1 / 12, -1 / 6], [0.6, 0.25, 0.0]])]:
        loss, metrics = policy_loss(logps, old, adv, mask, loss="cispo", clip_low=1.0, clip_high=clip_high)
        (grad,) = torch.autograd.grad(loss, logps)
        assert loss.item() == pytest.approx(loss_value, rel=1e-6)
        torch.testing.assert_close(grad, torch.tensor(gradient))
    (ppo_grad,) = torch.autograd.grad(policy_loss(logps, old, adv, mask, clip_high=0.2)[0], logps)
    assert ppo_grad[0, 0] == 0.0  # PPO: r = 1.5 > 1.2 with A > 0 is clipped, no gradient


def test_sapo_worked_numbers_and_gradients():
    # per token -sigmoid(tau (r - 1)) 4 / tau A, tau 1 for A > 0 and 1.05 for A < 0:
    #   seq 0 (A=+1): -4 sigmoid(0.5) = -2.4898373, -4 sigmoid(-0.5) = -1.5101627, -4 sigmoid(0) = -2: sum -6
    #   seq 1 (A=-2): 8 / 1.05 sigmoid(0.525) = 4.7871710, 8 / 1.05 sigmoid(-0.525) = 2.8318767: sum 8 / 1.05
    #   grpo aggregation: (-6 / 3 + 7.6190476 / 2) / 2 = 0.9047619
    #   d/d log pi = -A 4 sigmoid'(tau (r - 1)) r / (tokens) / 2: seq 0 token 0: -4 * 0.2350037 * 1.5 / 6 = -0.2350037
    logps, old, adv, mask = worked_batch()
    logps.requires_grad_(True)
    loss, _ = policy_loss(logps, old, adv, mask, loss="sapo")
    (grad,) = torch.autograd.grad(loss, logps)
    assert loss.item() == pytest.approx((-6 / 3 + 8 / 1.05 / 2) / 2, rel=1e-6)
    sig = torch.sigmoid(torch.tensor(0.5))
    assert grad[0, 0].item() == pytest.approx(-4 * float(sig * (1 - sig)) * 1.5 / 6, rel=1e-5)


def slow_surrogate(loss, r, rc, adv, logp, sapo):
    """One token's loss, straight from each paper."""
    if loss == "ppo_clip":
        return -torch.minimum(r * adv, rc * adv)
    if loss == "cispo":
        return -rc.detach() * adv * logp
    tau = sapo[0] if adv > 0 else sapo[1]
    return -torch.sigmoid(tau * (r - 1)) * 4 / tau * adv


@pytest.mark.parametrize("loss", ["cispo", "sapo"])
@pytest.mark.parametrize("level, aggregation", CASES)
def test_cispo_and_sapo_equal_the_slow_loop_values_and_gradients(loss, level, aggregation):
    logps, old, adv, mask, ref = random_batch(seed=zlib.crc32(f"{loss}/{level}/{aggregation}".encode()) % 1000)
    kwargs = dict(level=level, aggregation=aggregation, clip_low=0.1, clip_high=0.15, beta=0.05)
    whole, _ = policy_loss(logps, old, adv, mask, ref_logps=ref, max_completion_length=8, loss=loss,
                           sapo_temperatures=(0.9, 1.2), **kwargs)
    (grad,) = torch.autograd.grad(whole, logps)
    total = torch.zeros(())
    for i in range(logps.shape[0]):
        tokens = [t for t in range(logps.shape[1]) if mask[i, t]]
        mean_log_ratio = sum(logps[i, t] - old[i, t] for t in tokens) / len(tokens)
        seq = torch.zeros(())
        for t in tokens:
            r = torch.exp(mean_log_ratio if level == "sequence" else logps[i, t] - old[i, t])
            term = slow_surrogate(loss, r, torch.clamp(r, 0.9, 1.15), adv[i], logps[i, t], (0.9, 1.2))
            d = ref[i, t] - logps[i, t]
            seq = seq + term + 0.05 * (torch.exp(d) - d - 1)
        total = total + {"grpo": seq / len(tokens) / 7, "dapo": seq / int(mask.sum()), "dr_grpo": seq / (7 * 8)}[
            aggregation]
    (slow_grad,) = torch.autograd.grad(total, logps)
    torch.testing.assert_close(whole, total, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, slow_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss", ["cispo", "sapo"])
@pytest.mark.parametrize("level, aggregation", CASES)
def test_cispo_and_sapo_micro_batch_pieces_sum_to_the_whole(loss, level, aggregation):
    logps, old, adv, mask, ref = random_batch(seed=11, n=9, t=8)
    common = dict(level=level, aggregation=aggregation, beta=0.04, max_completion_length=8, loss=loss)
    whole, _ = policy_loss(logps, old, adv, mask, ref_logps=ref, **common)
    (whole_grad,) = torch.autograd.grad(whole, logps)
    pieces = sum(policy_loss(logps[rows], old[rows], adv[rows], mask[rows], ref_logps=ref[rows], num_sequences=9,
                             num_tokens=mask.sum(), **common)[0] for rows in (slice(0, 2), slice(2, 7), slice(7, 9)))
    (pieces_grad,) = torch.autograd.grad(pieces, logps)
    torch.testing.assert_close(pieces, whole, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(pieces_grad, whole_grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_on_policy_every_loss_has_the_policy_gradient(level):
    """With old = the policy's own log-probs (r = 1), PPO's clip, CISPO and SAPO all give -A grad log pi."""
    logps, _, adv, mask, _ = random_batch(seed=3)
    grads = {}
    for loss in ("ppo_clip", "cispo", "sapo"):
        value, _ = policy_loss(logps, logps.detach(), adv, mask, level=level, loss=loss)
        grads[loss] = torch.autograd.grad(value, logps)[0]
    torch.testing.assert_close(grads["cispo"], grads["ppo_clip"], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(grads["sapo"], grads["ppo_clip"], rtol=1e-6, atol=1e-8)


def my_ppo_clip(x):
    """A user's loss (tests/test_losses.py:my_ppo_clip): PPO's clip written again from its inputs."""
    o = x.objective
    return -torch.minimum(x.ratio * x.advantages, x.ratio.clamp(1 - o.clip_low, 1 + o.clip_high) * x.advantages)


def wrong_shape(x):
    return x.logps.sum(-1)


def test_a_users_loss_by_import_path_gets_the_inputs_and_the_trainer_aggregates_it():
    logps, old, adv, mask, ref = random_batch(seed=5)
    common = dict(aggregation="dapo", beta=0.04)
    ours, ours_metrics = policy_loss(logps, old, adv, mask, ref_logps=ref, **common)
    theirs, their_metrics = policy_loss(logps, old, adv, mask, ref_logps=ref, loss="tests/test_losses.py:my_ppo_clip",
                                        **common)
    torch.testing.assert_close(theirs, ours, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(theirs, logps)[0], torch.autograd.grad(ours, logps)[0])
    assert their_metrics == ours_metrics
    with pytest.raises(ValueError, match=r"training.loss=tests/test_losses.py:wrong_shape returned \(7,\); it must "
                                         r"return the loss of every token, a tensor of the log-probs' shape \(7, 6\)"):
        policy_loss(logps, old, adv, mask, loss="tests/test_losses.py:wrong_shape")


def test_the_entropy_bonus_subtracts_the_aggregated_entropy_and_its_gradient():
    """loss(entropy_coef=c) = loss(0) - c * the entropy aggregated like the loss; its gradient reaches the entropy."""
    logps, old, adv, mask, _ = random_batch(seed=9)
    entropy = (torch.rand(logps.shape) * 2).requires_grad_(True)
    base, _ = policy_loss(logps, old, adv, mask, aggregation="dapo")
    objective = Objective(aggregation="dapo", entropy_coef=0.01)
    with_bonus, _ = clipped_loss(objective, logps, old, adv, mask.bool(), entropy=entropy,
                                 denominators=Denominators(7, mask.sum(), 7))
    expected = base - 0.01 * entropy[mask.bool()].sum() / mask.sum()
    torch.testing.assert_close(with_bonus, expected)
    (entropy_grad,) = torch.autograd.grad(with_bonus, entropy)
    torch.testing.assert_close(entropy_grad, torch.where(mask.bool(), -0.01 / mask.sum(), 0.0))
    with pytest.raises(ValueError, match="entropy_coef > 0 needs the entropy"):
        clipped_loss(objective, logps, old, adv, mask.bool())


def test_the_trainers_entropy_bonus_is_the_plain_forwards_entropy_with_its_gradient():
    """micro_batch_loss with training.entropy_coef=0.1 on a tiny model: the loss and every parameter's
    gradient are those of entropy_coef=0 less 0.1 x the per-sequence mean entropy (grpo aggregation),
    the entropy computed from a plain forward's full softmax (no shared prefix, no chunks)."""
    import dataclasses

    from conftest import tiny_model
    from helpers import make_batch

    from grpo.config import load_config
    from grpo.trainer.training_step import micro_batch_loss

    model = tiny_model()
    batch = make_batch(seed=4, with_ref=False)
    batch = dataclasses.replace(batch, completion_ids=[c % 101 for c in batch.completion_ids],
                                prompt_ids=[p % 101 for p in batch.prompt_ids])
    common = ["training.beta=0", "sampling.temperature=1.0"]
    params = [p for p in model.parameters() if p.requires_grad]

    def loss_and_grads(cfg_args, extra=None):
        loss = micro_batch_loss(model, batch, load_config(None, [*common, *cfg_args]))[0]
        loss = loss if extra is None else loss + extra()
        return loss.detach(), torch.autograd.grad(loss, params)

    def minus_mean_entropy():  # the slow way: each completion after its prompt, one row each
        total, prompt_of = torch.zeros(()), [i for i, g in enumerate(batch.group_sizes) for _ in range(g)]
        for j, completion in enumerate(batch.completion_ids):
            prompt = batch.prompt_ids[prompt_of[j]]
            logits = model(torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1:-1].float()
            entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
            total = total + entropy.mean()
        return -0.1 * total / len(batch.completion_ids)

    with_bonus, bonus_grads = loss_and_grads(["training.entropy_coef=0.1"])
    expected, expected_grads = loss_and_grads([], minus_mean_entropy)
    torch.testing.assert_close(with_bonus, expected, rtol=1e-5, atol=1e-6)
    for got, want in zip(bonus_grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def detached(x):
    return my_ppo_clip(x).detach()


def as_integers(x):
    return my_ppo_clip(x).round().long()


def scales_the_advantages(x):
    x.advantages.mul_(10)  # a loss that writes into what it was given
    return my_ppo_clip(x)


def test_a_users_loss_without_the_log_probs_gradient_is_named_and_cannot_change_the_advantages():
    logps, old, adv, mask, _ = random_batch(seed=6)
    for name, words in (("detached", "torch.float32 tensor on cpu without a gradient"),
                        ("as_integers", "torch.int64 tensor on cpu without a gradient")):
        with pytest.raises(ValueError, match=rf"training.loss=tests/test_losses.py:{name} returned a {words}; it "):
            policy_loss(logps, old, adv, mask, loss=f"tests/test_losses.py:{name}")
    before = adv.clone()
    theirs, _ = policy_loss(logps, old, adv, mask, loss="tests/test_losses.py:scales_the_advantages")
    assert adv.tolist() == before.tolist()
    torch.testing.assert_close(theirs, policy_loss(logps, old, adv * 10, mask)[0])


def test_grpos_batches_record_no_estimator_so_batches_spooled_before_still_match():
    from grpo.config import load_config

    assert Objective.of(load_config(None, [])).header() == {"mask_truncated": False, "advantage_scale": "group"}
    assert Objective.of(load_config(None, ["training.advantage=rloo"])).header() == \
        {"mask_truncated": False, "advantage_scale": "group", "advantage": "rloo"}
