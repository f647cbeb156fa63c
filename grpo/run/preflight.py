"""What the launcher checks before it starts anything, and --dry-run reports: each thing that would
stop a run later is found now and said in one line with its fix (grpo/config has refused a bad
config already). Each check returns its problems; the launcher decides what is an error."""

from __future__ import annotations

import importlib.util
import sys
from typing import TYPE_CHECKING

from grpo.settings.tree import get_key

if TYPE_CHECKING:
    from grpo.settings import Config

CUDA_KEYS = ("sampling.device", "rewards.reward_model_device")


def source_problems(cfg: Config) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the model and the data: the model can be had, the data source exists,
    and its first rows parse with the configured columns and answer format."""
    from common.sources import SourceError, check_model_source
    from data.problems import check_rows, check_source

    problems, warnings = [], []
    for check in (lambda: check_model_source(cfg.model.name_or_path),
                  lambda: check_source(cfg.data.path, cfg.data.split, cfg.data.task_args)):
        try:
            check()
        except SourceError as e:
            problems.append(str(e))
    if not problems:
        for split in dict.fromkeys([cfg.data.split, *([cfg.eval.split] if cfg.eval.every else [])]):
            try:
                warning = check_rows(cfg.data, split)
            except SourceError as e:
                problems.append(str(e))
                continue
            if warning:
                warnings.append(warning)
    return problems, warnings


def vllm_problem(cfg: Config, sampler_python: str) -> str | None:
    """sampling.engine=vllm with no vLLM to run it: neither sampling.vllm.python nor this Python has it."""
    if cfg.sampling.engine != "vllm" or sampler_python != sys.executable:
        return None  # the vLLM environment exists (make install-vllm checked that vllm imports there)
    if importlib.util.find_spec("vllm") is not None:
        return None
    return (f"sampling.engine=vllm needs vLLM, and neither sampling.vllm.python={cfg.sampling.vllm.python} exists nor "
            f"does {sys.executable} have it: run `make install-vllm` (the CUDA build where nvidia-smi sees a GPU, "
            "the CPU build elsewhere), or set sampling.engine=hf")


def device_problems(cfg: Config, gpus: int) -> list[str]:
    """Settings that need a CUDA GPU, on a machine (or plan) with none."""
    if gpus > 0:
        return []
    wanted = [f"{key}={get_key(cfg, key)}" for key in CUDA_KEYS if str(get_key(cfg, key)).startswith("cuda")]
    if cfg.deepspeed.backend == "nccl":
        wanted.append("deepspeed.backend=nccl")
    return [f"{setting} needs a CUDA GPU and this machine has none (torch sees no GPU): set it to auto, or run on a "
            "machine with a GPU" for setting in wanted]


def planning_note(gpus_planned: int, gpus_here: int) -> str | None:
    """--gpus N plans for another machine: say so when this one could not run that plan."""
    if gpus_planned == gpus_here or gpus_planned == 0:
        return None
    here = "no GPU" if gpus_here == 0 else f"{gpus_here} GPU{'s' * (gpus_here != 1)}"
    return (f"this plan is for {gpus_planned} GPU{'s' * (gpus_planned != 1)} (--gpus {gpus_planned}); this machine "
            f"has {here}, and a start here is planned for what it has")
