"""What a first run would otherwise do before its first step, done once at install time (`make install`):
the embedded model converted from GGUF into its cached safetensors folder (~20 s), and DeepSpeed's
shared-memory communication op for CPU ranks compiled into torch's extension cache (~45 s). Both are
per-user caches, reused by every later run, and a run still does either itself when it is missing.

    .venv/bin/python scripts/prepare.py            # what `make install` runs
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from grpo.model.loading import resolve_model_path
    from grpo.sources import EMBEDDED_MODELS

    for alias in EMBEDDED_MODELS:
        t = time.perf_counter()
        path = resolve_model_path(alias)
        print(f"embedded model {alias}: {path} ({time.perf_counter() - t:.0f} s)")
    t = time.perf_counter()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    # as DeepSpeed's own comm start-up decides (deepspeed/comm/torch.py: build_shm_op)
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        print("DeepSpeed: no shared-memory op to build for this accelerator")
        return 0
    # the build finds ninja on PATH: the venv's own, when make runs .venv/bin/python without activating it
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    try:
        builder.load(verbose=False)
    except Exception as e:  # a run builds it again (and says why it fails there); the install goes on
        print(f"warning: DeepSpeed's {builder.NAME} op did not build ({type(e).__name__}: {e}); the first run "
              "will try again", file=sys.stderr)
        return 0
    print(f"DeepSpeed op {builder.absolute_name()} built ({time.perf_counter() - t:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
