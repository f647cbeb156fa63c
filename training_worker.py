"""The training process: DeepSpeed ranks, group-aware sharding, the GRPO/GSPO loss, weight publishing.

    deepspeed [--num_gpus N] training_worker.py [--config config.yaml] [key=value ...]

One loop, one step per sampler batch:
  rank 0 receives and validates a RolloutBatch (duplicates by step are dropped) -> every rank
  gets the raw frames and decodes them itself (no pickle) -> whole groups are split across
  ranks by token cost -> each rank packs its groups into micro-batches -> shared-prefix forward,
  policy_loss with the batch's global denominators, engine.backward per micro-batch ->
  engine.step once -> rank 0 publishes the new weights (the LoRA adapter or the full model),
  logs metrics, and checkpoints every `checkpoint.every` steps.

Exactness: each micro-batch's loss uses the whole batch's num_sequences / num_tokens, so the
pieces over all micro-batches and ranks sum to the whole batch's loss. DeepSpeed averages
gradients over ranks, so each loss is multiplied by the world size before backward; the
update is then the whole batch's gradient, however the batch was split.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from grpo.batch import RolloutBatch
from grpo.config import parse_cli, save_config
from grpo.delivery import Inbox, TrainerState
from grpo.files import RunFolderError, ensure_writable, write_atomically
from grpo.logprobs import verify_shared_prefix
from grpo.models import load_policy
from grpo.sources import SourceError
from grpo.training import (PolicyObjective, deepspeed_config, make_optimizer,
                           release_deepspeed_shm, train_step, warmup_lambda)
from grpo.transport import BatchReceiver, decode_batch
from grpo.weights import publish, published_versions, version_dir

log = logging.getLogger("trainer")
STOP = {"requested": False}
EXIT_BAD_STEPS = 5  # training.max_bad_steps non-finite steps in a row
EXIT_WRITE_FAILED = 6  # weights, a checkpoint or metrics could not be written


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


def _keyed(received: tuple[list[bytes], RolloutBatch]) -> tuple[list[bytes], tuple[int, int]]:
    frames, batch = received
    return frames, (batch.sampler, batch.step)


def main(argv: list[str]) -> int:
    cfg = parse_cli(argv)
    import deepspeed

    cuda = torch.cuda.is_available()
    backend = cfg.deepspeed.backend if cfg.deepspeed.backend != "auto" else ("nccl" if cuda else "gloo")
    deepspeed.init_distributed(dist_backend=backend)
    release_deepspeed_shm()
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
    logging.basicConfig(level=cfg.logging.level if rank == 0 else "WARNING",
                        format=f"%(asctime)s trainer[{rank}] %(levelname)s %(message)s")
    signal.signal(signal.SIGTERM, lambda *_: STOP.update(requested=True))
    run_dir = cfg.run_dir
    if rank == 0:
        try:
            ensure_writable(run_dir)
        except RunFolderError as e:
            log.error("%s", e)
            return 2  # the launcher stops the other ranks
        save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(cfg.seed)

    # ------------------------------------------------------------------ model, optimizer, engine
    try:
        model = load_policy(cfg, device).train()
    except SourceError as e:  # offline Hub id or missing folder: one line, no traceback
        log.error("%s", e)
        return 2
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(cfg.training.warmup_steps))
    engine, optimizer, _, scheduler = deepspeed.initialize(model=PolicyObjective(model, cfg), optimizer=optimizer,
                                                           lr_scheduler=scheduler, config=deepspeed_config(cfg, world))
    log.info("%d ranks (%s), %d trainable parameters, ZeRO stage %d", world, backend,
             sum(p.numel() for p in params), cfg.deepspeed.zero_stage)

    # ------------------------------------------------------------------ resume
    ckpt_dir = run_dir / "checkpoints"
    state_path = run_dir / "trainer_state.json"
    state = TrainerState()
    resume_from = ckpt_dir if cfg.checkpoint.resume == "auto" else Path(cfg.checkpoint.resume)
    if cfg.checkpoint.resume != "never" and (resume_from / "latest").is_file():
        _, client = engine.load_checkpoint(str(resume_from))
        state = TrainerState.from_dict(client["trainer"])
        log.info("resumed from %s at step %d", resume_from, state.step)
    if rank == 0:
        # versions past the checkpoint came from a trajectory that is being redone
        for v in published_versions(cfg.weights_dir):
            if v > state.step:
                shutil.rmtree(version_dir(cfg.weights_dir, v), ignore_errors=True)
    if state.step > 0:  # the checkpoint's weights become the served version again
        publish_weights(model, cfg, state.step, rank)

    receiver = metrics_file = writer = None
    if rank == 0:
        receiver = BatchReceiver(cfg.transport.address, high_water_mark=cfg.transport.high_water_mark,
                                 max_bytes=int(cfg.transport.max_message_mb * 2**20), secret=cfg.transport.secret)
        metrics_file = open_metrics(run_dir / "metrics.jsonl", state.step)
        if cfg.logging.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(str(run_dir / "tb"))
        state.incarnation = uuid.uuid4().hex[:12]
        state.save(state_path)  # bound and ready: the samplers re-send from their next steps (grpo/delivery.py)

    # ------------------------------------------------------------------ the loop
    verified = not cfg.training.verify_shared_prefix
    inbox = Inbox(lambda timeout: _keyed(receiver.receive_frames(timeout)), receiver.address,
                  stop=lambda: STOP["requested"]) if rank == 0 else None
    bad_in_row = skipped_total = 0
    failed = ""
    stopped = False
    while state.step < cfg.training.steps:
        t0 = time.perf_counter()
        frames = broadcast_frames(inbox.next(state, cfg.transport.recv_timeout_s) if rank == 0 else None, device)
        if frames is None:  # rank 0 got SIGTERM: all ranks checkpoint and leave together
            stopped = True
            save_checkpoint(engine, ckpt_dir, state, cfg.checkpoint.keep_last, rank, state_path)
            break
        batch = decode_batch(frames)
        wait_s = time.perf_counter() - t0
        if not verified:
            verify_shared_prefix(model, batch.prompt_ids, batch.completion_ids, batch.group_sizes,
                                 temperature=cfg.sampling.temperature)
            verified = True

        t1 = time.perf_counter()
        metrics = train_step(engine, batch, cfg, rank, world, device)
        train_s = time.perf_counter() - t1
        state.step += 1
        state.delivered(batch.sampler, batch.step)
        bad_in_row = bad_in_row + 1 if metrics["skipped"] else 0  # the ranks agree: decided by an all-reduce
        skipped_total += int(metrics["skipped"])
        if metrics["skipped"]:
            log.warning("step %d skipped: a non-finite loss or gradient (%d in a row; training.max_bad_steps=%d)",
                        state.step, bad_in_row, cfg.training.max_bad_steps)

        # -------------------------------------------------------------- publish, log, checkpoint
        t2 = time.perf_counter()
        if state.step % cfg.weights.publish_every == 0:
            publish_weights(model, cfg, state.step, rank)
        publish_s = time.perf_counter() - t2
        if rank == 0:
            completion_tokens = sum(len(c) for c in batch.completion_ids)
            row = {"step": state.step, "wall_time": time.time(), **metrics, "learning_rate": scheduler.get_last_lr()[0],
                   "staleness": state.step - 1 - batch.policy_version,  # our version before this step - theirs
                   "timing/wait_s": wait_s, "timing/train_s": train_s, "timing/publish_s": publish_s,
                   "trainer/completion_tokens": completion_tokens,
                   "trainer/tokens_per_s": completion_tokens * cfg.training.num_iterations / max(train_s, 1e-9),
                   "trainer/rejected_messages": receiver.rejected, "trainer/skipped_steps": skipped_total,
                   "sampler_step": batch.step,
                   **batch.meta.get("metrics", {})}  # the sampler's metrics, already namespaced
            with reported_write(f"metrics of step {state.step}", metrics_file.name):
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
            if writer is not None:
                for k, v in row.items():
                    if isinstance(v, (int, float)):
                        writer.add_scalar(k, v, state.step)
            log.info("step %d loss %.4f reward %.3f kl %.4f grad %.3f staleness %d wait %.1fs train %.1fs",
                     state.step, metrics["loss"], row.get("reward", float("nan")), metrics.get("kl", 0.0),
                     row["grad_norm"], row["staleness"], wait_s, train_s)
        too_many_bad = bad_in_row >= cfg.training.max_bad_steps
        if state.step % cfg.checkpoint.every == 0 or state.step == cfg.training.steps or too_many_bad:
            save_checkpoint(engine, ckpt_dir, state, cfg.checkpoint.keep_last, rank, state_path)  # after the row
        if too_many_bad:
            failed = (f"{bad_in_row} steps in a row (up to step {state.step}) had a non-finite loss or gradient and "
                      f"were skipped (training.max_bad_steps={cfg.training.max_bad_steps}); stopped with a "
                      f"checkpoint at step {state.step}. Lower training.learning_rate or look at those batches' "
                      "rewards and advantages in metrics.jsonl")
            break

    if failed:
        log.error(failed)
    if stopped:
        log.info("stopped by SIGTERM at step %d (checkpoint saved)", state.step)
    if rank == 0:
        receiver.close()
        metrics_file.close()
        if writer is not None:
            writer.close()
    dist.barrier()
    dist.destroy_process_group()
    return EXIT_BAD_STEPS if failed else 0


def open_metrics(path: Path, resumed_step: int):
    """metrics.jsonl for appending, without the rows of steps after the checkpoint we resume
    from: those steps are trained again and would otherwise appear twice."""
    if path.is_file():
        kept = []
        for line in path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= resumed_step:
                    kept.append(line)
            except json.JSONDecodeError:
                pass  # a line cut short by a crash
        write_atomically(path, "".join(line + "\n" for line in kept))
    return open(path, "a")


class WriteFailed(RuntimeError):
    """Weights, a checkpoint or metrics could not be written (a full disk, lost permissions)."""


@contextlib.contextmanager
def reported_write(what: str, path: Path):
    try:
        yield
    except OSError as e:
        raise WriteFailed(f"cannot write {what} to {path}: {e}") from e
    except RuntimeError as e:  # how torch.save reports a failed write
        raise WriteFailed(f"cannot write {what} to {path} (a full disk or a file size limit?): {e}") from e


def publish_weights(model, cfg, version: int, rank: int) -> None:
    """Rank 0 writes the adapter (or the full model); under ZeRO-3 every rank first takes part
    in gathering the partitioned parameters, so all ranks call this."""
    import deepspeed  # imported late, as in main()

    params = [p for p in model.parameters() if p.requires_grad] if cfg.lora.enabled else list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=cfg.deepspeed.zero_stage == 3):
        if rank == 0:
            with reported_write(f"weights v{version}", cfg.weights_dir):
                publish(model, cfg.weights_dir, version, version, cfg.weights.keep_last)


def save_checkpoint(engine, ckpt_dir: Path, state: TrainerState, keep_last: int, rank: int, state_path: Path):
    """DeepSpeed checkpoint (every rank) plus the trainer state the sampler resumes from.
    DeepSpeed names a checkpoint in `latest` only once it is written whole."""
    with reported_write(f"the checkpoint of step {state.step}", ckpt_dir):
        engine.save_checkpoint(str(ckpt_dir), tag=f"step{state.step:06d}", client_state={"trainer": vars(state)})
    if rank == 0:
        with reported_write("the trainer state", state_path):
            state.save(state_path)
        tags = sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step"))
        for old in tags[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except WriteFailed as e:
        log.error("%s. Nothing partial is visible: weights and checkpoints are written aside and renamed into "
                  "place, so LATEST and the last checkpoint are whole. Free space or fix permissions and restart; "
                  "it resumes from the last checkpoint", e)
        sys.exit(EXIT_WRITE_FAILED)
