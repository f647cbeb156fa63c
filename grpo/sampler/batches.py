"""One step's batch, from its prompts to what is sent: generate (or run episodes), score, advantages,
log-probs, the RolloutBatch (`make_batch`; grpo/sampler/sampling_step.py calls it once per step). With dynamic
sampling, rounds of prompts until enough groups differ (grpo/sampler/dynamic_sampling.py). A sample
a reward failed on scores the batch's worst, one it could not be asked about is left out of its
group's advantages (rewards.on_failure). A reward or an environment that fails on every sample of
several steps in a row stops the loop (grpo/sampler/failures.py): a run without scores learns nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from grpo.model.flops import ModelShape, generation_flops
from grpo.model.logprobs import completion_logprobs
from grpo.model.segments import has_rows, join_rows, split_rows
from grpo.model.vision import wire_images
from grpo.objective import Objective
from grpo.objective.advantages import estimate_advantages, failures_below_honest, worst_of_batch
from grpo.objective.kl_reward import NAME as KL_PENALTY
from grpo.objective.kl_reward import batch_reward_columns, kl_penalties
from grpo.rewards import RewardScores, score_completions
from grpo.rewards.overlong import NAME as OVERLONG
from grpo.rewards.overlong import overlong_penalty
from grpo.rewards.registry import ENV_REWARD
from grpo.rewards.services import ServiceSettings
from grpo.rewards.strict import checks_of, strict_rates
from grpo.sampler.dynamic_sampling import choose_groups, has_spread, round_seed
from grpo.sampler.episode_records import episode_metrics
from grpo.sampler.failures import FailedOnAll, FailureStreaks
from grpo.sampler.generation import generate_completions
from grpo.sampler.metrics import sampler_metrics
from grpo.sampler.remote_teacher import RemoteTeacher
from grpo.sampler.rollout import RolloutEngine, Rollouts
from grpo.sampler.shown_completions import shown_completions
from grpo.wire.batch import RolloutBatch
from grpo.wire.delivery import global_step

if TYPE_CHECKING:
    from grpo.settings import Config, RewardsConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplerModels:
    """What a step generates and scores with, built whole once per process."""

    engine: RolloutEngine  # generates, and says which weights version it serves
    model: Any  # the scoring model: recomputed old log-probs, reference log-probs with the adapter off
    reference: Any | None  # a frozen copy of the start, for a full fine-tune with beta > 0
    tokenizer: Any
    behaviour: dict  # the settings each batch records (grpo/wire/behaviour.py)
    objective: Objective  # built once per process from the config (its advantages' scale, whether beta > 0)
    services: ServiceSettings  # what the service rewards need, likewise
    episodes: Any | None = None  # grpo.sampler.episodes.EpisodeRunner with env.name: multi-turn episodes
    sandbox: Any | None = None  # rewards.sandbox.RewardSandbox the rewards run in (None: in this process)
    teacher: Any | None = None  # distill.teacher's model or its server (RemoteTeacher): it scores every sampled token

    @classmethod
    def of(cls, cfg: Config, engine: RolloutEngine, model, reference, tokenizer, behaviour: dict,
           **rest) -> "SamplerModels":
        """With the objective and the service settings built from `cfg` (once: a process builds its models once)."""
        return cls(engine, model, reference, tokenizer, behaviour, Objective.of(cfg), ServiceSettings.of(cfg), **rest)

    @functools.cached_property
    def shape(self) -> ModelShape:
        """The scoring model's shape, for the model FLOPs of each round (read once)."""
        return ModelShape.of(self.model)


def step_seed(cfg: Config, step: int) -> int:
    """The seed of global step `step`: a re-run repeats it, and N samplers draw what one would."""
    return cfg.seed * 1_000_003 + step


def reward_names(cfg: Config) -> list[str]:
    """The batch's reward columns: the configured ones, then the overlong penalty when it is on, then the
    KL penalty with training.kl_in=reward."""
    return batch_reward_columns(cfg)[0]


@dataclass
class Round:
    """One round's prompts, their G completions each (prompt-major), and the scores."""

    prompts: list
    rollouts: Rollouts
    texts: list[str]
    rows: list[dict]  # what the rewards got per sample: the dataset row (+ env_reward in episodes)
    scores: Any  # rewards.RewardScores, with the overlong column when it is on
    generate_s: float = 0.0
    rewards_s: float = 0.0
    generation_flops: int = 0  # model FLOPs of the generation (grpo/model/flops.py)
    episodes: list | None = None  # grpo.sampler.episode_records.Episode per sample, with env.name
    failed_on_all: FailedOnAll | None = None  # set by generate_and_score
    images: list | None = None  # each prompt's images as generation got them (the batch carries the same)


def generate_and_score(cfg: Config, policy: SamplerModels, prompts: list, seed: int, sandbox, then=None) -> Round:
    t = time.perf_counter()
    G = cfg.sampling.group_size
    made = generate_completions(policy.engine, policy.tokenizer, prompts, G, cfg.data.prefill, policy.episodes,
                                seed=seed, then=then)  # episodes: rewards score each one's last model message
    prompts, rollouts, texts, rows, episodes = made.prompts, made.rollouts, made.texts, made.rows, made.episodes
    generate_s, t = time.perf_counter() - t, time.perf_counter()
    turns = [p.turns for p in prompts for _ in range(G)]  # each sample's chat, for the service rewards
    scores = score_completions(texts, rows, cfg.rewards.names, cfg.rewards.weights, failure_value(cfg.rewards),
                               call=sandbox, prompts=turns, services=policy.services,
                               environment_failures=environment_failures(episodes), also=checks_of(cfg.rewards))
    worst = scores.worst | cut_at_budget(episodes, cfg, len(texts))  # [N]
    total, scored = worst_of_batch(scores.total, scores.scored, worst)  # failing never pays
    scores = dataclasses.replace(scores, total=total, scored=scored, worst=worst)
    if cfg.rewards.overlong_buffer > 0:  # after: a failed sample keeps its own length's penalty (with_penalty)
        penalty = torch.tensor([overlong_penalty(len(c), cfg.sampling.max_new_tokens, cfg.rewards.overlong_buffer,
                                                 cfg.rewards.overlong_penalty) for c in rollouts.completion_ids])
        scores = with_penalty(scores, penalty, OVERLONG, G)
    flops = generation_flops(policy.shape, [len(p.token_ids) for p in prompts],
                             [len(c) for c in rollouts.completion_ids], [G] * len(prompts), adapters=cfg.lora.enabled)
    return Round(prompts, rollouts, texts, rows, scores, generate_s, time.perf_counter() - t, flops.total, episodes,
                 FailedOnAll.of(scores, episodes), made.images)


def completions_shown(cfg: Config, policy: SamplerModels, kept: Round, advantages: torch.Tensor) -> list[dict]:
    """The step's first logging.completions_per_step samples for a person to read (an episode: its whole
    conversation, decoded with the chat's markers so that each turn shows)."""
    count = cfg.logging.completions_per_step
    texts = kept.texts[:count] if kept.episodes is None else [
        cfg.data.prefill + policy.tokenizer.decode(ids, skip_special_tokens=False)
        for ids in kept.rollouts.completion_ids[:count]]
    scores = kept.scores
    return shown_completions(count, kept.prompts, texts, reward_names(cfg),
                             scores.per_function[:count].tolist(), scores.failed[:count].tolist(),
                             scores.total[:count].tolist(), advantages[:count].tolist(), cfg.sampling.group_size)


def failure_value(rewards: RewardsConfig) -> float | None:
    """What a sample a reward failed on gets: rewards.fallback, or None: the batch's worst, or left out
    where the reward could not be asked (rewards.on_failure)."""
    return rewards.fallback if rewards.on_failure == "fallback" else None


def environment_failures(episodes: list | None) -> list[tuple[str, bool] | None] | None:
    """Each episode's environment failure for env_reward, None where it answered (and None without
    episodes): (what, whether the environment could not be asked: it did not open, or a rebuild
    that another episode's hang caused replayed otherwise) for an episode that failed."""
    if episodes is None:
        return None
    return [((e.env_error or "it gave no reply"),
             e.open_failed or (e.replay_mismatch and not e.lost_its_own_environment))
            if e.environment_failed else None for e in episodes]


def cut_at_budget(episodes: list | None, cfg: Config, n: int) -> torch.Tensor:
    """bool [n]: the episodes cut at the token budget in a run that trains on env_reward without
    env.truncated_reward: they score the batch's worst, whatever earlier replies gave, so that
    running out of tokens never scores above losing (all False without episodes)."""
    on = episodes is not None and ENV_REWARD in cfg.rewards.names and cfg.env.truncated_reward is None
    if not on:
        return torch.zeros(n, dtype=torch.bool)
    return torch.tensor([e.truncated for e in episodes], dtype=torch.bool)


def with_penalty(scores: RewardScores, penalty: torch.Tensor, name: str, group_size: int) -> RewardScores:
    """`scores` with a penalty [N] as one more column `name`, added to the totals (it never fails): DAPO's
    overlong penalty, or the KL penalty of training.kl_in=reward. A failed sample keeps its own, and its total stays
    at most the lowest honest one of its group (failures_below_honest)."""
    n = len(penalty)
    return RewardScores(torch.cat([scores.per_function, penalty[:, None]], 1),  # [N, R + 1]
                        torch.cat([scores.applies, torch.ones(n, 1, dtype=torch.bool)], 1),  # [N, R + 1]
                        failures_below_honest(scores.total + penalty, scores.scored, scores.worst, group_size),
                        {**scores.failures, name: 0}, scores.errors,
                        torch.cat([scores.failed, torch.zeros(n, 1, dtype=torch.bool)], 1), scores.scored,
                        scores.worst)


def keep_groups(rounds: list[Round], chosen: list[tuple[int, int]], G: int) -> Round:
    """The chosen (round, group) pairs as one round, in that order."""
    samples = [(rounds[r], j * G + k) for r, j in chosen for k in range(G)]
    scores = [rnd.scores for rnd in rounds]
    episodic = rounds[0].episodes is not None
    return Round(
        prompts=[rounds[r].prompts[j] for r, j in chosen],
        rollouts=Rollouts(completion_ids=[rnd.rollouts.completion_ids[i] for rnd, i in samples],
                          truncated=[rnd.rollouts.truncated[i] for rnd, i in samples],
                          logps=[rnd.rollouts.logps[i] for rnd, i in samples],
                          model_masks=[rnd.rollouts.model_masks[i] for rnd, i in samples] if episodic else None,
                          token_versions=[rnd.rollouts.token_versions[i] for rnd, i in samples]
                          if all(rnd.rollouts.token_versions is not None for rnd in rounds) else None,
                          segments=kept_segments(rounds, samples)),
        texts=[rnd.texts[i] for rnd, i in samples],
        rows=[rnd.rows[i] for rnd, i in samples],
        scores=RewardScores(torch.stack([rnd.scores.per_function[i] for rnd, i in samples]),
                            torch.stack([rnd.scores.applies[i] for rnd, i in samples]),
                            torch.stack([rnd.scores.total[i] for rnd, i in samples]),
                            {name: sum(s.failures[name] for s in scores) for name in scores[0].failures},
                            # earliest round's wins
                            dict(error for s in reversed(scores) for error in s.errors.items()),
                            torch.stack([rnd.scores.failed[i] for rnd, i in samples]),
                            torch.stack([rnd.scores.scored[i] for rnd, i in samples]),
                            torch.stack([rnd.scores.worst[i] for rnd, i in samples])),
        generate_s=sum(rnd.generate_s for rnd in rounds), rewards_s=sum(rnd.rewards_s for rnd in rounds),
        generation_flops=sum(rnd.generation_flops for rnd in rounds),
        episodes=[rnd.episodes[i] for rnd, i in samples] if episodic else None,
        images=None if all(rnd.images is None for rnd in rounds) else
        [rounds[r].images[j] if rounds[r].images is not None else None for r, j in chosen],
        failed_on_all=functools.reduce(FailedOnAll.both, [rnd.failed_on_all for rnd in rounds]))


def image_fields(images: list | None) -> dict:
    """The batch's image fields (grpo/wire/batch.py) of the prompts' images; none for prompts of text alone."""
    if images is None:
        return {}
    pixels, grids, patch_values = wire_images(images)
    return {"image_pixels": pixels, "image_grids": grids, "patch_values": patch_values}


def kept_segments(rounds: list[Round], samples: list[tuple[Round, int]]) -> list[torch.Tensor] | None:
    """The kept samples' rows (grpo/model/segments.py): all in row 0 for a round none of whose samples started a new
    row; None where no round's did."""
    if all(rnd.rollouts.segments is None for rnd in rounds):
        return None
    return [rnd.rollouts.segments[i] if rnd.rollouts.segments is not None
            else torch.zeros(len(rnd.rollouts.completion_ids[i]), dtype=torch.int32) for rnd, i in samples]


def sample_groups(cfg: Config, policy: SamplerModels, prompts: list, more_prompts, step: int, sandbox,
                  then=None) -> tuple[Round, dict]:
    """The step's groups: one round, or with dynamic sampling rounds until prompts_per_step groups
    have differing rewards (grpo/sampler/dynamic_sampling.py); the metrics of that, and always the
    share of the generated groups whose rewards are all equal (no learning signal)."""
    sampling = cfg.sampling
    first = generate_and_score(cfg, policy, prompts, step_seed(cfg, step), sandbox, then)
    rounds, spreads = [first], [has_spread(first.scores.total, sampling.group_size, first.scores.scored)]
    while sampling.dynamic_sampling and sum(map(sum, spreads)) < len(prompts) \
            and len(rounds) < sampling.dynamic_sampling_max_rounds and more_prompts:
        extra = generate_and_score(cfg, policy, more_prompts(len(rounds)),
                                   round_seed(step_seed(cfg, step), len(rounds)),
                                   sandbox)
        rounds.append(extra)
        spreads.append(has_spread(extra.scores.total, sampling.group_size, extra.scores.scored))
    generated = sum(map(len, spreads))
    flat = {"sampling/zero_spread_fraction": 1.0 - sum(map(sum, spreads)) / generated}  # of the generated groups
    if not sampling.dynamic_sampling:
        return first, flat
    chosen, short = choose_groups(spreads, len(prompts))
    if short:
        log.warning("dynamic sampling: %d of %d groups have differing rewards after %d rounds "
                    "(sampling.dynamic_sampling_max_rounds); filled with groups that give no gradient",
                    sum(map(sum, spreads)), len(prompts), len(rounds))
    return keep_groups(rounds, chosen, sampling.group_size), {
        **flat, "sampling/dynamic_rounds": float(len(rounds)), "sampling/dynamic_cap_hit": float(short),
        "sampling/dynamic_dropped_fraction": (generated - len(prompts)) / generated,  # generated, not trained
        "sampling/generated_tokens": float(sum(len(c) for rnd in rounds for c in rnd.rollouts.completion_ids))}


def policy_logprobs(cfg: Config, policy: SamplerModels, prompt_ids: list[torch.Tensor], rollouts: Rollouts,
                    measure_logp_gap: bool, images: list | None) -> tuple[list[torch.Tensor], list[torch.Tensor] | None,
                                                     list[torch.Tensor] | None, float | None]:
    """(old log-probs, reference log-probs or None, the teacher's or None, the largest gap between the
    engine's recorded log-probs and the recompute, or None when nothing was recomputed). Each with the
    shared-prefix forward at the sampling temperature: the prompt once per group."""
    args = (prompt_ids, rollouts.completion_ids, [cfg.sampling.group_size] * len(prompt_ids))
    kwargs = dict(temperature=cfg.sampling.temperature, shared_prefix=cfg.training.shared_prefix,
                  segments=rollouts.segments, images=images)
    recorded = cfg.sampling.old_logps == "generation"
    with torch.no_grad():
        recomputed = completion_logprobs(policy.model, *args, **kwargs) if not recorded or measure_logp_gap else None
        ref_logps = None
        if policy.objective.beta > 0 and cfg.lora.enabled and cfg.training.reference_on == "sampler":
            with policy.model.disable_adapter():
                ref_logps = completion_logprobs(policy.model, *args, **kwargs)
        elif policy.reference is not None:
            ref_logps = completion_logprobs(policy.reference, *args, **kwargs)
        teacher_logps = teacher_logprobs(policy.teacher, args, kwargs)
    gap = None
    if recomputed is not None:  # over the model's tokens: an episode's environment tokens hold placeholders
        masks = rollouts.model_masks or [torch.ones(len(c), dtype=torch.bool) for c in rollouts.completion_ids]
        if rollouts.token_versions is not None:  # the recompute is the weights served now: their tokens only
            masks = [m & (v == policy.engine.version) for m, v in zip(masks, rollouts.token_versions)]
        gap = max(((a - b.float().cpu()).abs()[m].max().item() for a, b, m in zip(rollouts.logps, recomputed, masks)
                   if m.any()), default=0.0)
    return (rollouts.logps if recorded else recomputed), ref_logps, teacher_logps, gap


def teacher_logprobs(teacher, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
    """distill.teacher's log-probs of the completions (None without a teacher): from its server (at temperature
    1, the config's rule), or its model's shared-prefix forward, as the policy's."""
    if teacher is None:
        return None
    if isinstance(teacher, RemoteTeacher):  # its server reads completions of one row: each row sent as one
        prompt_ids, completion_ids, group_sizes = args
        if not has_rows(kwargs["segments"]):
            return teacher.completion_logprobs(*args)
        rows, sizes, counts = split_rows(completion_ids, group_sizes, kwargs["segments"])
        return join_rows(teacher.completion_logprobs(prompt_ids, rows, sizes), counts)
    return completion_logprobs(teacher, *args, **kwargs)


def make_batch(cfg: Config, policy: SamplerModels, prompts: list, step: int, metrics_so_far: dict[str, float],
               measure_logp_gap: bool, more_prompts=None, streaks: FailureStreaks | None = None,
               then=None) -> RolloutBatch:
    """Sampler step `step` on `prompts` (and with dynamic sampling, `more_prompts(round)` for the
    rounds after the first): the batch to send, its metrics (those of the step so far, e.g. the
    weights wait, and this function's) in `meta["metrics"]`. With `streaks`, AlwaysFailing once a
    reward or the environment has failed on every sample for its max_failed_steps steps. `then`: the next
    step's generate call, started in the rows this step's completions leave free (`next_call`)."""
    timings = dict(metrics_so_far)
    version, digest = policy.engine.version, policy.engine.weights_digest  # before generating: the weights used
    sampler, sandbox = cfg.sampling.worker_index, policy.sandbox
    loop_metrics = getattr(policy.engine, "loop_metrics", None)  # the decode loop's counts, environment waits
    if loop_metrics is not None:
        loop_metrics.take()  # an evaluation's are not this step's
    kept, dynamic_metrics = sample_groups(cfg, policy, prompts, more_prompts,
                                          global_step(sampler, step, cfg.sampling.num_workers), sandbox, then)
    if loop_metrics is not None:
        timings.update(loop_metrics.take())
    if streaks is not None:  # before the log-probs: a step that stops the run costs no forward pass
        streaks.observe(cfg, kept.failed_on_all)
    timings["timing/generate_s"], timings["timing/rewards_s"] = kept.generate_s, kept.rewards_s  # all rounds
    timings["perf/generation_model_gflop"] = kept.generation_flops / 1e9
    timings["perf/generation_gflop_per_s"] = kept.generation_flops / 1e9 / max(kept.generate_s, 1e-9)
    prompts, rollouts, objective = kept.prompts, kept.rollouts, policy.objective
    prompt_ids, images = [torch.tensor(p.token_ids, dtype=torch.long) for p in prompts], kept.images
    t = time.perf_counter()
    old_logps, ref_logps, teacher_logps, gap = policy_logprobs(cfg, policy, prompt_ids, rollouts, measure_logp_gap,
                                                               images)
    timings["timing/logprobs_s"] = time.perf_counter() - t
    old_logps, ref_logps, teacher_logps = (None if logps is None else [x.float().cpu() for x in logps]
                                           for logps in (old_logps, ref_logps, teacher_logps))  # as sent
    reward_totals = kept.scores.total  # the rewards' alone: the metrics' `reward`
    if objective.kl_in == "reward" and objective.beta > 0:  # each score less beta x its completion's KL, from the
        # log-probs as the batch carries them, as the trainer recomputes it
        penalty = kl_penalties(old_logps, ref_logps, rollouts.model_masks, objective.beta, objective.kl_estimator)
        kept = dataclasses.replace(kept, scores=with_penalty(kept.scores, penalty, KL_PENALTY, cfg.sampling.group_size))
    scores = kept.scores
    # a sample no reward could be asked about: advantage 0, out of its group's mean and std; it stays in the
    # batch and in the loss's denominators, as a group whose rewards are all equal does (TRL, DAPO's token mean)
    advantages = estimate_advantages(objective.advantage, scores.total, cfg.sampling.group_size,
                                     scale=objective.advantage_scale, scored=scores.scored)

    if rollouts.token_versions is not None:  # the batch's version: its oldest model token's (an environment's: -1)
        version = min((int(v[v >= 0].min()) for v in rollouts.token_versions if bool((v >= 0).any())), default=version)
        digest = policy.engine.digests[version]
    truncated = torch.tensor(rollouts.truncated, dtype=torch.bool)
    batch = RolloutBatch(
        step=step, sampler=sampler, policy_version=version, prompt_ids=prompt_ids,
        completion_ids=rollouts.completion_ids, group_sizes=[cfg.sampling.group_size] * len(prompts),
        old_logps=old_logps, ref_logps=ref_logps,
        rewards=scores.per_function, reward_names=reward_names(cfg), advantages=advantages,
        truncated=truncated,
        meta={"sample_ids": [p.problem.id for p in prompts]}, behaviour=policy.behaviour,
        weights_digest=digest, model_mask=rollouts.model_masks,
        token_versions=rollouts.token_versions, segments=rollouts.segments,
        totals=scores.total, scored=scores.scored, worst=scores.worst,
        teacher_logps=teacher_logps, **image_fields(images))
    # `reward` and its spread: the rewards' (the KL penalty has its own column's metrics)
    metrics = sampler_metrics(batch, dataclasses.replace(scores, total=reward_totals), {**timings, **dynamic_metrics})
    metrics.update(strict_rates(kept.texts, kept.rows, checks_of(cfg.rewards), call=sandbox))
    if kept.episodes is not None:
        metrics.update(episode_metrics(kept.episodes))
    if gap is not None:
        metrics["sampler/engine_logp_gap_max"] = gap
        if cfg.sampling.old_logps == "generation":
            log.info("old log-probs read off generation differ from the recomputed ones by at most %.2e", gap)
    batch.meta["metrics"] = metrics
    if cfg.logging.completions_per_step:
        batch.meta["completions"] = completions_shown(cfg, policy, kept, advantages)
    return batch
