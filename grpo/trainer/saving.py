"""What the trainer writes besides its metrics (grpo/run/metrics_log.py): published weights and checkpoints.

Every write that can fail (a full disk, lost permissions) raises `WriteFailed` naming what and
where; the trainer then exits with its own code and nothing partial is visible, since weights
and checkpoints are written aside and renamed into place.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.common.files import CHECKPOINT_MARK, reported_write, write_atomically
from grpo.common.run_folder import RunFolder
from grpo.run.secret import folder_secret
from grpo.trainer.checkpoint_files import write_manifest
from grpo.weights import open_publisher
from grpo.wire.delivery import TrainerState

if TYPE_CHECKING:
    from grpo.settings import Config, DeepSpeedConfig, ModelConfig


def publish_weights(model, cfg: Config, version: int, rank: int) -> None:
    """Rank 0 writes the adapter (or the full model); under ZeRO-3 every rank first takes part
    in gathering the partitioned parameters, so all ranks call this."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad] if cfg.lora.enabled else list(model.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=cfg.deepspeed.zero_stage == 3):
        if rank == 0:
            with reported_write(f"weights v{version}", cfg.weights_dir):
                open_publisher(cfg).publish(model, version, version)


def save_checkpoint(engine, cfg: Config, state: TrainerState, rank: int) -> None:
    """DeepSpeed checkpoint (every rank) plus the trainer state the samplers resume from. Rank 0
    names a checkpoint in `latest` only once every rank wrote it and its signed manifest is written
    (grpo/trainer/checkpoint_files.py). A LoRA run's holds what
    trains (the adapter, its optimizer state), not the frozen base: a resume loads the base from the
    model again (`load_trainable`)."""
    ckpt_dir, tag = RunFolder(cfg.run_dir).checkpoints, f"step{state.step:06d}"
    # DeepSpeed's exclude_frozen_parameters drops a frozen parameter under its first name only: a tied
    # embedding would stay in as lm_head.weight (113 MB of the embedded model's 535)
    hook = engine.module.register_state_dict_post_hook(_without_frozen) if cfg.lora.enabled else None
    try:
        with reported_write(f"the checkpoint of step {state.step}", ckpt_dir):
            engine.save_checkpoint(str(ckpt_dir), tag=tag, save_latest=False,  # named below, once signed
                                   client_state={"trainer": vars(state), "base": base_fingerprint(engine.module)},
                                   exclude_frozen_parameters=cfg.lora.enabled)
    finally:
        if hook is not None:
            hook.remove()
    if rank == 0:  # every rank's files are written (DeepSpeed's barrier): signed, then named in `latest`
        with reported_write(f"the manifest of the checkpoint of step {state.step}", ckpt_dir):
            write_manifest(ckpt_dir / tag, folder_secret(cfg.run_dir))
            write_atomically(ckpt_dir / CHECKPOINT_MARK, tag)
        state_path = RunFolder(cfg.run_dir).trainer_state
        with reported_write("the trainer state", state_path):
            state.save(state_path)
        tags = sorted(p for p in ckpt_dir.iterdir() if p.is_dir() and p.name.startswith("step"))
        for old in tags[:-cfg.checkpoint.keep_last]:
            shutil.rmtree(old, ignore_errors=True)


class CheckpointMismatch(RuntimeError):
    """A checkpoint whose trained weights are not this model's (another LoRA shape or targets)."""


def frozen_names(module) -> set[str]:
    """Every name of every frozen parameter of `module`, a tied one's second name too."""
    return {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _without_frozen(module, state_dict: dict, prefix: str, local_metadata) -> None:
    """A state_dict post-hook: the frozen parameters left out, under all their names."""
    for name in frozen_names(module):
        state_dict.pop(prefix + name, None)


def load_trainable(src: dict, dst) -> None:
    """DeepSpeed's `custom_load_fn`: the checkpoint's module state into `dst`, which may leave out
    the frozen parameters (a LoRA run's checkpoint); anything else missing or unexpected is refused."""
    result = dst.load_state_dict(src, strict=False)
    frozen = frozen_names(dst)
    missing = sorted(set(result.missing_keys) - frozen)
    if missing or result.unexpected_keys:
        raise CheckpointMismatch(f"the checkpoint does not hold this model's trained weights: {len(missing)} missing "
                                 f"(e.g. {missing[:2]}), {len(result.unexpected_keys)} unexpected (e.g. "
                                 f"{sorted(result.unexpected_keys)[:2]}); "
                                 "it was made with another model or LoRA setting")


def base_fingerprint(module) -> str:
    """What a LoRA adapter was trained on top of: sha256 of the frozen parameters' names, shapes and
    first values (a checkpoint that leaves the base out records it; '' for a full fine-tune)."""
    digest, found = hashlib.sha256(), False
    for name, p in module.named_parameters():
        if p.requires_grad:
            continue
        found = True
        digest.update(f"{name}{tuple(getattr(p, 'ds_shape', p.shape))}".encode())
        if p.numel():  # under ZeRO-3 a rank holds an empty placeholder: names and shapes only
            digest.update(p.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return digest.hexdigest() if found else ""


def check_base(saved: str | None, current: str, model: ModelConfig) -> None:
    """Refuse to continue a LoRA checkpoint on another base model than the one it was trained on
    (a model folder changed in place, another run's checkpoint); checkpoints without a record pass."""
    if saved and current and saved != current:
        raise CheckpointMismatch(f"the checkpoint's LoRA adapter was trained on another base model than "
                                 f"model.name_or_path={model.name_or_path} loads now (its frozen weights "
                                 "differ); resume with the model it was trained on, or start a new run (a new "
                                 "run.name, or checkpoint.resume=never run.overwrite=true)")


def check_resumable(checkpoints: Path, deepspeed: DeepSpeedConfig, world: int) -> None:
    """Refuse a ZeRO checkpoint written by another number of ranks: DeepSpeed cannot split its
    optimizer state otherwise, and would fail halfway through loading it."""
    tag = (Path(checkpoints) / CHECKPOINT_MARK).read_text().strip()
    ranks = len(list((Path(checkpoints) / tag).glob("*zero_pp_rank_*_optim_states.pt")))
    if ranks and ranks != world:
        raise CheckpointMismatch(f"the checkpoint {Path(checkpoints) / tag} was written by {ranks} trainer ranks "
                                 f"(deepspeed.zero_stage={deepspeed.zero_stage} splits its optimizer state "
                                 f"by rank) and this trainer has {world}: start it with {ranks} ranks "
                                 f"(launch.trainer_ranks={ranks}), or start a new run")
