"""The sections of the config tree that set up how the run runs rather than what it learns:
the trainer's distributed backend, the transport between sampler and trainer, how weights are
published, logging, checkpoints and the launcher. grpo/settings/__init__.py imports them back into
the one tree (`Config`), so `from grpo.settings import X` holds for every section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from grpo.settings.choices import TRACKERS, WANDB_MODES
from grpo.settings.tree import setting


@dataclass
class DeepSpeedConfig:
    backend: str = setting("auto", "Distributed backend: auto (nccl on GPU, gloo on CPU), nccl or gloo.",
        choices=("auto", "nccl", "gloo"))
    zero_stage: int = setting(0, "ZeRO stage 0-3 (3 also partitions the parameters; published weights are gathered "
        "first).", bound="in [0, 3]")
    config: dict = setting({}, "Extra DeepSpeed settings merged into the generated DeepSpeed config.")


@dataclass
class TransportConfig:
    address: str = setting("tcp://127.0.0.1:5555", "ZeroMQ address the trainer binds and the sampler connects to.")
    high_water_mark: int = setting(2, "Batches queued before the sampler blocks (back-pressure).", bound=">= 1")
    send_timeout_s: float = setting(600.0, "Sampler gives up when no trainer takes a batch for this long.")
    recv_timeout_s: float = setting(1800.0, "Trainer gives up when no batch arrives for this long.")
    max_message_mb: float = setting(512.0, "Largest accepted message.")
    secret: Optional[str] = setting(None, "Shared secret for HMAC-signed messages (or env GRPO_TRANSPORT_SECRET).")
    allow_insecure: bool = setting(False, "Allow a non-loopback address without a secret.")


@dataclass
class WeightsConfig:
    channel: str = setting("folder", "How the trainer's weights reach the samplers: folder (versions written to "
        "weights.dir, which the samplers watch; grpo/weights/).", choices=("folder",))
    dir: Optional[str] = setting(None, "Published weights folder. Default <run.dir>/weights.")
    publish_every: int = setting(1, "Publish every N optimizer steps.", bound=">= 1")
    keep_last: int = setting(3, "Published versions kept on disk.", bound=">= 1")


@dataclass
class LoggingConfig:
    level: str = setting("INFO", "Python logging level.", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    tensorboard: bool = setting(True, "Also write TensorBoard events to <run.dir>/tb.")
    backend: str = setting("none", "Experiment tracker beside metrics.jsonl and TensorBoard, with the same metric "
        "names against `step`: none, wandb or trackio (grpo/run/tracking.py).", choices=TRACKERS)
    project: str = setting("grpo-trainer", "The tracker's project; the run is named run.name.")
    completions_per_step: int = setting(4, "The first N completions of each step, with prompt, rewards and advantage, "
        "go to <run.dir>/completions.jsonl and the tracker's 'completions' table (0 = off).",
        bound=">= 0", why="0 = off")
    wandb_mode: str = setting("offline", "logging.backend=wandb: offline (files in <run.dir>/wandb, no network; upload "
        "them later with `wandb sync`) or online (needs `wandb login`).", choices=WANDB_MODES)


@dataclass
class CheckpointConfig:
    every: int = setting(50, "Checkpoint every N steps (and at a clean exit).", bound=">= 1")
    resume: str = setting("auto", "auto (continue from the run folder's last checkpoint if it has one, else start "
        "fresh), never (start fresh), or a checkpoint folder (with DeepSpeed's 'latest' file).")
    keep_last: int = setting(2, "Checkpoints kept on disk.", bound=">= 1")


@dataclass
class LaunchConfig:
    trainer_ranks: int = setting(0, "Trainer ranks started by grpo train. 0 = auto: every GPU but the last "
        "(which samples), one GPU shared by both, or 1 rank on a CPU-only machine.", bound=">= 0", why="0 = automatic")
    cpu_threads: int = setting(0, "Threads per process on a CPU-only machine. 0 = the cores split between sampler and "
        "trainer.", bound=">= 0", why="0 = automatic")
    max_minutes: float = setting(0.0, "Wall-clock budget for grpo train: at this many minutes it stops both "
        "processes cleanly (the trainer checkpoints; the last published weights are the result). 0 = none.",
        bound=">= 0", why="0 = no limit")
    stall_s: float = setting(180.0, "A worker silent in its log this long during start-up gets its Python stacks "
        "logged; silent twice as long, grpo train stops the run. 0 = never.",
        bound=">= 0", why="0 = never")
