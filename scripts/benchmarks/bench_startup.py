"""Start-up: seconds from the launch command to the sampler's first generated batch and to the
trainer's first step, warm (the embedded model converted and DeepSpeed's CPU op built, as
`make install` leaves them) and cold (empty caches: a first run without scripts/prepare.py).

    .venv/bin/python scripts/benchmarks/bench_startup.py                            # the default config
    .venv/bin/python scripts/benchmarks/bench_startup.py --config configs/needle_haystack.yaml --repeats 3
    .venv/bin/python scripts/benchmarks/bench_startup.py --cold                     # also from empty caches

Each run is `grpo train ... training.steps=2` in a fresh run folder; the milestones are read
off its logs' timestamps: the sampler ready (its prompts built), its first batch sent (generated,
scored, its log-probs made), the trainer ready (DeepSpeed initialised) and its first step done.
Cold runs point GRPO_CACHE and TORCH_EXTENSIONS_DIR at empty folders; `--cold` also times
scripts/prepare.py into empty ones (what the install adds).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) INFO (.*)$")
MILESTONES = {  # (log, words in the message) -> milestone
    ("sampler", " prompts from "): "sampler ready",
    ("sampler", "step 0 v"): "first batch sent",
    ("trainer", " ranks ("): "trainer ready",
    ("trainer", "step 1 loss"): "first trained step",
}


def milestones(run_dir: Path, start: float) -> dict[str, float]:
    """Seconds from `start` to each milestone, off the logs' timestamps."""
    found = {}
    for log in ("sampler", "trainer"):
        for line in (run_dir / f"{log}.log").read_text(errors="replace").splitlines():
            match = STAMP.match(line)
            if not match:
                continue
            at = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for (which, prefix), name in MILESTONES.items():
                if which == log and name not in found and prefix in match.group(3):
                    found[name] = at - start
    return found


def launch(config: str, env: dict, overrides: list[str]) -> tuple[dict[str, float], float]:
    """One two-step run: its milestones and its whole wall time."""
    run_dir = Path(tempfile.mkdtemp(prefix="bench-startup-", dir=ROOT / "runs"))
    shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "grpo", "train", "--config", config, f"run.dir={run_dir}",
           "training.steps=2", "logging.tensorboard=false", *overrides]
    start = time.time()
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({done.returncode}):\n{done.stdout[-3000:]}")
    found = milestones(run_dir, start)
    missing = set(MILESTONES.values()) - set(found)
    if missing:
        raise SystemExit(f"milestones not found in {run_dir}'s logs: {sorted(missing)}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return found, wall


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="config.yaml")
    parser.add_argument("--repeats", type=int, default=2, help="warm runs (medians are printed)")
    parser.add_argument("--cold", action="store_true", help="also one run from empty caches, and prepare.py timed")
    args, overrides = parser.parse_known_args(argv)
    (ROOT / "runs").mkdir(exist_ok=True)
    rows = {}
    launch(args.config, dict(os.environ), overrides)  # warms the caches and the page cache, in nobody's time
    warm = [launch(args.config, dict(os.environ), overrides) for _ in range(args.repeats)]
    rows["warm"] = ({name: statistics.median(run[0][name] for run in warm) for name in warm[0][0]},
                    statistics.median(run[1] for run in warm))
    if args.cold:
        with tempfile.TemporaryDirectory() as empty:
            env = {**os.environ, "GRPO_CACHE": f"{empty}/grpo", "TORCH_EXTENSIONS_DIR": f"{empty}/extensions"}
            rows["cold (first run, no prepare)"] = launch(args.config, env, overrides)
        with tempfile.TemporaryDirectory() as empty:
            env = {**os.environ, "GRPO_CACHE": f"{empty}/grpo", "TORCH_EXTENSIONS_DIR": f"{empty}/extensions"}
            t = time.time()
            subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare.py")], env=env, check=True,
                           stdout=subprocess.DEVNULL)
            prepare_s = time.time() - t
            rows["after prepare.py (first run)"] = launch(args.config, env, overrides)
    names = list(MILESTONES.values())
    print(f"{args.config} {' '.join(overrides)}: seconds from the launch command, {os.cpu_count()} CPUs")
    print("| start | " + " | ".join(names) + " | two steps, whole command |")
    print("|---" * (len(names) + 2) + "|")
    for label, (found, wall) in rows.items():
        print(f"| {label} | " + " | ".join(f"{found.get(n, float('nan')):.1f}" for n in names) + f" | {wall:.1f} |")
    if args.cold:
        print(f"scripts/prepare.py into empty caches (what make install adds): {prepare_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
