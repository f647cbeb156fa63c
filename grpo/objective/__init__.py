"""The objective: what the loss optimises, decided once from the config, carried in every batch
header, used by the sampler for the loss's tokens and denominators and by the trainer for the loss.

GRPO (Shao et al. 2024): token ratio r_t = pi(y_t) / pi_old(y_t), PPO clipping, KL to the
reference. GSPO (Zheng et al. 2025): one ratio per sequence, the geometric mean of the token
ratios, s = exp(mean_t log r_t), broadcast to the tokens with the gradient flowing to every
token. Only how the importance weight is formed differs, so it is a switch, not a second loss.
The decoupled objective (AReaL; training.importance_sampling) clips against the trainer's own
pre-update log-probs and weighs each token by pi_proximal / pi_behaviour. The loss of each token is
training.loss's (grpo/objective/losses.py: PPO's clip, CISPO, SAPO or a user's), the advantages
training.advantage's (grpo/objective/advantages.py). docs/objective.md has the worked numbers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from grpo.objective.distillation import reverse_kl, token_advantages
from grpo.objective.losses import LossInputs, per_token_loss
from grpo.settings import clip_range
from grpo.settings.choices import (
    ADVANTAGE_ESTIMATORS,
    ADVANTAGE_SCALES,
    AGGREGATIONS,
    IS_MODES,
    KL_ESTIMATORS,
    KL_PLACES,
    POLICY_LOSSES,
    name_or_import_path_problem,
)

if TYPE_CHECKING:
    from grpo.settings import Config

LEVELS = ("token", "sequence")
MAX_LOG_RATIO = 20.0  # keeps exp() finite when the sampler's and trainer's numbers disagree wildly

# the loss's metrics: summed over micro-batches and ranks weighted by loss tokens, except these
ADDITIVE = ("loss", "policy_loss")  # computed with global denominators: the pieces sum to the whole's value
EXTREMES = {"ratio/min": "min", "ratio/max": "max"}  # reduced by min / max
LOSS_METRICS = ("loss", "policy_loss", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
                "clip_ratio/region_mean", "ratio/mean")
KL_METRICS = ("kl",)  # with beta > 0
IS_METRICS = ("importance_sampling/weight_mean", "importance_sampling/zero_fraction")  # decoupled only
DISTILL_METRICS = ("distill/reverse_kl",)  # with a teacher


@dataclass(frozen=True)
class Objective:
    """Every setting of the loss, resolved (GSPO's clip defaults filled in)."""

    level: str = "token"  # "token" (GRPO) or "sequence" (GSPO): how the importance ratio is formed
    clip_low: float = 0.2
    clip_high: float = 0.2
    beta: float = 0.0  # KL coefficient to the reference policy
    kl_estimator: str = "k3"
    kl_in: str = "loss"  # "loss": beta x KL in the loss; "reward": in each completion's score (the sampler's)
    aggregation: str = "grpo"  # grpo, dapo or dr_grpo
    importance_sampling: str = "none"  # the decoupled objective's weight (IS_MODES)
    importance_sampling_cap: float = 2.0
    mask_truncated: bool = False  # completions cut at the token budget leave the loss
    advantage_scale: str = "group"
    max_completion_length: int | None = None  # dr_grpo's normaliser (None: the batch's padded length)
    advantage: str = "grpo"  # the estimator (ADVANTAGE_ESTIMATORS) or a user's by import path
    loss: str = "ppo_clip"  # the policy loss per token (POLICY_LOSSES) or a user's by import path
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)  # SAPO's tau for positive, negative advantages
    entropy_coef: float = 0.0  # the entropy bonus's weight
    distill_coef: float = 0.0  # the teacher's per-token signal's weight (0: no teacher)
    distill_with_rewards: bool = False  # with a teacher: the rewards' advantage added to its signal

    def __post_init__(self):
        for name, options in (("level", LEVELS), ("aggregation", AGGREGATIONS), ("kl_estimator", KL_ESTIMATORS),
                              ("kl_in", KL_PLACES),
                              ("importance_sampling", IS_MODES), ("advantage_scale", ADVANTAGE_SCALES)):
            if getattr(self, name) not in options:
                raise ValueError(f"{name} must be one of {options}; got {getattr(self, name)!r}")
        for name, options in (("advantage", ADVANTAGE_ESTIMATORS), ("loss", POLICY_LOSSES)):
            problem = name_or_import_path_problem(name, getattr(self, name), options)
            if problem:
                raise ValueError(problem)

    @classmethod
    def of(cls, cfg: Config) -> "Objective":
        training = cfg.training
        clip_low, clip_high = clip_range(training.use_gspo, training.clip_low, training.clip_high, training.loss)
        return cls(level="sequence" if training.use_gspo else "token", clip_low=clip_low, clip_high=clip_high,
                   beta=training.beta, kl_estimator=training.kl_estimator, kl_in=training.kl_in,
                   aggregation=training.aggregation, importance_sampling=training.importance_sampling,
                   importance_sampling_cap=training.importance_sampling_cap,
                   mask_truncated=training.mask_truncated_completions,
                   advantage_scale=training.advantage_scale, max_completion_length=cfg.sampling.max_new_tokens,
                   advantage=training.advantage, loss=training.loss,
                   sapo_temperatures=(training.sapo_temperature_pos, training.sapo_temperature_neg),
                   entropy_coef=training.entropy_coef,
                   distill_coef=cfg.distill.coef if cfg.distill.teacher else 0.0,
                   distill_with_rewards=cfg.distill.with_rewards)

    @property
    def decoupled(self) -> bool:
        return self.importance_sampling != "none"

    def header(self) -> dict:
        """What a batch header records (grpo/wire/behaviour.py): the settings the sampler made the batch
        for (which tokens the loss sees, so its denominators, and the advantages' scale). The loss's
        own settings (clip, KL, aggregation, importance sampling) are the trainer's: a run resumed
        with other ones still trains on the batches made before."""
        header = {"mask_truncated": self.mask_truncated, "advantage_scale": self.advantage_scale}
        # grpo's batches record no estimator: those spooled before the choice existed still match
        return header if self.advantage == "grpo" else {**header, "advantage": self.advantage}

    def metric_names(self) -> list[str]:
        """The summed metrics of this objective's loss, the same on every rank (the extremes apart)."""
        return [*LOSS_METRICS, *(KL_METRICS if self.beta > 0 else ()), *(IS_METRICS if self.decoupled else ()),
                *(DISTILL_METRICS if self.distill_coef > 0 else ())]


class Denominators(NamedTuple):
    """The whole batch's counts, so that micro-batches and ranks sum to the whole batch's loss."""

    sequences: float  # completions the loss sees
    tokens: float  # their loss tokens
    completions: float  # every completion of the batch, masked ones too (dr_grpo's normaliser, as TRL's)


def batch_denominators(objective: Objective, completion_ids, truncated, model_masks=None) -> Denominators:
    """The whole batch's counts, from its completions: the loss tokens (with episodes' or an age
    bound's `model_masks`, only the tokens they keep), the completions with any of them, and every
    completion (dr_grpo's normaliser)."""
    keep = [not (objective.mask_truncated and bool(t)) for t in truncated]
    sizes = [int(m.sum()) for m in model_masks] if model_masks is not None else [len(c) for c in completion_ids]
    return Denominators(sequences=sum(1 for size, k in zip(sizes, keep) if k and size > 0),
                        tokens=sum(size for size, k in zip(sizes, keep) if k), completions=len(completion_ids))


def loss_mask(objective: Objective, mask: torch.Tensor, truncated: torch.Tensor,
              model_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The tokens the loss sees, [N, T]: real tokens, less truncated completions when they are masked,
    less an episode's environment tokens (context, not the policy's actions)."""
    mask = mask & ~truncated.bool()[:, None] if objective.mask_truncated else mask  # [N, T]
    return mask if model_mask is None else mask & model_mask  # [N, T]


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
    if aggregation == "grpo":  # per-sequence token mean, then mean over sequences (none seen: a zero loss)
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1)).sum() / max(num_sequences, 1)
    if aggregation == "dapo":  # every token of the batch weighs the same
        return masked.sum() / max(num_tokens, 1)
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


def policy_loss(objective: Objective, logps, behaviour_logps, advantages, mask, *, ref_logps=None,
                denominators: Denominators | None = None, entropy=None, token_versions=None,
                teacher_logps=None) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective's loss: logps (with grad), behaviour_logps (the sampler's), ref_logps, mask, entropy (with
    grad, for the entropy bonus), token_versions, teacher_logps (distillation): [N, T]; advantages: [N].
    Decoupled: the ratio is against this forward's own log-probs (the proximal policy: num_iterations is 1)
    and each token weighed by pi_proximal / pi_behaviour; else the ratio is against the behaviour's. With a
    teacher, each token's advantage is its signal against the behaviour's log-probs (what sampled it)."""
    mask = mask.bool()
    advantages = token_advantages(advantages, teacher_logps, behaviour_logps, mask, objective.distill_coef,
                                  objective.distill_with_rewards)  # [N, 1] or [N, T]
    proximal, weights = behaviour_logps, None
    if objective.decoupled:
        proximal = logps.detach()  # [N, T]
        weights = behaviour_weights(proximal, behaviour_logps, mask, mode=objective.importance_sampling,
                                    cap=objective.importance_sampling_cap, level=objective.level)  # [N, T]
    loss, metrics = clipped_loss(objective, logps, proximal, advantages, mask, ref_logps=ref_logps,
                                 denominators=denominators, is_weights=weights, entropy=entropy,
                                 token_versions=token_versions)
    if objective.distill_coef > 0:
        metrics["distill/reverse_kl"] = reverse_kl(teacher_logps, behaviour_logps, mask)
    return loss, metrics


def clipped_loss(objective: Objective, logps, old_logps, advantages, mask, *, ref_logps=None,
                 denominators: Denominators | None = None, is_weights=None, entropy=None,
                 token_versions=None) -> tuple[torch.Tensor, dict[str, float]]:
    """training.loss per token, weighed by `is_weights` [N, T] where given, plus beta * KL, less
    entropy_coef * the entropy; logps, old_logps, ref_logps, mask, entropy: [N, T]; advantages: [N], or per
    token, [N, 1] or [N, T].
    `denominators` default to this call's own counts."""
    o = objective
    if o.beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps")
    mask = mask.bool()  # [N, T]
    d = denominators or Denominators(mask.shape[0], mask.sum(), mask.shape[0])
    counts = (d.sequences, d.tokens, o.max_completion_length or mask.shape[1], d.completions)
    log_ratio = torch.where(mask, logps - old_logps, 0.0)  # [N, T]
    if o.level == "sequence":
        log_ratio = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1))[:, None].expand_as(log_ratio)  # [N, T]
    ratio = torch.exp(log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [N, T]
    adv = advantages.to(ratio.dtype)
    adv = adv[:, None] if adv.dim() == 1 else adv  # [N, 1] or [N, T] (per token: distillation)
    per_token = per_token_loss(o.loss, LossInputs(logps, old_logps, ratio, adv, mask, ref_logps, token_versions, o))
    if is_weights is not None:
        per_token = per_token * is_weights  # [N, T]
    policy = aggregate(per_token, mask, o.aggregation, *counts)  # []
    # zeroed off the mask before subtracting: padding may hold -inf, and inf - inf in the forward
    # would turn into NaN gradients even where the mask drops the value
    kl = None if ref_logps is None else \
        kl_per_token(torch.where(mask, ref_logps, 0.0), torch.where(mask, logps, 0.0), o.kl_estimator)  # [N, T]
    # kl_in=reward: the KL is in the advantages already (grpo/objective/kl_reward.py); only its metric here
    in_loss = o.beta > 0 and o.kl_in == "loss"
    loss = policy + o.beta * aggregate(kl, mask, o.aggregation, *counts) if in_loss else policy  # []
    if o.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy (with grad)")
        loss = loss - o.entropy_coef * aggregate(torch.where(mask, entropy, 0.0), mask, o.aggregation, *counts)
    return loss, loss_metrics(o, policy, ratio, adv, mask, kl, is_weights)


@torch.no_grad()
def loss_metrics(o: Objective, policy, ratio, adv, mask, kl, is_weights) -> dict[str, float]:
    n = mask.sum().clamp(min=1)
    r = ratio[mask]  # [tokens]
    low = (ratio < 1 - o.clip_low) & (adv < 0) & mask  # [N, T] clipped from below
    high = (ratio > 1 + o.clip_high) & (adv > 0) & mask  # [N, T] clipped from above
    metrics = {"policy_loss": policy.item(),
               "clip_ratio/low_mean": (low.sum() / n).item(),
               "clip_ratio/high_mean": (high.sum() / n).item(),
               "clip_ratio/region_mean": ((low | high).sum() / n).item(),
               "ratio/mean": r.mean().item() if r.numel() else 1.0,
               "ratio/min": r.min().item() if r.numel() else 1.0,
               "ratio/max": r.max().item() if r.numel() else 1.0}
    if kl is not None:
        metrics["kl"] = (kl[mask].sum() / n).item()
    if is_weights is not None:
        w = is_weights[mask]  # [tokens]
        metrics["importance_sampling/weight_mean"] = w.mean().item() if w.numel() else 1.0
        metrics["importance_sampling/zero_fraction"] = (w == 0).float().mean().item() if w.numel() else 0.0
    return metrics
