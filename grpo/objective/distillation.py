"""On-policy distillation (distill.teacher): the student samples, a teacher scores every sampled token, and
each token's advantage is the negative per-token reverse KL, coef x (log pi_teacher - log pi_sampled)
(Agarwal et al. 2024, GKD; Lu & Thinking Machines 2025, "On-Policy Distillation"). A token the teacher
finds likelier than the student did is pushed up, one it finds less likely pushed down; the sum over a
completion is an estimate of -KL(pi_student || pi_teacher) on what the student actually wrote.
"""

from __future__ import annotations

import torch


def token_advantages(advantages: torch.Tensor, teacher_logps: torch.Tensor | None, behaviour_logps: torch.Tensor,
                     mask: torch.Tensor, coef: float, with_rewards: bool) -> torch.Tensor:
    """Each token's advantage: [N, 1] (the sample's, broadcast) without a teacher (coef 0); with one, [N, T]:
    coef x (teacher - behaviour) on the mask, plus the sample's advantage with `with_rewards`.
    advantages: [N]; teacher_logps, behaviour_logps, mask: [N, T]."""
    sample = advantages[:, None]  # [N, 1]
    if coef == 0:
        return sample
    if teacher_logps is None:
        raise ValueError("distill.teacher is set but the batch carries no teacher log-probs (teacher_logps)")
    # zeroed off the mask before subtracting: padding may hold -inf
    signal = coef * (torch.where(mask, teacher_logps, 0.0) - torch.where(mask, behaviour_logps, 0.0))  # [N, T]
    return signal + sample if with_rewards else signal


@torch.no_grad()
def reverse_kl(teacher_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean over the mask of log pi_sampled - log pi_teacher: the sampled tokens' estimate of
    KL(pi_student || pi_teacher) per token (0 when the student writes as the teacher would)."""
    d = (behaviour_logps - teacher_logps)[mask]  # [tokens]
    return d.mean().item() if d.numel() else 0.0
