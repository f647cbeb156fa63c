"""The training process: DeepSpeed ranks, group-aware sharding, the GRPO/GSPO loss, weight publishing.

    deepspeed [--num_gpus N] training_worker.py [--config config.yaml] [key=value ...]
    (the launcher: python -m grpo.workers.trainer, or deepspeed --module grpo.workers.trainer)

Its start-up is here (the process group, the run folder and socket claimed on rank 0, the DeepSpeed
engine, a resume); its loop is grpo/trainer/loop.py, its step grpo/trainer/training_step.py: whole groups
are split across ranks by token cost, each rank packs its groups into micro-batches, shared-prefix
forward, policy_loss with the batch's global denominators, engine.backward per micro-batch, one
engine.step.

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
import threading

import torch
import torch.distributed as dist

from grpo.common.files import RunFolderError, WriteFailed, ensure_writable
from grpo.common.imports import user_code_importable
from grpo.common.sources import SourceError
from grpo.config import Config, exit_code, help_requested, parse_cli
from grpo.model.loading import load_policy, load_tokenizer
from grpo.model.logprobs import check_supported
from grpo.objective import Objective
from grpo.run.epochs import with_epochs_as_steps
from grpo.run.history import refuse_a_changed_resume, save_run_config
from grpo.run.preflight import named_code_problems
from grpo.run.progress import log_milestone
from grpo.run.secret import run_secret
from grpo.run.start import hold_run_folder, latest_tag, prepare_run_folder, resume_source
from grpo.trainer.build_locks import LockWaitReporter, clear_stale_locks, extensions_root
from grpo.trainer.checkpoint_files import CheckpointChanged, check_manifest, load_safely, manifest_secret
from grpo.trainer.loop import RunEnds, TrainingLoop
from grpo.trainer.ranks import rank_zero_decides
from grpo.trainer.saving import (
    CheckpointMismatch,
    base_fingerprint,
    check_base,
    check_resumable,
    load_trainable,
    publish_weights,
)
from grpo.trainer.training_step import PolicyObjective, deepspeed_config, make_optimizer, release_deepspeed_shm
from grpo.weights.folder import published_versions, version_dir
from grpo.wire.behaviour import BehaviourMismatch, behaviour_of, uncorrected_precision_gap
from grpo.wire.delivery import TrainerState
from grpo.wire.transport import AddressInUse, BatchReceiver

log = logging.getLogger("trainer")
EXIT_BAD_STEPS = 5  # training.max_bad_steps non-finite steps in a row
EXIT_WRITE_FAILED = 6  # weights, a checkpoint or metrics could not be written
# a batch sampled with other settings or staler weights than allowed (grpo/wire/behaviour.py)
EXIT_BEHAVIOUR_MISMATCH = 7


def main(argv: list[str]) -> int:
    if help_requested(argv, __doc__):
        return 0
    cfg = with_epochs_as_steps(parse_cli(argv, checks=[named_code_problems]))
    stop = threading.Event()  # SIGTERM: rank 0 stops waiting for batches, and every rank checkpoints
    rank, world, device = start_distributed(cfg, stop)
    objective = Objective.of(cfg)
    try:  # a run folder, address or model that cannot be had: one line, no traceback (the launcher stops the rest)
        receiver, run_lock = claim_run_on_rank_zero(cfg, world, device)  # noqa: F841 (held until exit)
        torch.manual_seed(cfg.seed)
        model = load_policy(cfg, device).train()
        check_supported(model, cfg, trains=True)
        expected = behaviour_of(cfg, load_tokenizer(cfg.model), objective.header())  # every batch's making
        if rank == 0 and uncorrected_precision_gap(cfg):
            log.warning("%s", uncorrected_precision_gap(cfg))
    except (RunFolderError, SourceError, StartRefused) as e:
        log.error("%s", e)
        return 2
    engine = build_engine(cfg, model, world, objective)
    try:  # every rank reads the same checkpoint, so all refuse it together
        state = resume(cfg, engine, model, rank)
    except (CheckpointMismatch, CheckpointChanged) as e:
        log.error("%s", e)
        return 2
    ends = RunEnds.open(cfg, state, receiver, stop) if rank == 0 else None
    try:
        failed, code = TrainingLoop(cfg, engine, model, state, ends, expected, objective, device).run(), EXIT_BAD_STEPS
    except BehaviourMismatch as e:  # every rank decodes the same batch, so all of them stop here together
        failed, code = str(e), EXIT_BEHAVIOUR_MISMATCH
    if failed:
        log.error(failed)
    engine.destroy()  # DeepSpeed's own release (a decoupled checkpoint writer commits its last checkpoint here)
    if ends is not None:
        ends.close()
    dist.barrier()
    dist.destroy_process_group()
    return code if failed else 0


# ----------------------------------------------------------------------------- the steps of main

def start_distributed(cfg: Config, stop: threading.Event) -> tuple[int, int, torch.device]:
    """Set up logging, SIGTERM and stack dumps, then join the process group (nccl on GPUs, gloo on
    the CPU). DeepSpeed loads its ops here: a build lock left by a killed build is removed first,
    and a lock a live build holds is named in the log while this start waits on it."""
    import deepspeed

    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(level=cfg.logging.level if rank == 0 else "WARNING",
                        format=f"%(asctime)s trainer[{rank}] %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for the stacks of a silent start
    faulthandler.enable(all_threads=True)  # a crash in native code (SIGSEGV, SIGABRT) prints where each thread was
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
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


def build_engine(cfg: Config, model, world: int, objective: Objective):
    """The DeepSpeed engine around the policy-with-loss (no DeepSpeed scheduler: it would advance on
    skipped steps too; train() sets each step's rate from grpo/trainer/schedule.py)."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(params, cfg)
    engine, _, _, _ = deepspeed.initialize(model=PolicyObjective(model, cfg, objective), optimizer=optimizer,
                                           config=deepspeed_config(cfg, world))
    if dist.get_rank() == 0:
        log_milestone(log, "%d ranks (%s), %d trainable parameters, ZeRO stage %d", world, dist.get_backend(),
                      sum(p.numel() for p in params), cfg.deepspeed.zero_stage)
    return engine


def resume(cfg: Config, engine, model, rank: int) -> TrainerState:
    """The checkpoint of checkpoint.resume, if any; its weights become the served version again and
    the versions published after it, which belong to the trajectory being redone, are removed. (A
    fresh start finds no versions: `claim_run_on_rank_zero` refused a used run folder.) A checkpoint
    this trainer cannot continue (other ZeRO ranks, another base model under a LoRA adapter) raises
    CheckpointMismatch, and one whose files are not those its run wrote CheckpointChanged, before
    anything is loaded or removed."""
    state = TrainerState()
    resume_from = resume_source(cfg.checkpoint.resume, cfg.run_dir)
    if resume_from is not None:
        check_resumable(resume_from, cfg.deepspeed, dist.get_world_size())
        unchecked = check_manifest(resume_from / latest_tag(resume_from), manifest_secret(resume_from, cfg))
        if unchecked:
            log.warning("%s", unchecked)
        load_safely(engine)  # nothing in its files is unpickled but data
        _, client = engine.load_checkpoint(str(resume_from), custom_load_fn=load_trainable)
        check_base(client.get("base"), base_fingerprint(engine.module), cfg.model)
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


def claim_run_on_rank_zero(cfg: Config, world: int, device) -> tuple[BatchReceiver | None, object]:
    """Before anything is loaded, rank 0 claims the run: the run's lock (held while this process
    lives: a second trainer or launch into a live run stops), a resume's settings (one that changes
    what its checkpoint depends on stops here, grpo/run/history.py), the bound socket (a taken
    transport.address stops here), then the run folder (a fresh start into a used one refuses, or
    moves it aside with run.overwrite) and the resolved config. Every rank learns whether it could
    and stops together with it; so do more ranks than groups per step. (Rank 0's receiver or None,
    the lock to keep.)"""
    groups = cfg.sampling.prompts_per_step
    if world > groups:  # every rank sees this alike, so each stops by itself
        raise StartRefused(f"{world} trainer ranks but sampling.prompts_per_step={groups}: each rank trains whole "
                           f"groups, so {world - groups} rank(s) would have nothing to do; raise "
                           f"sampling.prompts_per_step to >= {world} or start fewer ranks")
    claimed = {"receiver": None, "lock": None}

    def claim() -> None:
        claimed["lock"] = hold_run_folder(cfg)
        changed = refuse_a_changed_resume(cfg)  # before anything is written
        claimed["receiver"] = BatchReceiver(cfg.transport.address, high_water_mark=cfg.transport.high_water_mark,
                                            max_bytes=int(cfg.transport.max_message_mb * 2**20))
        try:
            moved = prepare_run_folder(cfg, held=True)
            if moved is not None:
                log.warning("run.overwrite=true: the earlier contents of %s were moved to %s", cfg.run_dir, moved)
            ensure_writable(cfg.run_dir)
            claimed["receiver"].expect_secret(run_secret(cfg.transport.secret, cfg.run_dir))  # in the folder kept
            save_run_config(cfg)  # the config of an earlier launch is kept beside it
        except Exception:
            claimed["receiver"].close()
            raise
        if changed:
            log.info("%s", changed)

    rank_zero_decides(claim, device, StartRefused,
                      "rank 0 could not claim the run folder or transport.address (its log says why)",
                      (RunFolderError, AddressInUse))
    return claimed["receiver"], claimed["lock"]


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


def entry(argv: list[str] | None = None) -> None:
    """The trainer process, as `deepspeed training_worker.py` and the launcher start it: never returns."""
    user_code_importable()
    try:
        leave(exit_code(main, sys.argv[1:] if argv is None else argv))
    except WriteFailed as e:
        log.error("%s. Nothing partial is visible: weights and checkpoints are written aside and renamed into "
                  "place, so LATEST and the last checkpoint are whole. Free space or fix permissions and restart; "
                  "it resumes from the last checkpoint", e)
        leave(EXIT_WRITE_FAILED)


if __name__ == "__main__":
    entry()
