"""The trainer's loop: one step per sampler batch, in the samplers' global order.

  rank 0 takes the next batch from its inbox (grpo/wire/delivery.py: duplicates dropped, early ones
  held) -> every rank gets the raw frames (rank 0 decoded them on arrival, the others decode them
  themselves: no pickle) -> each checks how the batch was made (settings, staleness, weights) ->
  tokens older than training.max_token_age leave the loss -> the step (grpo/trainer/training_step.py) ->
  the new weights are published, rank 0 writes the metrics row, every rank checkpoints every
  checkpoint.every steps (grpo/trainer/saving.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import torch.distributed as dist

from grpo.common.run_folder import RunFolder
from grpo.model.flops import ModelShape, batch_step_flops
from grpo.model.loading import unwrap_causal_lm
from grpo.model.logprobs import verify_shared_prefix
from grpo.model.vision import batch_prompt_images, check_batch_images
from grpo.objective import Objective
from grpo.run.metrics_log import MetricsLog
from grpo.run.tracking import open_tracker
from grpo.settings import Config, TrainingConfig, to_dict
from grpo.trainer.advantage_check import check_advantages
from grpo.trainer.ranks import broadcast_frames, rank_zero_decides
from grpo.trainer.saving import publish_weights, save_checkpoint
from grpo.trainer.training_step import train_step, within_age
from grpo.weights.folder import published_digests
from grpo.wire.batch import RolloutBatch
from grpo.wire.behaviour import BehaviourMismatch, check_behaviour, check_staleness, check_weights_digest
from grpo.wire.codec import decode_batch
from grpo.wire.delivery import Inbox, TrainerState
from grpo.wire.staleness import token_staleness
from grpo.wire.transport import BatchReceiver

log = logging.getLogger("trainer")


@dataclass
class RunEnds:
    """Rank 0's ends of the run: the socket batches arrive on, the inbox that puts them in order, and
    the metrics log the rows go to."""

    receiver: BatchReceiver
    inbox: Inbox
    metrics: MetricsLog

    @classmethod
    def open(cls, cfg: Config, state: TrainerState, receiver: BatchReceiver, stop: threading.Event) -> RunEnds:
        inbox = Inbox(lambda timeout: with_order_key(receiver.receive_frames(timeout)), receiver.address,
                      stop=stop.is_set, num_samplers=cfg.sampling.num_workers)
        state.incarnation = uuid.uuid4().hex[:12]
        tracker = open_tracker(cfg.logging, cfg.run_dir, cfg.run.name, to_dict(cfg),
                               writer=f"trainer-{state.incarnation}")
        ends = cls(receiver, inbox, MetricsLog(cfg.run_dir, state.step, cfg.logging.tensorboard, tracker))
        # bound and ready: the samplers re-send (grpo/wire/delivery.py)
        state.save(RunFolder(cfg.run_dir).trainer_state)
        return ends

    def close(self) -> None:
        self.receiver.close()
        self.metrics.close()


def with_order_key(received: tuple[list[bytes], RolloutBatch]) -> tuple[tuple[list[bytes], RolloutBatch],
                                                                        tuple[int, int]]:
    """The receiver's (frames, batch) as the inbox orders them: ((frames, batch), (sampler, step))."""
    return received, (received[1].sampler, received[1].step)


class TrainingLoop:
    """Every rank runs one; only rank 0 has the run's ends. `run()` trains until training.steps are
    done, SIGTERM, or too many non-finite steps in a row, and returns what to tell the user (empty
    when nothing went wrong). A batch made with other settings than `expected`, with weights this
    run did not publish, or with advantages that do not follow from its rewards, raises
    BehaviourMismatch on every rank before anything is trained with it."""

    def __init__(self, cfg: Config, engine, model, state: TrainerState, ends: RunEnds | None, expected: dict,
                 objective: Objective, device):
        self.cfg, self.engine, self.model, self.state, self.ends = cfg, engine, model, state, ends
        self.expected, self.objective, self.device = expected, objective, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.ends_max_bytes = int(cfg.transport.max_message_mb * 2**20)
        self.prefix_verified = not cfg.training.verify_shared_prefix
        self.shape = ModelShape.of(model)  # for the model FLOPs of each step (perf/ metrics)
        self.bad_in_row = self.skipped_total = 0
        self.checkpointed = state.step  # a start that trains nothing leaves no checkpoint (it would be resumed from)
        self.known_digests: dict[int, set[str]] = {}  # rank 0: weights/digests.jsonl as last read

    def run(self) -> str:
        while self.state.step < self.cfg.training.steps:
            started = time.perf_counter()
            batch = self.next_batch()
            if batch is None:  # rank 0 got SIGTERM: all ranks checkpoint (if they trained since) and leave together
                return self.stopped()
            failure = self.train_on(batch, {"timing/wait_s": time.perf_counter() - started})
            if failure:
                return failure
        return ""

    def next_batch(self) -> RolloutBatch | None:
        """The next batch in order on every rank, checked; None on every rank once rank 0 is stopped."""
        item = self.ends.inbox.next(self.state, self.cfg.transport.recv_timeout_s) if self.ends else None
        frames = broadcast_frames(item[0] if item is not None else None, self.device)
        if frames is None:
            return None
        # rank 0 decoded it on arrival; the others with the same cap
        batch = item[1] if item is not None else decode_batch(frames, max_bytes=self.ends_max_bytes)
        check_behaviour(batch.behaviour, self.expected, batch.sampler, batch.step)
        images = check_batch_images(batch, unwrap_causal_lm(self.model))
        if images is not None:
            raise BehaviourMismatch(f"sampler {batch.sampler} step {batch.step}: {images}")
        check_advantages(batch, self.cfg)
        check_staleness(self.state.step, batch.policy_version, self.cfg.sampling.max_staleness, batch.sampler,
                        batch.step)
        rank_zero_decides(lambda: self.check_weights(batch), self.device, BehaviourMismatch,
                          "rank 0 refused the batch's weights digest (its log says why)", (BehaviourMismatch,))
        if self.ends is not None and isinstance(batch.meta.get("eval"), dict):  # a sampler's evaluation: its own row
            self.ends.metrics.write_evaluation({"wall_time": time.time(), **batch.meta["eval"]})
        if not self.prefix_verified:
            verify_shared_prefix(self.model, batch.prompt_ids, batch.completion_ids, batch.group_sizes,
                                 temperature=self.cfg.sampling.temperature, segments=batch.segments,
                                 images=batch_prompt_images(batch))
            self.prefix_verified = True
        return batch

    def check_weights(self, batch: RolloutBatch) -> None:
        """Rank 0, the publisher, checks the batch's weights digest against the ones it recorded (only
        its node need see weights.dir), reading weights/digests.jsonl again only for a digest it lacks."""
        if batch.weights_digest not in self.known_digests.get(batch.policy_version, ()):
            self.known_digests.update(published_digests(self.cfg.weights_dir))
        check_weights_digest(batch.policy_version, batch.weights_digest, self.known_digests, batch.sampler,
                             batch.step)

    def train_on(self, batch: RolloutBatch, timings: dict) -> str:
        """One step on `batch`: train, publish, log, checkpoint; what to tell the user when it must stop."""
        cfg, state = self.cfg, self.state
        aged_out = {}
        if cfg.training.max_token_age >= 0:  # every rank decodes the same batch: they mask alike
            batch, fraction = within_age(batch, state.step, cfg.training.max_token_age)
            aged_out = {"staleness/aged_out_token_fraction": fraction}
        started = time.perf_counter()
        step_metrics = {**train_step(self.engine, batch, cfg, self.rank, self.world, self.device,
                                     updates=state.updates), **aged_out}
        learning_rate = step_metrics.pop("learning_rate")
        timings["timing/train_s"] = time.perf_counter() - started
        state.step += 1
        state.updates += int(step_metrics["optimizer_updates"])  # a skipped pass does not advance the schedule
        state.delivered(batch.sampler, batch.step)
        self.count_skipped(bool(step_metrics["skipped"]))  # the ranks agree: decided by an all-reduce
        started = time.perf_counter()
        if state.step % cfg.weights.publish_every == 0:
            publish_weights(self.model, cfg, state.step, self.rank)
        timings["timing/publish_s"] = time.perf_counter() - started
        if self.ends is not None:
            timings.update(perf_metrics(batch_step_flops(self.shape, batch, cfg), timings["timing/train_s"]))
            self.ends.metrics.write(step_row(cfg.training, state, batch, step_metrics, timings, learning_rate,
                                             self.ends.receiver.rejected, self.skipped_total))
            shown = batch.meta.get("completions")
            self.ends.metrics.write_completions(state.step, batch.sampler, shown if isinstance(shown, list) else [])
        too_many_bad = self.bad_in_row >= cfg.training.max_bad_steps
        if state.step % cfg.checkpoint.every == 0 or state.step == cfg.training.steps or too_many_bad:
            save_checkpoint(self.engine, cfg, state, self.rank)  # after the row
            self.checkpointed = state.step
        if too_many_bad:
            return (f"{self.bad_in_row} steps in a row (up to step {state.step}) had a non-finite loss or gradient "
                    f"and were skipped (training.max_bad_steps={cfg.training.max_bad_steps}); stopped with a "
                    f"checkpoint at step {state.step}. Lower training.learning_rate or look at those batches' "
                    "rewards and advantages in metrics.jsonl")
        return ""

    def count_skipped(self, skipped: bool) -> None:
        self.bad_in_row = self.bad_in_row + 1 if skipped else 0
        self.skipped_total += int(skipped)
        if skipped:
            log.warning("step %d skipped: a non-finite loss or gradient (%d in a row; training.max_bad_steps=%d)",
                        self.state.step, self.bad_in_row, self.cfg.training.max_bad_steps)

    def stopped(self) -> str:
        trained_since = self.state.step > self.checkpointed
        if trained_since:
            save_checkpoint(self.engine, self.cfg, self.state, self.rank)
        log.info("stopped by SIGTERM at step %d (%s)", self.state.step, "checkpoint saved" if trained_since
                 else f"no step trained since step {self.state.step}: no checkpoint written")
        return ""


def perf_metrics(flops: dict[str, int], train_s: float) -> dict[str, float]:
    """The step's model FLOPs (grpo/model/flops.py; all ranks together) and their rate over its train time:
    against the machine's matmul rate that is the trainer's MFU (scripts/benchmarks/bench_vs_trl.py prints it)."""
    return {"perf/trainer_model_gflop": flops["model"] / 1e9,
            "perf/trainer_recomputed_gflop": flops["recomputed"] / 1e9,
            "perf/trainer_gflop_per_s": flops["model"] / 1e9 / max(train_s, 1e-9)}


def step_row(training: TrainingConfig, state: TrainerState, batch, step_metrics: dict, timings: dict,
             learning_rate: float, rejected: int, skipped_total: int) -> dict:
    """The metrics.jsonl row of the step just trained: the trainer's metrics and the sampler's (already
    namespaced)."""
    completion_tokens = sum(len(c) for c in batch.completion_ids)
    row = {"step": state.step, "wall_time": time.time(), **step_metrics, "learning_rate": learning_rate,
           "staleness": state.step - 1 - batch.policy_version,  # our version before this step - theirs
           **token_staleness(state.step - 1, batch.token_versions),
           **timings, "trainer/completion_tokens": completion_tokens,
           "trainer/tokens_per_s": completion_tokens * training.num_iterations / max(timings["timing/train_s"], 1e-9),
           "trainer/rejected_messages": rejected, "trainer/skipped_steps": skipped_total,
           "sampler/index": batch.sampler, "sampler_step": batch.step, **batch.meta.get("metrics", {})}
    log.info("step %d loss %.4f reward %.3f kl %.4f grad %.3f staleness %d wait %.1fs train %.1fs", state.step,
             row["loss"], row.get("reward", float("nan")), row.get("kl", 0.0), row["grad_norm"], row["staleness"],
             timings["timing/wait_s"], timings["timing/train_s"])
    return row
