"""What a first run would otherwise do before its first step, done once at install time (`make install`):
the embedded model converted from GGUF into its cached safetensors folder (~20 s), a per-user cache
that every later run reuses (a run still converts it itself when it is missing).

    .venv/bin/python scripts/prepare.py                # what `make install` runs
    .venv/bin/python scripts/prepare.py --has-shm-op   # exit 0 when DeepSpeed's CPU op is compiled into this venv

`make install` compiles DeepSpeed's shared-memory op for CPU ranks into the venv itself
(DS_BUILD_SHM_COMM=1, see the Makefile), so that no run builds it; `--has-shm-op` tells the
Makefile whether that is done, reading DeepSpeed's build record without importing DeepSpeed.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHM_OP = "deepspeed_shm_comm"


def installed_deepspeed_ops() -> dict:
    """DeepSpeed's record of the ops compiled into its install (git_version_info_installed.py), or {}."""
    spec = importlib.util.find_spec("deepspeed")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return {}
    record = Path(list(spec.submodule_search_locations)[0]) / "git_version_info_installed.py"
    if not record.is_file():
        return {}
    for node in ast.parse(record.read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "installed_ops":
            return ast.literal_eval(node.value)
    return {}


def main(argv: list[str]) -> int:
    if argv == ["--has-shm-op"]:
        return 0 if installed_deepspeed_ops().get(SHM_OP) else 1
    from grpo.common.model_files import resolve_model_path
    from grpo.common.sources import EMBEDDED_MODELS

    for alias in EMBEDDED_MODELS:
        t = time.perf_counter()
        path = resolve_model_path(alias)
        print(f"embedded model {alias}: {path} ({time.perf_counter() - t:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
