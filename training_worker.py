"""The training process: DeepSpeed ranks, group-aware sharding, the GRPO/GSPO loss, weight publishing.

    deepspeed [--num_gpus N] training_worker.py [--config config.yaml] [key=value ...]

One loop, one step per sampler batch:
  rank 0 takes the next batch in order from its inbox (grpo/wire/delivery.py: duplicates dropped,
  early ones held) -> every rank gets the raw frames and decodes them itself (no pickle) ->
  whole groups are split across ranks by token cost -> each rank packs its groups into
  micro-batches -> shared-prefix forward, policy_loss with the batch's global denominators,
  engine.backward per micro-batch -> engine.step once (grpo/trainer/step.py) -> the new weights are
  published (the LoRA adapter or the full model), rank 0 logs metrics, and every rank
  checkpoints every `checkpoint.every` steps (grpo/trainer/outputs.py).

Exactness: each micro-batch's loss uses the whole batch's num_sequences / num_tokens, so the
pieces over all micro-batches and ranks sum to the whole batch's loss. DeepSpeed averages
gradients over ranks, so each loss is multiplied by the world size before backward; the
update is then the whole batch's gradient, however the batch was split.
"""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.config import Config, TrainingConfig, exit_code, help_requested, parse_cli, to_dict
from grpo.config.history import refuse_a_changed_resume, save_run_config
from grpo.files import RunFolderError, ensure_writable
from grpo.model.flops import ModelShape, batch_step_flops
from grpo.model.loading import load_policy, load_tokenizer
from grpo.model.logprobs import check_supported, verify_shared_prefix
from grpo.objective import Objective
from grpo.run.progress import log_milestone
from grpo.run.start import hold_run_folder, prepare_run_folder, resume_source
from grpo.run.tracking import open_tracker
from grpo.sources import SourceError
from grpo.trainer.build_locks import LockWaitReporter, clear_stale_locks, extensions_root
from grpo.trainer.outputs import (CheckpointMismatch, MetricsLog, WriteFailed, base_fingerprint, check_base,
                                  check_resumable, load_trainable, publish_weights, save_checkpoint)
from grpo.trainer.step import (PolicyObjective, deepspeed_config, make_optimizer, release_deepspeed_shm,
                           train_step, within_age)
from grpo.wire.behaviour import (BehaviourMismatch, behaviour_of, check_behaviour, check_staleness,
                            check_weights_digest, uncorrected_precision_gap)
from grpo.wire.delivery import Inbox, TrainerState
from grpo.wire.staleness import token_staleness
from grpo.wire.transport import AddressInUse, BatchReceiver, decode_batch
from grpo.wire.weights import published_digests, published_versions, version_dir

log = logging.getLogger("trainer")
STOP = {"requested": False}
EXIT_BAD_STEPS = 5  # training.max_bad_steps non-finite steps in a row
EXIT_WRITE_FAILED = 6  # weights, a checkpoint or metrics could not be written
EXIT_BEHAVIOUR_MISMATCH = 7  # a batch sampled with other settings or staler weights than allowed (grpo/wire/behaviour.py)


def main(argv: list[str]) -> int:
    if help_requested(argv, __doc__):
        return 0
    cfg = parse_cli(argv)
    rank, world, device = start_distributed(cfg)
    try:  # a run folder, address or model that cannot be had: one line, no traceback (the launcher stops the rest)
        receiver, run_lock = claim_run_on_rank_zero(cfg, rank, world, device)  # noqa: F841 (held until exit)
        torch.manual_seed(cfg.seed)
        model = load_policy(cfg, device).train()
        check_supported(model, cfg)
        expected = behaviour_of(cfg, load_tokenizer(cfg.model))  # what every batch must have been made with
        if rank == 0 and uncorrected_precision_gap(cfg):
            log.warning("%s", uncorrected_precision_gap(cfg))
    except (RunFolderError, SourceError, StartRefused) as e:
        log.error("%s", e)
        return 2
    engine = build_engine(cfg, model, world)
    try:  # every rank reads the same checkpoint, so all refuse it together
        state = resume(cfg, engine, model, rank, world)
    except CheckpointMismatch as e:
        log.error("%s", e)
        return 2
    io = RankZero.open(cfg, state, receiver) if rank == 0 else None

    try:
        failed, code = train(cfg, engine, model, state, io, expected, rank, world, device), EXIT_BAD_STEPS
    except BehaviourMismatch as e:  # every rank decodes the same batch, so all of them stop here together
        failed, code = str(e), EXIT_BEHAVIOUR_MISMATCH
    if failed:
        log.error(failed)
    engine.destroy()  # DeepSpeed's own release (a decoupled checkpoint writer commits its last checkpoint here)
    if io is not None:
        io.close()
    dist.barrier()
    dist.destroy_process_group()
    return code if failed else 0


def train(cfg: Config, engine, model, state: TrainerState, io: "RankZero | None", expected: dict,
          rank, world, device) -> str:
    """The loop, until `training.steps` are done, SIGTERM, or too many non-finite steps in a row
    (returned: what to tell the user; empty otherwise). A batch made with other settings than
    `expected`, or with weights this run did not publish, raises `BehaviourMismatch` before
    anything is trained with it."""
    verified = not cfg.training.verify_shared_prefix
    shape = ModelShape.of(model)  # for the model FLOPs of each step (perf/ metrics)
    objective = Objective.of(cfg)
    bad_in_row = skipped_total = 0
    checkpointed = state.step  # a start that trains nothing leaves no checkpoint (it would be resumed from)
    known_digests: dict[int, set[str]] = {}  # rank 0: weights/digests.jsonl as last read
    while state.step < cfg.training.steps:
        t0 = time.perf_counter()
        frames = broadcast_frames(io.inbox.next(state, cfg.transport.recv_timeout_s) if rank == 0 else None, device)
        if frames is None:  # rank 0 got SIGTERM: all ranks checkpoint (if they trained since) and leave together
            trained_since = state.step > checkpointed
            if trained_since:
                save_checkpoint(engine, cfg, state, rank)
            log.info("stopped by SIGTERM at step %d (%s)", state.step, "checkpoint saved" if trained_since
                     else f"no step trained since step {state.step}: no checkpoint written")
            return ""
        batch = decode_batch(frames)
        check_behaviour(batch.behaviour, expected, batch.sampler, batch.step)
        check_staleness(state.step, batch.policy_version, cfg.sampling.max_staleness, batch.sampler, batch.step)
        check_weights_on_rank_zero(batch, cfg.weights_dir, known_digests, rank, device)
        if rank == 0 and isinstance(batch.meta.get("eval"), dict):  # the sampler evaluated a version: its own row
            io.metrics.write_evaluation({"wall_time": time.time(), **batch.meta["eval"]})
        timings = {"timing/wait_s": time.perf_counter() - t0}
        if not verified:
            verify_shared_prefix(model, batch.prompt_ids, batch.completion_ids, batch.group_sizes,
                                 temperature=cfg.sampling.temperature)
            verified = True

        aged_out = {}
        if cfg.training.max_token_age >= 0:  # every rank decodes the same batch: they mask alike
            batch, fraction = within_age(batch, state.step, cfg.training.max_token_age, objective)
            aged_out = {"staleness/aged_out_token_fraction": fraction}
        t1 = time.perf_counter()
        step_metrics = {**train_step(engine, batch, cfg, rank, world, device, updates=state.updates), **aged_out}
        learning_rate = step_metrics.pop("learning_rate")
        timings["timing/train_s"] = time.perf_counter() - t1
        state.step += 1
        state.updates += int(step_metrics["optimizer_updates"])  # a skipped pass does not advance the schedule
        state.delivered(batch.sampler, batch.step)
        bad_in_row = bad_in_row + 1 if step_metrics["skipped"] else 0  # the ranks agree: decided by an all-reduce
        skipped_total += int(step_metrics["skipped"])
        if step_metrics["skipped"]:
            log.warning("step %d skipped: a non-finite loss or gradient (%d in a row; training.max_bad_steps=%d)",
                        state.step, bad_in_row, cfg.training.max_bad_steps)

        t2 = time.perf_counter()
        if state.step % cfg.weights.publish_every == 0:
            publish_weights(model, cfg, state.step, rank)
        timings["timing/publish_s"] = time.perf_counter() - t2
        if rank == 0:
            timings.update(perf_metrics(batch_step_flops(shape, batch, cfg), timings["timing/train_s"]))
            io.metrics.write(step_row(cfg.training, state, batch, step_metrics, timings, learning_rate,
                                      io.receiver.rejected, skipped_total))
        too_many_bad = bad_in_row >= cfg.training.max_bad_steps
        if state.step % cfg.checkpoint.every == 0 or state.step == cfg.training.steps or too_many_bad:
            save_checkpoint(engine, cfg, state, rank)  # after the row
            checkpointed = state.step
        if too_many_bad:
            return (f"{bad_in_row} steps in a row (up to step {state.step}) had a non-finite loss or gradient and "
                    f"were skipped (training.max_bad_steps={cfg.training.max_bad_steps}); stopped with a "
                    f"checkpoint at step {state.step}. Lower training.learning_rate or look at those batches' "
                    "rewards and advantages in metrics.jsonl")
    return ""


# ----------------------------------------------------------------------------- the steps of main

def start_distributed(cfg: Config) -> tuple[int, int, torch.device]:
    """Set up logging, SIGTERM and stack dumps, then join the process group (nccl on GPUs, gloo on
    the CPU). DeepSpeed loads its ops here: a build lock left by a killed build is removed first,
    and a lock a live build holds is named in the log while this start waits on it."""
    import deepspeed

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=cfg.logging.level if rank == 0 else "WARNING",
                        format=f"%(asctime)s trainer[{rank}] %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for the stacks of a silent start
    faulthandler.enable(all_threads=True)  # a crash in native code (SIGSEGV, SIGABRT) prints where each thread was
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(requested=True))
    cuda = torch.cuda.is_available()
    backend = cfg.deepspeed.backend if cfg.deepspeed.backend != "auto" else ("nccl" if cuda else "gloo")
    extensions, first_on_node = extensions_root(), int(os.environ.get("LOCAL_RANK", 0)) == 0
    if first_on_node:  # one remover per machine: ranks never remove each other's fresh locks
        clear_stale_locks(extensions)
    with LockWaitReporter(extensions, remove_stale=first_on_node):
        deepspeed.init_distributed(dist_backend=backend)
    release_deepspeed_shm()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
    return rank, world, device


def build_engine(cfg: Config, model, world: int):
    """The DeepSpeed engine around the policy-with-loss (no DeepSpeed scheduler: it would advance on
    skipped steps too; train() sets each step's rate from grpo/trainer/schedule.py)."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg)
    engine, _, _, _ = deepspeed.initialize(model=PolicyObjective(model, cfg), optimizer=optimizer,
                                           config=deepspeed_config(cfg, world))
    if dist.get_rank() == 0:
        log_milestone(log, "%d ranks (%s), %d trainable parameters, ZeRO stage %d", world, dist.get_backend(),
                      sum(p.numel() for p in params), cfg.deepspeed.zero_stage)
    return engine


def resume(cfg: Config, engine, model, rank: int, world: int) -> TrainerState:
    """The checkpoint of checkpoint.resume, if any; its weights become the served version again and
    the versions published after it, which belong to the trajectory being redone, are removed. (A
    fresh start finds no versions: `claim_run_on_rank_zero` refused a used run folder.) A checkpoint
    this trainer cannot continue (other ZeRO ranks, another base model under a LoRA adapter) raises
    CheckpointMismatch before anything is loaded or removed."""
    state = TrainerState()
    resume_from = resume_source(cfg.checkpoint.resume, cfg.run_dir)
    if resume_from is not None:
        check_resumable(resume_from, cfg, world)
        _, client = engine.load_checkpoint(str(resume_from), custom_load_fn=load_trainable)
        check_base(client.get("base"), base_fingerprint(engine.module), cfg)
        state = TrainerState.from_dict(client["trainer"])
        log.info("resumed from %s at step %d", resume_from, state.step)
    if rank == 0:
        for v in published_versions(cfg.weights_dir):
            if v > state.step:
                shutil.rmtree(version_dir(cfg.weights_dir, v), ignore_errors=True)
    if state.step > 0:
        publish_weights(model, cfg, state.step, rank)
    return state


class StartRefused(RuntimeError):
    """The run cannot start: its folder or address (rank 0 says why), or more ranks than groups per step."""


def claim_run_on_rank_zero(cfg: Config, rank: int, world: int, device) -> tuple[BatchReceiver | None, object]:
    """Before anything is loaded, rank 0 claims the run: the run's lock (held while this process
    lives: a second trainer or launch into a live run stops), a resume's settings (one that changes
    what its checkpoint depends on stops here, grpo/config/history.py), the bound socket (a taken
    transport.address stops here), then the run folder (a fresh start into a used one refuses, or
    moves it aside with run.overwrite) and the resolved config. Every rank learns whether it could
    and stops together with it; so do more ranks than groups per step. (Rank 0's receiver or None,
    the lock to keep.)"""
    groups = cfg.sampling.prompts_per_step
    if world > groups:  # every rank sees this alike, so each stops by itself
        raise StartRefused(f"{world} trainer ranks but sampling.prompts_per_step={groups}: each rank trains whole "
                           f"groups, so {world - groups} rank(s) would have nothing to do; raise "
                           f"sampling.prompts_per_step to >= {world} or start fewer ranks")
    receiver, lock, refusal = None, None, ""
    if rank == 0:
        try:
            lock = hold_run_folder(cfg)
            changed = refuse_a_changed_resume(cfg)  # before anything is written
            receiver = BatchReceiver(cfg.transport.address, high_water_mark=cfg.transport.high_water_mark,
                                     max_bytes=int(cfg.transport.max_message_mb * 2**20), secret=cfg.transport.secret)
            moved = prepare_run_folder(cfg, held=True)
            if moved is not None:
                log.warning("run.overwrite=true: the earlier contents of %s were moved to %s", cfg.run_dir, moved)
            ensure_writable(cfg.run_dir)
            save_run_config(cfg)  # the config of an earlier launch is kept beside it
            if changed:
                log.info("%s", changed)
        except Exception as e:  # whatever it is, the other ranks must hear of it, not wait in a collective
            refusal = str(e) if isinstance(e, (RunFolderError, AddressInUse)) else f"{type(e).__name__}: {e}"
            if receiver is not None:
                receiver.close()
    refused = torch.tensor([int(bool(refusal))], device=device)
    dist.broadcast(refused, 0)
    if refused.item():
        raise StartRefused(refusal or "rank 0 could not claim the run folder or transport.address (its log says why)")
    return receiver, lock


@dataclass
class RankZero:
    """Rank 0's ends of the run: the socket, the inbox that orders its batches, the metrics log."""

    receiver: BatchReceiver
    inbox: Inbox
    metrics: MetricsLog

    @classmethod
    def open(cls, cfg: Config, state: TrainerState, receiver: BatchReceiver) -> "RankZero":
        inbox = Inbox(lambda timeout: keyed(receiver.receive_frames(timeout)), receiver.address,
                      stop=lambda: STOP["requested"], num_samplers=cfg.sampling.num_workers)
        state.incarnation = uuid.uuid4().hex[:12]
        tracker = open_tracker(cfg.logging, cfg.run_dir, cfg.run.name, to_dict(cfg), writer=f"trainer-{state.incarnation}")
        io = cls(receiver, inbox, MetricsLog(cfg.run_dir, state.step, cfg.logging.tensorboard, tracker))
        state.save(cfg.run_dir / "trainer_state.json")  # bound and ready: the samplers re-send (grpo/wire/delivery.py)
        return io

    def close(self) -> None:
        self.receiver.close()
        self.metrics.close()


def keyed(received: tuple[list[bytes], object]) -> tuple[list[bytes], tuple[int, int]]:
    """The receiver's (frames, batch) as the inbox wants it: (frames, (sampler, step))."""
    frames, batch = received
    return frames, (batch.sampler, batch.step)


def broadcast_frames(frames: list[bytes] | None, device) -> list[bytes] | None:
    """Rank 0's raw message to every rank, as byte tensors (each rank decodes and validates it).
    None from rank 0 means stop, and every rank gets None."""
    sizes = torch.tensor([len(f) for f in frames] if frames is not None else [], dtype=torch.long, device=device)
    count = torch.tensor([len(sizes) if frames is not None else -1], dtype=torch.long, device=device)
    dist.broadcast(count, 0)
    if int(count) < 0:
        return None
    if dist.get_rank() != 0:
        sizes = torch.empty(int(count), dtype=torch.long, device=device)
    dist.broadcast(sizes, 0)
    data = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8).to(device) if frames is not None \
        else torch.empty(int(sizes.sum()), dtype=torch.uint8, device=device)
    dist.broadcast(data, 0)
    raw = data.cpu().numpy().tobytes()
    out, start = [], 0
    for n in sizes.tolist():
        out.append(raw[start:start + n])
        start += n
    return out


def check_weights_on_rank_zero(batch, weights_dir: Path, known: dict[int, set[str]], rank: int, device) -> None:
    """Rank 0, the publisher, checks the batch's weights digest against the ones it recorded (only
    its node need see weights.dir); every rank raises `BehaviourMismatch` when it refuses. `known`
    caches weights/digests.jsonl, read again only for a digest it lacks (one published since)."""
    refusal = ""
    if rank == 0:
        if batch.weights_digest not in known.get(batch.policy_version, ()):
            known.update(published_digests(weights_dir))
        try:
            check_weights_digest(batch.policy_version, batch.weights_digest, known, batch.sampler, batch.step)
        except BehaviourMismatch as e:
            refusal = str(e)
    refused = torch.tensor([int(bool(refusal))], device=device)
    dist.broadcast(refused, 0)
    if refused.item():
        raise BehaviourMismatch(refusal or "rank 0 refused the batch's weights digest (its log says why)")


def perf_metrics(flops: dict[str, int], train_s: float) -> dict[str, float]:
    """The step's model FLOPs (grpo/model/flops.py; all ranks together) and their rate over its train time:
    against the machine's matmul rate that is the trainer's MFU (scripts/benchmarks/bench_vs_trl.py prints it)."""
    return {"perf/trainer_model_gflop": flops["model"] / 1e9,
            "perf/trainer_recomputed_gflop": flops["recomputed"] / 1e9,
            "perf/trainer_gflop_per_s": flops["model"] / 1e9 / max(train_s, 1e-9)}


def step_row(t: TrainingConfig, state: TrainerState, batch, step_metrics: dict, timings: dict, learning_rate: float,
             rejected: int, skipped_total: int) -> dict:
    """The metrics.jsonl row of the step just trained: the trainer's metrics and the sampler's."""
    completion_tokens = sum(len(c) for c in batch.completion_ids)
    row = {"step": state.step, "wall_time": time.time(), **step_metrics, "learning_rate": learning_rate,
           "staleness": state.step - 1 - batch.policy_version,  # our version before this step - theirs
           **token_staleness(state.step - 1, batch.token_versions),
           **timings, "trainer/completion_tokens": completion_tokens,
           "trainer/tokens_per_s": completion_tokens * t.num_iterations / max(timings["timing/train_s"], 1e-9),
           "trainer/rejected_messages": rejected, "trainer/skipped_steps": skipped_total,
           "sampler/index": batch.sampler, "sampler_step": batch.step, **batch.meta.get("metrics", {})}  # the sampler's metrics, already namespaced
    log.info("step %d loss %.4f reward %.3f kl %.4f grad %.3f staleness %d wait %.1fs train %.1fs", state.step,
             row["loss"], row.get("reward", float("nan")), row.get("kl", 0.0), row["grad_norm"], row["staleness"],
             timings["timing/wait_s"], timings["timing/train_s"])
    return row


def leave(code: int) -> None:
    """Exit with `code` once the run's files are closed, skipping the interpreter's teardown: there a
    C++ thread of the distributed stack that is still woken can abort the process ("terminate called
    without an active exception", SIGABRT) and turn a finished run into a failed one."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    ctypes.CDLL(None).fflush(None)  # what native code printed into the C library's buffers
    os._exit(code)


if __name__ == "__main__":
    try:
        leave(exit_code(main, sys.argv[1:]))
    except WriteFailed as e:
        log.error("%s. Nothing partial is visible: weights and checkpoints are written aside and renamed into "
                  "place, so LATEST and the last checkpoint are whole. Free space or fix permissions and restart; "
                  "it resumes from the last checkpoint", e)
        leave(EXIT_WRITE_FAILED)
