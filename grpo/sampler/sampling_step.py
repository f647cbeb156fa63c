"""One sampler step, top to bottom: wait for weights, evaluate when due, take the prompts,
generate (or run episodes), score, advantages, log-probs, assemble the batch, send it.

`run_step` is what the sampler's loop calls once per step; each stage is a small function
below it, in the order they run (`make_batch`, grpo/sampler/batches.py: the stages from generating
to the batch). A reward or an environment that fails on every sample of several steps in a row
stops the loop (grpo/sampler/failures.py): a run without scores learns nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from grpo.data.prompts import prompt_images
from grpo.sampler.batches import SamplerModels, make_batch, step_seed
from grpo.sampler.dynamic_sampling import round_start, rounds_per_step
from grpo.sampler.failures import FailureStreaks
from grpo.sampler.in_flight import settle_in_flight
from grpo.wire.batch import RolloutBatch
from grpo.wire.delivery import global_step
from grpo.wire.staleness import required_version, wait_for_version

if TYPE_CHECKING:
    from grpo.settings import Config, SamplingConfig

log = logging.getLogger(__name__)


@dataclass
class SamplerRun:
    """What every step of a sampler uses (sampling_worker.py builds it)."""

    cfg: Config
    policy: SamplerModels
    prompts: list  # the training prompts, tokenised
    cursor: Any  # data.cursor.PromptCursor
    watcher: Any  # grpo.weights.folder.WeightWatcher
    redelivery: Any  # grpo.wire.delivery.Redelivery
    sender: Any  # grpo.wire.transport.BatchSender
    spool: Any  # grpo.wire.delivery.Spool
    state: Any  # grpo.sampler.state.SamplerState
    evaluator: Any | None  # grpo.sampler.evaluation.TrainingEvaluator on sampler 0 with eval.every
    start_step: int
    end_step: int | None = None  # this sampler's last step + 1 (None: no step is started ahead)
    previous_send_s: float = 0.0
    streaks: FailureStreaks = field(default_factory=FailureStreaks)


def run_step(loop: SamplerRun, step: int) -> RolloutBatch:
    """Sampler step `step`: the batch it sent."""
    cfg, policy = loop.cfg, loop.policy
    loop.redelivery.check(step)  # a (re)started trainer first gets the spooled steps it lacks
    settle_in_flight(policy.engine)
    metrics = wait_for_weights(loop, step)
    evaluated = evaluate_if_due(loop.evaluator, policy.engine)
    metrics.update({"timing/previous_send_s": loop.previous_send_s,  # this batch's own send is not over when encoded
                    "timing/eval_s": evaluated["eval/seconds"] if evaluated else 0.0})
    g = global_step(cfg.sampling.worker_index, step, cfg.sampling.num_workers)
    then = next_call(loop, step)  # before this step's prompts: the cursor is left where this step's leave it
    prompts_of_round = round_prompts(cfg.sampling, loop.cursor, loop.prompts, g)
    # the recorded log-probs are checked against a recompute once per start, on its second step: the
    # first batch, which the trainer waits for, goes out without the extra forward (~5 s on 2 CPU cores)
    batch = make_batch(cfg, policy, prompts_of_round(0), step, metrics, measure_logp_gap=step == loop.start_step + 1,
                       more_prompts=prompts_of_round, streaks=loop.streaks, then=then)
    if evaluated:
        batch.meta["eval"] = evaluated  # the trainer writes it as its own metrics.jsonl row
    send(loop, step, batch)
    return batch


def next_call(loop: SamplerRun, step: int):
    """The next step's generate call, to start in the rows this step's completions leave free at its end
    (the engines' `generate(then=...)`), where the weights served now may generate it (sampling.max_staleness)
    and are the newest published (a newer one is loaded at the next step): continuous batching (the HF
    engine's loop, vLLM's async engine), single completions without dynamic sampling, a step to come.
    None otherwise."""
    cfg, engine = loop.cfg, loop.policy.engine
    sampling = cfg.sampling
    if (not hasattr(engine, "carried") or not sampling.continuous_batching or loop.policy.episodes is not None
            or sampling.dynamic_sampling or loop.end_step is None or step + 1 >= loop.end_step):
        return None
    g = global_step(sampling.worker_index, step + 1, sampling.num_workers)
    if engine.version < required_version(g, sampling.max_staleness, cfg.weights.publish_every):
        return None
    if loop.watcher.latest() not in (None, engine.version):
        return None
    from grpo.sampler.rollout.sequences import NextCall

    prompts = round_prompts(sampling, loop.cursor, loop.prompts, g)(0)
    return NextCall([p.token_ids for p in prompts], sampling.group_size, step_seed(cfg, g),
                    images=prompt_images(prompts))


def wait_for_weights(loop: SamplerRun, step: int) -> dict[str, float]:
    """Block until the weights this sampler's step `step` may use are served (sampling.max_staleness,
    counted in global steps); the metrics of the wait, loading included. A newer version published
    meanwhile is loaded as at every step, and drops the completions the step before started for this
    one (the engine's `carried`): they are made again with it (on vLLM with in-flight updates, they move
    on to it instead)."""
    cfg, watcher = loop.cfg, loop.watcher
    t, loaded_before = time.perf_counter(), watcher.load_seconds
    g = global_step(cfg.sampling.worker_index, step, cfg.sampling.num_workers)
    needed = required_version(g, cfg.sampling.max_staleness, cfg.weights.publish_every)
    mark = loop.evaluator.next_mark if loop.evaluator is not None else None  # served on its way, to be evaluated
    wait_for_version(watcher, needed, cfg.sampling.wait_timeout_s, on_poll=lambda: loop.redelivery.check(step),
                     prefer=mark if mark is not None and mark >= needed else None)
    return {"timing/weights_wait_s": time.perf_counter() - t,
            "timing/weight_load_s": watcher.load_seconds - loaded_before,
            "sampler/weight_load_failures": float(watcher.failures)}


def evaluate_if_due(evaluator, engine) -> dict | None:
    if evaluator is None or not evaluator.due(engine.version):
        return None
    result = evaluator.run(engine, engine.version)
    log.info("eval at version %d: answer accuracy %.3f, format rate %.3f (%d problems, %.0f s)", engine.version,
             result["eval/answer_accuracy"], result["eval/format_rate"], result["eval/problems"],
             result["eval/seconds"])
    return result


def round_prompts(sampling: SamplingConfig, cursor, prompts: list, g: int):
    """round -> the prompts of that round of global step g: their stream positions are a function
    of g alone (grpo/sampler/dynamic_sampling.py), so a restart or N samplers draw the same ones."""
    rounds = rounds_per_step(sampling.dynamic_sampling, sampling.dynamic_sampling_max_rounds)

    def prompts_of_round(r: int) -> list:
        cursor.seek(round_start(g, r, sampling.prompts_per_step, rounds))
        return [prompts[i] for i in cursor.take(sampling.prompts_per_step)]
    return prompts_of_round


class BatchTooLarge(RuntimeError):
    """A batch over the message size the trainer accepts: the run stops, saying which setting to change."""


def send(loop: SamplerRun, step: int, batch: RolloutBatch) -> None:
    """Spool the batch, send it, then save the data cursor: after the send, so that a restart
    neither repeats nor skips prompts."""
    t = time.perf_counter()
    frames = loop.sender.encode(batch)
    size, cap = sum(len(f) for f in frames), loop.cfg.transport.max_message_mb * 2**20
    if size > cap:  # the trainer's socket would drop it unread, and the run would wait on it
        raise BatchTooLarge(f"step {step}'s batch is {size / 2**20:.0f} MiB, over transport.max_message_mb="
                            f"{loop.cfg.transport.max_message_mb:g}; raise it, or send fewer prompts a step (images: "
                            "a smaller image processor size)")
    loop.spool.put(step, frames)  # kept until the trainer checkpoints past it (at-least-once delivery)
    loop.sender.send_frames(frames)  # blocks at the high-water mark: a slow trainer applies back-pressure
    loop.previous_send_s = time.perf_counter() - t
    loop.state.save(step + 1, loop.cursor.state_dict())
    m = batch.meta["metrics"]
    log.info("step %d v%d reward %.3f gen %.1fs (%s) logp %.1fs len %.0f", batch.step, batch.policy_version,
             m.get("reward", float("nan")), m["timing/generate_s"], generation_detail(m), m["timing/logprobs_s"],
             m["completions/mean_length"])


def generation_detail(m: dict[str, float]) -> str:
    """The step line's view of the decode loop: tokens/s, rows generating per decode step and the share of
    steps at a full batch (HF engine), episodes waiting on environments (vLLM: a mean over the generation),
    the time nothing decoded while they did (episodes)."""
    parts = [f"{m['sampler/tokens_per_s']:.0f} tok/s"]
    if "sampler/live_rows_per_decode_step" in m:
        parts.append(f"{m['sampler/live_rows_per_decode_step']:.1f} rows live, "
                     f"{m['sampler/full_decode_step_fraction']:.0%} steps full")
    if "env/waiting_mean" in m:  # vLLM: its scheduler's rows are its own
        parts.append(f"{m['env/waiting_mean']:.1f} episodes waiting on environments")
    if m.get("timing/env_idle_s"):
        parts.append(f"{m['timing/env_idle_s']:.1f}s waiting on environments")
    return ", ".join(parts)
