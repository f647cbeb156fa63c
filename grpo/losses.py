"""The GRPO / GSPO policy loss as one pure function of tensors.

GRPO (Shao et al. 2024): token ratio r_t = pi(y_t) / pi_old(y_t), PPO clipping, KL to the
reference. GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of the token
ratios, s = exp(mean_t log r_t), broadcast to the tokens with the gradient flowing to every
token. Only how the importance weight is formed differs, so it is a switch, not a second loss.
"""

from __future__ import annotations

import torch

LEVELS = ("token", "sequence")
AGGREGATIONS = ("grpo", "dapo", "dr_grpo")
KL_ESTIMATORS = ("k1", "k2", "k3")
MAX_LOG_RATIO = 20.0  # keeps exp() finite when the sampler's and trainer's numbers disagree wildly
# training.importance_sampling: how pi_proximal / pi_behaviour weighs each token's loss
IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def kl_per_token(ref_logps: torch.Tensor, logps: torch.Tensor, estimator: str) -> torch.Tensor:
    """KL(pi || pi_ref) estimates per token with d = log pi_ref - log pi (Schulman 2020)."""
    d = ref_logps - logps  # [N, T]
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return d.square() / 2
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}; got {estimator!r}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str, num_sequences: float,
              num_tokens: float, max_completion_length: float, num_completions: float) -> torch.Tensor:
    """Reduce [N, T] to a scalar with *global* denominators, so pieces of a batch sum to the whole.
    num_sequences / num_tokens count what the loss sees; num_completions counts every completion
    of the batch, masked ones too: dr_grpo's normaliser, constant like TRL's."""
    masked = torch.where(mask, per_token, 0.0)  # [N, T]
    if aggregation == "grpo":  # per-sequence token mean, then mean over sequences
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / num_sequences
    if aggregation == "dapo":  # every token of the batch weighs the same
        return masked.sum() / num_tokens
    if aggregation == "dr_grpo":  # constant normaliser: no length bias, whatever the mask drops
        return masked.sum() / (num_completions * max_completion_length)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}; got {aggregation!r}")


@torch.no_grad()
def behaviour_weights(prox_logps, behaviour_logps, mask, *, mode: str, cap: float, level: str = "token"):
    """The decoupled objective's importance weight pi_prox / pi_behaviour (AReaL), [N, T], no grad.

    token_*: one weight per token; sequence_*: one per completion, the product of its token ratios
    (GRPO, level="token") or their geometric mean (GSPO, level="sequence"), on each of its tokens.
    *_truncate caps the weight at `cap` (TIS); *_mask zeroes it above `cap` (MIS). Off the mask: 0.
    """
    if mode not in IS_MODES[1:]:
        raise ValueError(f"importance sampling mode must be one of {IS_MODES[1:]}; got {mode!r}")
    mask = mask.bool()
    log_w = torch.where(mask, prox_logps - behaviour_logps, 0.0)  # [N, T]
    if mode.startswith("sequence"):
        per_seq = log_w.sum(-1)  # [N]
        if level == "sequence":
            per_seq = per_seq / mask.sum(-1).clamp(min=1)
        log_w = per_seq[:, None].expand_as(log_w)  # [N, T]
    w = torch.exp(log_w.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [N, T]
    w = w.clamp(max=cap) if mode.endswith("truncate") else torch.where(w <= cap, w, 0.0)
    return torch.where(mask, w, 0.0)


def policy_loss(logps, old_logps, advantages, mask, *, ref_logps=None, level="token", aggregation="grpo",
                clip_low=0.2, clip_high=None, beta=0.0, kl_estimator="k3", num_sequences=None,
                num_tokens=None, max_completion_length=None, num_completions=None,
                is_weights=None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss plus beta * KL; logps, old_logps, ref_logps, mask: [N, T]; advantages: [N].

    num_sequences / num_tokens default to this call's counts; pass the whole batch's counts when
    the batch is split into micro-batches or ranks. max_completion_length defaults to T.
    num_completions: the batch's completions, those masked out (mask_truncated_completions) too;
    dr_grpo divides by it times max_completion_length (default: num_sequences).
    is_weights [N, T] (`behaviour_weights`): the decoupled objective, where old_logps are the
    proximal policy's and each token's surrogate is weighed by pi_prox / pi_behaviour.
    """
    if level not in LEVELS:
        raise ValueError(f"level must be one of {LEVELS}; got {level!r}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps")
    mask = mask.bool()  # [N, T]
    clip_high = clip_low if clip_high is None else clip_high
    num_sequences = mask.shape[0] if num_sequences is None else num_sequences
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    max_completion_length = mask.shape[1] if max_completion_length is None else max_completion_length
    num_completions = num_sequences if num_completions is None else num_completions

    log_ratio = torch.where(mask, logps - old_logps, 0.0)  # [N, T]
    if level == "sequence":
        seq_log_ratio = log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)  # [N]
        log_ratio = seq_log_ratio[:, None].expand_as(log_ratio)  # [N, T]
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [N, T]
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)  # [N, T]
    adv = advantages.to(ratio.dtype)[:, None]  # [N, 1]
    per_token = -torch.minimum(ratio * adv, clipped * adv)  # [N, T]
    if is_weights is not None:
        per_token = per_token * is_weights  # [N, T]
    counts = (num_sequences, num_tokens, max_completion_length, num_completions)
    policy = aggregate(per_token, mask, aggregation, *counts)

    kl = None
    if ref_logps is not None:
        # zeroed off the mask before subtracting: padding may hold -inf, and inf - inf in the
        # forward would turn into NaN gradients even where the mask drops the value
        kl = kl_per_token(torch.where(mask, ref_logps, 0.0), torch.where(mask, logps, 0.0), kl_estimator)  # [N, T]
    loss = policy
    if beta > 0:
        loss = policy + beta * aggregate(kl, mask, aggregation, *counts)

    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        r = ratio[mask]
        low = (ratio < 1 - clip_low) & (adv < 0) & mask  # [N, T] clipped from below
        high = (ratio > 1 + clip_high) & (adv > 0) & mask  # [N, T] clipped from above
        metrics = {
            "policy_loss": policy.item(),
            "clip_ratio/low_mean": (low.sum() / n).item(),
            "clip_ratio/high_mean": (high.sum() / n).item(),
            "clip_ratio/region_mean": ((low | high).sum() / n).item(),
            "ratio/mean": r.mean().item() if r.numel() else 1.0,
            "ratio/min": r.min().item() if r.numel() else 1.0,
            "ratio/max": r.max().item() if r.numel() else 1.0,
        }
        if kl is not None:
            metrics["kl"] = (kl[mask].sum() / n).item()
        if is_weights is not None:
            w = is_weights[mask]
            metrics["importance_sampling/weight_mean"] = w.mean().item() if w.numel() else 1.0
            metrics["importance_sampling/zero_fraction"] = (w == 0).float().mean().item() if w.numel() else 0.0
    return loss, metrics
