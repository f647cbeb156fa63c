"""One sampler step as functions: generate, score, the policy's log-probs, the batch.

`make_batch` is what the sampler's loop calls once per step; each piece below it is a small
function of its inputs, in the order they run (DESIGN section 1).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from grpo.advantages import group_advantages
from grpo.batch import RolloutBatch
from grpo.completions import eos_token_ids
from grpo.delivery import global_step
from grpo.logprobs import completion_logprobs
from grpo.rollout import RolloutEngine, Rollouts
from grpo.sampling import loss_counts, sampler_metrics
from rewards import score_completions
from rewards.strict import strict_rates

log = logging.getLogger(__name__)


@dataclass
class SamplerPolicy:
    """What a step generates and scores with."""

    engine: RolloutEngine  # generates, and says which weights version it serves
    model: Any  # the scoring model: recomputed old log-probs, reference log-probs with the adapter off
    reference: Any | None  # a frozen copy of the start, for a full fine-tune with beta > 0
    tokenizer: Any
    behaviour: dict  # the settings each batch records (grpo/behaviour.py)


def make_engine(cfg, model, tokenizer) -> RolloutEngine:
    """The configured rollout engine (sampling.engine); vLLM is imported only when selected."""
    if cfg.sampling.engine == "vllm":
        from grpo.rollout.vllm_engine import VllmEngine

        return VllmEngine(cfg, eos_token_ids(tokenizer, model))
    from grpo.rollout.hf_engine import HFEngine

    return HFEngine(model, tokenizer, cfg.sampling)


def generate(cfg, engine: RolloutEngine, prompts: list, step: int) -> Rollouts:
    """G completions of each prompt; the seed depends on the run's global step only, so a re-run
    repeats it, and N samplers draw what one would."""
    return engine.generate([p.token_ids for p in prompts], cfg.sampling.group_size,
                           seed=cfg.seed * 1_000_003 + step)


def score(cfg, tokenizer, prompts: list, rollouts: Rollouts, sandbox) -> tuple[list[str], list[str], Any, torch.Tensor]:
    """(texts, reference answers, reward scores, group-relative advantages)."""
    G = cfg.sampling.group_size
    texts = [cfg.data.prefill + x for x in tokenizer.batch_decode(rollouts.completion_ids, skip_special_tokens=True)]
    answers = [p.problem.answer for p in prompts for _ in range(G)]
    scores = score_completions(texts, answers, cfg.rewards.names, cfg.rewards.weights, cfg.rewards.fallback,
                               call=sandbox)
    return texts, answers, scores, group_advantages(scores.total, G, scale=cfg.training.advantage_scale)


def policy_logprobs(cfg, policy: SamplerPolicy, prompt_ids: list[torch.Tensor], rollouts: Rollouts,
                    check_recorded: bool) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, float | None]:
    """(old log-probs, reference log-probs or None, the largest gap between the engine's recorded
    log-probs and the recompute, or None when nothing was recomputed)."""
    args = (prompt_ids, rollouts.completion_ids, [cfg.sampling.group_size] * len(prompt_ids))
    kwargs = dict(temperature=cfg.sampling.temperature, shared_prefix=cfg.training.shared_prefix)
    recorded = cfg.sampling.old_logps == "generation"
    with torch.no_grad():
        recomputed = completion_logprobs(policy.model, *args, **kwargs) if not recorded or check_recorded else None
        ref_logps = None
        if cfg.training.beta > 0 and cfg.lora.enabled and cfg.training.reference_on == "sampler":
            with policy.model.disable_adapter():
                ref_logps = completion_logprobs(policy.model, *args, **kwargs)
        elif policy.reference is not None:
            ref_logps = completion_logprobs(policy.reference, *args, **kwargs)
    gap = None
    if recomputed is not None:
        gap = max((a - b.float().cpu()).abs().max().item() for a, b in zip(rollouts.logps, recomputed))
    return (rollouts.logps if recorded else recomputed), ref_logps, gap


def make_batch(cfg, policy: SamplerPolicy, prompts: list, step: int, sampler: int, sandbox,
               metrics_so_far: dict[str, float], check_recorded: bool) -> RolloutBatch:
    """Sampler step `step` on `prompts`: the batch to send, its metrics (those of the step so far,
    e.g. the weights wait, and this function's) in `meta["metrics"]`."""
    timings = dict(metrics_so_far)
    version, digest = policy.engine.version, policy.engine.weights_digest  # before generating: the weights used
    prompt_ids = [torch.tensor(p.token_ids, dtype=torch.long) for p in prompts]
    t = time.perf_counter()
    rollouts = generate(cfg, policy.engine, prompts, global_step(sampler, step, cfg.sampling.num_workers))
    timings["timing/generate_s"] = time.perf_counter() - t

    t = time.perf_counter()
    texts, answers, scores, advantages = score(cfg, policy.tokenizer, prompts, rollouts, sandbox)
    timings["timing/rewards_s"] = time.perf_counter() - t

    t = time.perf_counter()
    old_logps, ref_logps, gap = policy_logprobs(cfg, policy, prompt_ids, rollouts, check_recorded)
    timings["timing/logprobs_s"] = time.perf_counter() - t

    truncated = torch.tensor(rollouts.truncated, dtype=torch.bool)
    num_tokens, num_sequences = loss_counts(rollouts.completion_ids, truncated, cfg.training.mask_truncated_completions)
    batch = RolloutBatch(
        step=step, sampler=sampler, policy_version=version, prompt_ids=prompt_ids,
        completion_ids=rollouts.completion_ids, group_sizes=[cfg.sampling.group_size] * len(prompts),
        old_logps=[x.float().cpu() for x in old_logps],
        ref_logps=[x.float().cpu() for x in ref_logps] if ref_logps is not None else None,
        rewards=scores.per_function, reward_names=list(cfg.rewards.names), advantages=advantages,
        truncated=truncated, num_tokens=num_tokens, num_sequences=num_sequences,
        meta={"sample_ids": [p.problem.id for p in prompts]}, behaviour=policy.behaviour,
        weights_digest=digest)
    metrics = sampler_metrics(batch, scores.total, scores.failures, timings)
    metrics.update(strict_rates(texts, answers))
    if gap is not None:
        metrics["sampler/engine_logp_gap_max"] = gap
        if cfg.sampling.old_logps == "generation":
            log.info("old log-probs read off generation differ from the recomputed ones by at most %.2e", gap)
    batch.meta["metrics"] = metrics
    return batch
