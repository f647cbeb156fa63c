"""What starts the run's processes, here (grpo/commands/local.py) and on a cluster
(grpo/commands/slurm.py): their modules, the Python each runs in, where our packages come from."""

from __future__ import annotations

import sys
from pathlib import Path

from grpo.settings import Config

PROJECT_ROOT = Path(__file__).resolve().parents[2]  # a checkout, or site-packages when installed
TRAINER_MODULE, SAMPLER_MODULE = "grpo.workers.trainer", "grpo.workers.sampler"  # the processes' mains


def sampler_python(cfg: Config) -> str:
    """An engine with a `python` setting (vLLM: sampling.vllm.python, requirements-vllm-cpu.txt says
    why) runs its sampler in that environment when it exists; every other one in ours."""
    python = getattr(getattr(cfg.sampling, cfg.sampling.engine, None), "python", None)
    for base in (Path.cwd(), PROJECT_ROOT) if python else ():  # a relative path: from here, else from the checkout
        if (base / python).is_file():
            return str(base / python)
    return sys.executable


def checkout_root() -> str | None:
    """A checkout's root goes on every process's PYTHONPATH, so that a vLLM environment without this
    project installed runs the sampler too (an installed package's site-packages would mix two
    environments' packages: never)."""
    return str(PROJECT_ROOT) if (PROJECT_ROOT / "pyproject.toml").is_file() else None
