"""training.epochs: a run's length in passes over its problems, turned into training.steps by each
process alike (the launcher for its progress, the sampler and the trainer for when to stop, from
the same rows)."""

from __future__ import annotations

import logging
import math

from grpo.common.sources import SourceError
from grpo.data.mixture import source_configs
from grpo.data.problems import load_split
from grpo.settings import Config
from grpo.settings.tree import ConfigError

log = logging.getLogger(__name__)


def steps_for_epochs(epochs: float, problems: int, prompts_per_step: int) -> int:
    """Steps that draw `epochs` passes over `problems`, `prompts_per_step` a step (at least one)."""
    return max(1, math.ceil(epochs * problems / prompts_per_step))


def with_epochs_as_steps(cfg: Config) -> Config:
    """`cfg` with training.steps set from training.epochs when that is on (ConfigError naming the data
    when its rows cannot be counted)."""
    training = cfg.training
    if training.epochs <= 0:
        return cfg
    try:
        problems = sum(len(load_split(source, source.split)[0]) for source in source_configs(cfg.data))
    except SourceError as e:
        raise ConfigError(f"training.epochs={training.epochs:g} counts the problems of data.split, which cannot "
                          f"be read: {e}") from None
    training.steps = steps_for_epochs(training.epochs, problems, cfg.sampling.prompts_per_step)
    log.info("training.epochs=%g: %d steps of %d prompts over %d problems", training.epochs, training.steps,
             cfg.sampling.prompts_per_step, problems)
    return cfg
