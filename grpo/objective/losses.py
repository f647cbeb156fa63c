"""Policy losses per token (training.loss): PPO's clipped surrogate, CISPO, SAPO, or a user's function.
Each is a pure function of `LossInputs` returning the loss of every token, [N, T]; the objective then
weighs it (the decoupled objective's importance weights), aggregates it with the batch's global
denominators, and adds the KL term and the entropy bonus, whichever loss it is.

- ppo_clip (GRPO, Shao et al. 2024; PPO): -min(r A, clip(r, 1 - low, 1 + high) A).
- cispo (MiniMax-M1, 2025): -sg(clip(r, 1 - low, 1 + high)) A log pi: the clipped ratio, detached, weighs
  the log-prob's gradient, so no token's gradient is dropped (PPO's clip drops those outside the band).
- sapo (Gao et al. 2025, Soft Adaptive Policy Optimization): -sigma(tau (r - 1)) 4 / tau A, tau the
  temperature of positive or of negative advantages: a smooth gate in place of the hard clip.
All three have the gradient -A grad log pi on-policy (r = 1): they differ only off-policy.
r is the importance ratio at the objective's level (GSPO: the sequence's geometric mean on each token).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import torch

if TYPE_CHECKING:
    from grpo.objective import Objective


class LossInputs(NamedTuple):
    """What a policy loss is given; every tensor [N, T] but the advantages, [N, 1] (per sample), or [N, T]
    with distillation (per token)."""

    logps: torch.Tensor  # the policy's log-probs, with grad
    old_logps: torch.Tensor  # what the ratio is against: the sampler's (or, decoupled, this forward's own)
    ratio: torch.Tensor  # exp(logps - old_logps) at the objective's level, with grad
    advantages: torch.Tensor  # [N, 1], or [N, T] with distill.teacher
    mask: torch.Tensor  # bool: the tokens the loss sees
    ref_logps: torch.Tensor | None  # the reference policy's (with beta > 0)
    token_versions: torch.Tensor | None  # int: the weights version that sampled each token (-1: not the model's)
    objective: Objective  # every setting of the loss (clip range, SAPO's temperatures, ...)


def ppo_clip_loss(x: LossInputs) -> torch.Tensor:
    o = x.objective
    clipped = x.ratio.clamp(1 - o.clip_low, 1 + o.clip_high)  # [N, T]
    return -torch.minimum(x.ratio * x.advantages, clipped * x.advantages)  # [N, T]


def cispo_loss(x: LossInputs) -> torch.Tensor:
    o = x.objective
    weight = x.ratio.clamp(1 - o.clip_low, 1 + o.clip_high).detach()  # [N, T]
    return -weight * x.advantages * x.logps  # [N, T]


def sapo_loss(x: LossInputs) -> torch.Tensor:
    positive, negative = x.objective.sapo_temperatures
    tau = torch.where(x.advantages > 0, positive, negative)  # [N, 1]
    return -torch.sigmoid(tau * (x.ratio - 1)) * (4 / tau) * x.advantages  # [N, T]


LOSSES: dict[str, Callable[[LossInputs], torch.Tensor]] = {"ppo_clip": ppo_clip_loss, "cispo": cispo_loss,
                                                            "sapo": sapo_loss}


def per_token_loss(name: str, inputs: LossInputs) -> torch.Tensor:
    """The loss `name` (training.loss) of every token, [N, T]. A user's loss by import path is called
    as fn(inputs) and must return a tensor of the log-probs' shape, finite on the mask."""
    if name in LOSSES:
        return LOSSES[name](inputs)
    from grpo.common.imports import import_object

    found = import_object(name, "training.loss")(inputs._replace(advantages=inputs.advantages.clone()))
    if not isinstance(found, torch.Tensor) or found.shape != inputs.logps.shape:
        shape = tuple(found.shape) if isinstance(found, torch.Tensor) else type(found).__name__
        raise ValueError(f"training.loss={name} returned {shape}; it must return the loss of every token, a tensor "
                         f"of the log-probs' shape {tuple(inputs.logps.shape)}")
    if not found.is_floating_point() or found.device != inputs.logps.device or \
            (inputs.logps.requires_grad and not found.requires_grad):
        raise ValueError(f"training.loss={name} returned a {found.dtype} tensor on {found.device}"
                         f"{' without a gradient' if not found.requires_grad else ''}; it must return floats on the "
                         f"log-probs' device ({inputs.logps.device}) computed from them (logps or ratio), so that "
                         "the loss has their gradient")
    return found  # [N, T]
