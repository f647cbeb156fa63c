"""Where the project's code is on disk: `grpo`, and `grpo.rewards` and `grpo.data`, which a checkout keeps
beside grpo/ (rewards/, data/) and a wheel installs inside it (pyproject.toml's package-dir)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

CODE_PACKAGES = ("grpo", "grpo.rewards")  # read whole by a jailed call; grpo.data holds datasets: its .py files only
DATA_PACKAGE = "grpo.data"


def package_folder(name: str) -> Path:
    """The folder the package `name` is imported from (without importing it)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"{name} is not installed: run `make install` (or `pip install -e .`) in the checkout")
    return Path(next(iter(spec.submodule_search_locations))).resolve()
