"""The trainer's steps as small functions: micro-batch loss, metric reduction, DeepSpeed config."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from grpo.model.logprobs import completion_logprobs, pad_right
from grpo.model.sharding import pack_micro_batches, shard_groups
from grpo.model.vision import batch_prompt_images
from grpo.objective import ADDITIVE, Denominators, Objective, batch_denominators, loss_mask, policy_loss
from grpo.objective import EXTREMES as LOSS_EXTREMES
from grpo.trainer.groups import group_costs, select_groups
from grpo.trainer.schedule import learning_rate_at
from grpo.wire.batch import RolloutBatch

if TYPE_CHECKING:
    from grpo.settings import Config, TrainingConfig

# sampler/trainer mismatch on the first pass, before any update of this step (TRL's names)
MISMATCH_MEANS = ("sampling/sampling_logp_difference/mean", "sampling/importance_sampling_ratio/mean")
REDUCE_OPS = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
EXTREMES = {**{key: REDUCE_OPS[how] for key, how in LOSS_EXTREMES.items()},
            "sampling/sampling_logp_difference/max": dist.ReduceOp.MAX,
            "sampling/importance_sampling_ratio/min": dist.ReduceOp.MIN,
            "sampling/importance_sampling_ratio/max": dist.ReduceOp.MAX}


def within_age(batch: RolloutBatch, trainer_version: int, max_age: int) -> tuple[RolloutBatch, float]:
    """training.max_token_age: `batch` with its model tokens sampled more than `max_age` versions before
    `trainer_version` out of the loss (they stay as context; the denominators, counted from the model
    mask, leave them out too); and the share of its model tokens left out. The batch itself when none
    is that old."""
    versions = batch.token_versions
    model = [v >= 0 for v in versions]  # environment tokens carry no version and are out of the loss already
    young = [m & (trainer_version - v <= max_age) for m, v in zip(model, versions)]
    total, kept = sum(int(m.sum()) for m in model), sum(int(y.sum()) for y in young)
    if kept == total:
        return batch, 0.0
    return dataclasses.replace(batch, model_mask=young), (total - kept) / max(total, 1)


def denominators_of(batch: RolloutBatch, objective: Objective) -> Denominators:
    """The whole batch's loss denominators (every rank holds the whole batch, so each counts alike)."""
    return batch_denominators(objective, batch.completion_ids, batch.truncated, batch.model_mask)


def micro_batch_loss(model, mb: RolloutBatch, cfg: Config, first_pass: bool = True,
                     denominators: Denominators | None = None, objective: Objective | None = None
                     ) -> tuple[torch.Tensor, dict[str, float], int]:
    """Loss of one micro-batch with the whole batch's denominators; (loss, metrics, loss tokens).
    denominators: the whole batch's (default: `mb` is the whole batch); objective: default the
    config's. On the first pass the metrics include the sampler/trainer mismatch."""
    training, objective = cfg.training, objective or Objective.of(cfg)
    logps, entropies = completion_logprobs(model, mb.prompt_ids, mb.completion_ids, mb.group_sizes,
                                           shared_prefix=training.shared_prefix, temperature=cfg.sampling.temperature,
                                           return_entropy="grad" if objective.entropy_coef > 0 else True,
                                           max_tokens_per_forward=training.max_tokens_per_micro_batch,
                                           segments=mb.segments, images=batch_prompt_images(mb))
    device = logps[0].device
    new, mask = pad_right(logps)  # [n, T]
    old = pad_right([x.to(device) for x in mb.old_logps])[0] if mb.old_logps is not None else new.detach()
    ref_logps = mb.ref_logps
    if ref_logps is None and objective.beta > 0 and training.reference_on == "trainer":
        ref_logps = reference_logps(model, mb, cfg)
    ref = pad_right([x.to(device) for x in ref_logps])[0] if ref_logps is not None else None
    model_mask = pad_right([m.to(device) for m in mb.model_mask], value=False)[0] if mb.model_mask is not None else None
    mask = loss_mask(objective, mask, mb.truncated.to(device), model_mask)
    counts = denominators or denominators_of(mb, objective)
    denominators = Denominators(max(1, counts.sequences), max(1, counts.tokens), counts.completions)
    entropy = pad_right(entropies)[0]  # [n, T], with grad for the entropy bonus
    versions = pad_right([v.to(device) for v in mb.token_versions], value=-1)[0] \
        if mb.token_versions is not None else None
    teacher = pad_right([x.to(device) for x in mb.teacher_logps])[0] if mb.teacher_logps is not None else None
    loss, metrics = policy_loss(objective, new, old, mb.advantages.to(device), mask, ref_logps=ref,
                                denominators=denominators, entropy=entropy, token_versions=versions,
                                teacher_logps=teacher)
    tokens = int(mask.sum())
    metrics["entropy"] = (entropy.detach()[mask].sum() / max(tokens, 1)).item()
    metrics["loss"] = loss.item()
    if first_pass and mb.old_logps is not None:
        metrics.update(mismatch_metrics(new.detach(), old, mask))
    return loss, metrics, tokens


@torch.no_grad()
def mismatch_metrics(trainer_logps: torch.Tensor, behaviour_logps: torch.Tensor, mask: torch.Tensor) -> dict:
    """|behaviour log-prob - trainer log-prob| and the ratio pi_trainer / pi_behaviour over the loss
    tokens, in TRL's names. The trainer's log-probs are those of its forward before this step's update
    (the proximal policy): at staleness 0 the gap is the engine/trainer mismatch alone; at staleness s
    it also holds s versions of policy change."""
    log_ratio = (trainer_logps - behaviour_logps)[mask]  # [tokens]
    if log_ratio.numel() == 0:
        return {}
    ratio = log_ratio.exp()
    return {"sampling/sampling_logp_difference/mean": log_ratio.abs().mean().item(),
            "sampling/sampling_logp_difference/max": log_ratio.abs().max().item(),
            "sampling/importance_sampling_ratio/mean": ratio.mean().item(),
            "sampling/importance_sampling_ratio/min": ratio.min().item(),
            "sampling/importance_sampling_ratio/max": ratio.max().item()}


def reference_logps(model, mb: RolloutBatch, cfg: Config) -> list[torch.Tensor]:
    """The reference policy's log-probs (the LoRA adapter off, no grad), computed here when the
    sampler leaves them to the trainer (training.reference_on=trainer)."""
    training = cfg.training
    with torch.no_grad(), model.disable_adapter():
        return completion_logprobs(model, mb.prompt_ids, mb.completion_ids, mb.group_sizes,
                                   shared_prefix=training.shared_prefix, temperature=cfg.sampling.temperature,
                                   max_tokens_per_forward=training.max_tokens_per_micro_batch, segments=mb.segments,
                                   images=batch_prompt_images(mb))


class PolicyObjective(torch.nn.Module):
    """The policy with the GRPO/GSPO loss as its forward: what `deepspeed.initialize` wraps.

    Every micro-batch then runs through `engine(...)`, where DeepSpeed does per-forward
    bookkeeping; ZeRO-3 counts accumulation micro-steps there, and a forward that bypassed
    the engine made it overwrite the earlier micro-batches' gradients instead of adding them.
    `mb=None` is the zero-loss forward of a rank with fewer micro-batches than the others.
    """

    def __init__(self, policy: torch.nn.Module, cfg: Config, objective: Objective | None = None):
        super().__init__()
        self.policy, self.cfg, self.objective = policy, cfg, objective or Objective.of(cfg)

    def forward(self, mb: RolloutBatch | None, batch: RolloutBatch, first_pass: bool = True,
                denominators: Denominators | None = None):
        if mb is None:
            return dummy_loss(self.policy, batch, self.cfg), {}, 0
        return micro_batch_loss(self.policy, mb, self.cfg, first_pass,
                                denominators or denominators_of(batch, self.objective),
                                objective=self.objective)


def dummy_loss(model, batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """A zero loss over one completion token on the run's own path (training.shared_prefix), for a rank
    with fewer micro-batches than the others: every rank then runs the same forwards and backwards,
    as ZeRO-2/3 collectives require. With images, a prompt's whole with them: a trained vision
    encoder (model.train_vision) gets its gradients on this rank too, or ZeRO-1/2's reduction would
    not line up across ranks."""
    images = batch_prompt_images(batch) or []
    at = next((i for i, own in enumerate(images) if own is not None), None)
    if at is not None:
        prompt, images = batch.prompt_ids[at], images[at:at + 1]
    else:
        prompt, images = batch.prompt_ids[0][:1], None
    training = cfg.training
    logps = completion_logprobs(model, [prompt], [batch.completion_ids[0][:1]], [1],
                                shared_prefix=training.shared_prefix, temperature=cfg.sampling.temperature,
                                max_tokens_per_forward=training.max_tokens_per_micro_batch, images=images)
    return logps[0].sum() * 0.0


def clips_itself(cfg: Config) -> bool:
    """Plain float32 ZeRO-0: DeepSpeed would clip without reporting the norm, so SkippingAdamW clips."""
    return cfg.deepspeed.zero_stage == 0 and cfg.model.dtype == "float32"


class SkippingAdamW(torch.optim.AdamW):
    """AdamW that skips a step (no update, moments untouched) when any rank saw a non-finite
    loss (`skip_next`, set by train_step) or holds a non-finite gradient.

    With `clip_norm` it also clips the gradients (what DeepSpeed's plain float32 ZeRO-0 would
    do without reporting the norm) and keeps their total norm in `grad_norm`; the norm is
    checked before clipping, which would otherwise turn an inf norm into zero gradients. It
    clips inside `step`, not in a step hook: torch runs an instance's hooks again when a
    subclass's step calls AdamW.step, once any plain AdamW exists in the process.
    DeepSpeed calls this step on every rank at once (each on its partition under ZeRO), so
    the ranks agree by an all-reduce and skip together. ZeRO-1/2/3 skip an overflowing step
    themselves and then never call it: `skipped` stays None, which train_step reads as skipped.
    """

    def __init__(self, params, *, clip_norm: float | None = None, **kwargs):
        super().__init__(params, **kwargs)
        self.clip_norm, self.grad_norm = clip_norm, float("nan")
        self.skip_next = False
        self.skipped: bool | None = None

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"]]
        with_grad = [p for p in params if p.grad is not None]
        if self.clip_norm is not None:
            limit = self.clip_norm if self.clip_norm > 0 else float("inf")
            self.grad_norm = float(torch.nn.utils.clip_grad_norm_(with_grad, limit))  # the norm before clipping
            finite = math.isfinite(self.grad_norm)
        else:
            finite = all(bool(torch.isfinite(n)) for n in torch._foreach_norm([p.grad for p in with_grad]))
        bad = torch.tensor([float(self.skip_next or not finite)], device=params[0].device)
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        self.skipped = bool(bad.item())
        return None if self.skipped else super().step(closure)


def make_optimizer(params, cfg: Config) -> SkippingAdamW:
    return SkippingAdamW(params, lr=cfg.training.learning_rate, weight_decay=cfg.training.weight_decay,
                         clip_norm=cfg.training.max_grad_norm if clips_itself(cfg) else None)


def train_step(engine, batch: RolloutBatch, cfg: Config, rank: int, world: int, device,
               updates: int = 0) -> dict[str, float]:
    """One optimizer update per pass over `batch` on this rank's share of it; the reduced metrics.
    `updates`: those applied before (the learning-rate clock); each pass sets its own rate, and
    "optimizer_updates" says how many passes applied theirs (a skipped pass does not count).

    `engine` wraps a `PolicyObjective`. Every rank runs the same number of micro-batches (a
    short rank pads with zero-loss ones), and the accumulation boundary is set by hand: only
    the last backward of a pass reduces (ZeRO-2/3 reduce-scatter along the way, as in plain
    accumulation). Each loss already carries the whole batch's denominators and is multiplied
    by the world size, which undoes DeepSpeed's mean over ranks: the update is the whole batch's.
    Every rank counts the denominators from the whole batch it holds.
    """
    objective = engine.module.objective  # the PolicyObjective's, built once
    denominators = denominators_of(batch, objective)
    costs = group_costs(batch)
    micro = pack_micro_batches(shard_groups(costs, world)[rank], costs, cfg.training.max_tokens_per_micro_batch)
    count = torch.tensor([len(micro)], device=device)
    if dist.is_initialized():
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    sums = MetricSums()
    optimizer, skipped, applied, learning_rate = base_optimizer(engine), False, 0, float("nan")
    forward_backward_s = optimizer_s = 0.0
    for pass_index in range(cfg.training.num_iterations):  # each pass re-forwards; old log-probs stay the sampler's
        t = time.perf_counter()
        for i in range(int(count)):
            engine.set_gradient_accumulation_boundary(i == int(count) - 1)  # reduce after the last one only
            loss, metrics, tokens = engine(select_groups(batch, micro[i]) if i < len(micro) else None, batch,
                                           pass_index == 0, denominators)
            if metrics:  # not a padding forward
                sums.add(metrics, tokens)
            if not torch.isfinite(loss):
                optimizer.skip_next = True
            engine.backward(loss * world)
        forward_backward_s += time.perf_counter() - t
        t = time.perf_counter()
        optimizer.skipped = None
        learning_rate = set_learning_rate(engine, cfg.training, updates + applied)
        engine.step()
        optimizer_s += time.perf_counter() - t
        pass_skipped = optimizer.skipped is not False  # None: DeepSpeed skipped it (an overflow)
        skipped, applied = skipped or pass_skipped, applied + (not pass_skipped)
        optimizer.skip_next = False
    metrics = sums.reduce(metric_keys(objective), cfg.training.num_iterations, device)
    grad_norm = optimizer.grad_norm if optimizer.clip_norm is not None else engine.get_global_grad_norm()
    metrics["grad_norm"] = float(grad_norm) if grad_norm is not None else float("nan")
    metrics["skipped"] = float(skipped)  # any pass: the bad-steps count
    metrics["optimizer_updates"], metrics["learning_rate"] = float(applied), learning_rate
    metrics["timing/forward_backward_s"], metrics["timing/optimizer_s"] = forward_backward_s, optimizer_s  # this rank's
    return metrics


def base_optimizer(engine) -> SkippingAdamW:
    """The SkippingAdamW under DeepSpeed's wrappers (ZeRO and bf16 keep it as `.optimizer`)."""
    optimizer = engine.optimizer
    while not isinstance(optimizer, SkippingAdamW):
        if not hasattr(optimizer, "optimizer"):
            raise TypeError(f"the engine's optimizer ({type(engine.optimizer).__name__}) does not wrap a SkippingAdamW")
        optimizer = optimizer.optimizer
    return optimizer


class MetricSums:
    """Per-step metrics over micro-batches, passes and ranks: additive ones summed, the rest
    weighted by loss tokens, ratio extremes by min / max."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.extremes: dict[str, float] = {}
        self.tokens = 0

    def add(self, metrics: dict[str, float], tokens: int) -> None:
        self.tokens += tokens
        for key, value in metrics.items():
            if key in EXTREMES:
                if not tokens:  # no loss token (every one masked or aged out): its 1.0 placeholder is no extreme
                    continue
                pick = min if EXTREMES[key] == dist.ReduceOp.MIN else max
                self.extremes[key] = pick(self.extremes.get(key, value), value)
            else:
                weight = 1 if key in ADDITIVE else tokens
                self.sums[key] = self.sums.get(key, 0.0) + value * weight

    def reduce(self, keys: list[str], passes: int, device) -> dict[str, float]:
        """All ranks call this with the same `keys` (in the same order)."""
        values = torch.tensor([self.sums.get(k, 0.0) for k in keys] + [float(self.tokens)], dtype=torch.float64,
                              device=device)
        if dist.is_initialized():
            dist.all_reduce(values)
        tokens = max(values[-1].item(), 1.0)
        # the first-pass-only means saw a 1/passes share of the tokens
        out = {k: values[i].item() / (passes if k in ADDITIVE else tokens / passes if k in MISMATCH_MEANS else tokens)
               for i, k in enumerate(keys)}
        for key, op in EXTREMES.items():
            default = float("inf") if op == dist.ReduceOp.MIN else float("-inf")
            value = torch.tensor([self.extremes.get(key, default)], dtype=torch.float64, device=device)
            if dist.is_initialized():
                dist.all_reduce(value, op=op)
            if abs(value.item()) != float("inf"):
                out[key] = value.item()
        return out


def metric_keys(objective: Objective) -> list[str]:
    """The summed metric names, the same on every rank (a rank with no data still reduces them)."""
    return objective.metric_names() + list(MISMATCH_MEANS)


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def release_deepspeed_shm() -> None:
    """Remove the name of this rank's DeepSpeed shared-memory segment; call on every rank
    right after `deepspeed.init_distributed`.

    DeepSpeed's CPU all-reduce (ops/csrc/cpu/comm/shm.cpp) creates
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> (69 MB) at every start and
    never removes it: /dev/shm is memory, and a day of runs and tests filled it until the
    kernel killed a trainer. Once every rank has mapped its peers' segments (the barrier),
    the names can go; the memory stays mapped until the processes exit, even on SIGKILL.
    """
    dist.barrier()
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    (Path("/dev/shm") / name).unlink(missing_ok=True)


def deepspeed_config(cfg: Config, world_size: int) -> dict:
    """The DeepSpeed config: one 'sample' per rank and step; train_step sets the accumulation
    boundary itself, since the number of micro-batches changes from batch to batch."""
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": 0.0 if clips_itself(cfg) else cfg.training.max_grad_norm,
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "zero_allow_untested_optimizer": True,  # SkippingAdamW: torch's AdamW plus a skip check
        "bf16": {"enabled": cfg.model.dtype == "bfloat16"},
        "fp16": {"enabled": cfg.model.dtype == "float16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return _merge(config, cfg.deepspeed.config)


def set_learning_rate(engine, training: TrainingConfig, updates: int) -> float:
    """The schedule's rate for the update after `updates` applied ones, set on the optimizer that steps.
    The schedule runs over every update of the run: training.steps batches x num_iterations passes."""
    rate = learning_rate_at(updates, training.learning_rate, training.lr_schedule, training.warmup_steps,
                            training.steps * training.num_iterations, training.min_lr_ratio)
    for group in base_optimizer(engine).param_groups:
        group["lr"] = rate
    return rate
