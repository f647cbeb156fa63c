"""Time to quality: ours and TRL's GRPOTrainer on the same task for the same wall-clock budget,
both evaluated on the same held-out problems at the same wall-clock marks.

    make bench-learn ARGS="--config configs/needle_haystack.yaml --minutes 15 --ours-minutes 60"
    .venv/bin/python scripts/benchmarks/bench_learn.py [--config config.yaml] [--minutes 30] [--mark-every 3]
                                            [--ours-minutes M --late-mark-every 15]
                                            [--eval-problems 500] [--out runs/bench/learn] [key=value ...]

Same everything: the model, the task and its prompts in the same order (our prompt text and our
PromptCursor's order, given to TRL as plain text with shuffling off), G, temperature, completion
limit, learning rate, LoRA, beta, loss aggregation, clip range and rewards (scripts/benchmarks/bench_vs_trl.py
sets TRL up). One system runs at a time on the whole machine; each one's clock starts when its
process is started (model loading and start-up count), and each is stopped at the budget.

A mark at minute m evaluates the weights of the last update completed by then: ours, the last
published version whose manifest was written by m; TRL, the adapter saved at the end of its
last optimizer step by m (saved after every step; the save is in TRL's time). Minute 0 is the
base model for both. Every mark is evaluated after both runs, with the same greedy evaluation
(grpo evaluate: the first --eval-problems problems of eval.split, scored by
rewards.accuracy_reward), so evaluation takes no training time. Printed and written to --out:
held-out accuracy with its standard error at every mark for both, the minutes each needs to
reach TRL's final accuracy, and a figure of accuracy against minutes.

`--ours-minutes` lets our one run go on past TRL's budget (marks every `--late-mark-every`
after it): nothing in a run depends on its budget (training.steps is set far past it, so a
decaying learning-rate schedule would not differ either), so the first --minutes of the longer
run are the run that would have stopped there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

TRL_MAX_STEPS = 20_000  # rows prepared for TRL; the budget stops it long before


# ---------------------------------------------------------------------------- marks


def mark_minutes(budget: float, every: float, fine_until: float = 0.0, fine_every: float = 1.0) -> list[float]:
    """0, every, 2 * every, ... up to and including the budget; with `fine_until`, every `fine_every`
    minutes up to it first (e.g. 15, 3, 6, 1 -> 0, 1, 2, 3, 4, 5, 6, 9, 12, 15)."""
    def spaced(end: float, step: float) -> list[float]:
        marks, m = [], 0.0
        while m < end - 1e-9:
            marks.append(round(m, 6))
            m += step
        return marks + [float(end)]
    fine = spaced(min(fine_until, budget), fine_every) if fine_until > 0 else []
    return sorted(set(fine) | {m for m in spaced(budget, every) if m > fine_until + 1e-9 or not fine})


def weights_at_marks(updates: list[tuple[float, str]], marks: list[float]) -> dict[float, str | None]:
    """For each mark (minutes), the weights of the last update completed by then (None: the base
    model). `updates` are (minute the update was complete, its weights folder)."""
    chosen = {}
    for mark in marks:
        done = [path for minute, path in sorted(updates) if minute <= mark]
        chosen[mark] = done[-1] if done else None
    return chosen


def minutes_to_reach(curve: list[dict], target: float, margin: float = 0.0) -> float | None:
    """The first mark whose accuracy is at least `target` + `margin` (a negative margin: within it
    below the target), or None."""
    for point in curve:
        if point["answer_accuracy"] >= target + margin - 1e-12:
            return point["minute"]
    return None


def crossing(curve: list[dict], final: dict) -> dict[str, float | None]:
    """When `curve` reaches `final`'s accuracy: at the first mark at or above it ("reach"), and the
    range its standard errors allow: the first mark not below it by more than one combined standard
    error ("earliest") and the first mark above it by more than one ("surely")."""
    def at(sign: float):
        for point in curve:
            se = (point["answer_accuracy_stderr"] ** 2 + final["answer_accuracy_stderr"] ** 2) ** 0.5
            gap = point["answer_accuracy"] - final["answer_accuracy"] - sign * se
            if gap > 1e-12 or (sign < 0 and gap >= -1e-12):  # "surely": more than one s.e. above
                return point["minute"]
        return None
    return {"reach": minutes_to_reach(curve, final["answer_accuracy"]), "earliest": at(-1.0), "surely": at(1.0)}


# ---------------------------------------------------------------------------- the two runs


def run_ours(config: Path, minutes: float, overrides: list[str], folder: Path) -> list[tuple[float, str]]:
    """Our launcher for `minutes`; every published version and the minute its manifest was written."""
    from grpo.run.ports import free_loopback_address

    run_dir = folder / "ours"
    cmd = [sys.executable, "-m", "grpo", "train", "--config", str(config), f"run.dir={run_dir}",
           f"launch.max_minutes={minutes}", "training.steps=100000", "weights.keep_last=100000",
           "checkpoint.every=100000", "eval.every=0", "logging.tensorboard=false",
           f"transport.address={free_loopback_address()}", *overrides]
    start = time.time()
    with open(folder / "ours.log", "wb") as log:
        code = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"our run failed ({code}); see {folder / 'ours.log'} and {run_dir}")
    (folder / "ours-start.json").write_text(json.dumps({"start": start}))
    return published_versions(folder)


def published_versions(folder: Path) -> list[tuple[float, str]]:
    """Every version our finished run published, and the minute its manifest was written."""
    start = json.loads((folder / "ours-start.json").read_text())["start"]
    return [((manifest.stat().st_mtime - start) / 60, str(manifest.parent))
            for manifest in sorted((folder / "ours" / "weights").glob("v*/manifest.json"))]


def run_trl(config: Path, minutes: float, marks: list[float], overrides: list[str],
            folder: Path) -> dict[float, str | None]:
    """TRL's GRPOTrainer for `minutes` in its own process; the adapter at each mark."""
    from trl_recipe import trl_prompt_rows

    from grpo.config import parse_cli
    from grpo.run.preflight import named_code_problems

    cfg = parse_cli(["--config", str(config), *overrides], checks=[named_code_problems])
    rows_file = folder / "trl-rows.json"
    rows_file.write_text(json.dumps(trl_prompt_rows(cfg, TRL_MAX_STEPS)))  # before its clock starts
    out = folder / "trl-marks.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(rows_file), "--config", str(config),
           "--minutes", str(minutes), "--marks", ",".join(map(str, marks)), "--out", str(out),
           "--start", str(time.time()), *overrides]
    with open(folder / "trl.log", "wb") as log:
        code = subprocess.call(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    if code != 0:
        raise SystemExit(f"the TRL run failed ({code}); see {folder / 'trl.log'}")
    return {float(k): v for k, v in json.loads(out.read_text()).items()}


def trl_worker(rows_file: Path, config: Path, minutes: float, marks: list[float], start: float, out: Path,
               overrides: list[str]) -> None:
    """In the TRL process: train until the budget, keeping the adapter of the last step before each mark."""
    from transformers import TrainerCallback
    from trl_recipe import trl_trainer

    from grpo.config import parse_cli
    from grpo.run.preflight import named_code_problems

    cfg = parse_cli(["--config", str(config), *overrides], checks=[named_code_problems])
    snapshots = out.parent / "trl-snapshots"

    class KeepAdapterAtMarks(TrainerCallback):
        """After each optimizer step: the adapter is saved; a mark passed since the previous step
        gets the previous step's adapter (the last update completed by the mark)."""

        def __init__(self):
            self.previous: str | None = None  # the last saved adapter, None = the base model
            self.at_mark: dict[float, str | None] = {}

        def on_step_end(self, _args, state, control, model=None, **_):
            minute = (time.time() - start) / 60
            for mark in marks:
                if mark not in self.at_mark and mark < minute:
                    self.at_mark[mark] = self.previous
            if self.previous is not None and self.previous not in self.at_mark.values():
                shutil.rmtree(self.previous)
            self.previous = str(snapshots / f"step-{state.global_step:06d}")
            model.save_pretrained(self.previous)
            if minute >= minutes:
                control.should_training_stop = True
            return control

    keeper = KeepAdapterAtMarks()
    trainer = trl_trainer(cfg, json.loads(rows_file.read_text()), out.parent / "trl-output", TRL_MAX_STEPS, [keeper])
    trainer.train()
    for mark in marks:  # the marks at or after the last step: its adapter
        keeper.at_mark.setdefault(mark, keeper.previous)
    out.write_text(json.dumps({str(k): v for k, v in keeper.at_mark.items()}))


# ---------------------------------------------------------------------------- evaluation and report


def evaluate_marks(config: Path, overrides: list[str], systems: dict[str, dict], problems: int, batch_size: int,
                   folder: Path) -> dict[str, list[dict]]:
    """Each system's held-out accuracy at each mark (weights evaluated once each; the base once for all)."""
    import torch

    from grpo.commands.evaluate import evaluate
    from grpo.config import parse_cli
    from grpo.run.preflight import named_code_problems
    from grpo.sampler.evaluation import summary

    cfg = parse_cli(["--config", str(config), *overrides], checks=[named_code_problems])
    done: dict[str | None, dict] = {}
    curves = {}
    for name, at_mark in systems.items():
        curves[name] = []
        for mark, weights in sorted(at_mark.items()):
            if weights not in done:
                tag = "base" if weights is None else f"{name}-{Path(weights).name}"
                kept = folder / "eval" / f"{tag}.samples.jsonl"
                earlier = [json.loads(line) for line in kept.read_text().splitlines()] if kept.exists() else []
                if len(earlier) == problems:  # evaluated by an earlier --eval-only that stopped part way
                    result = summary(earlier)
                else:
                    torch.manual_seed(cfg.seed)
                    result, samples = evaluate(cfg, Path(weights) if weights else None, problems, batch_size,
                                               cfg.eval.split)
                    kept.parent.mkdir(exist_ok=True)
                    kept.write_text("".join(json.dumps(s) + "\n" for s in samples))
                done[weights] = result
                print(f"{name} minute {mark:g}: {tag} accuracy {result['answer_accuracy']:.3f} "
                      f"± {result['answer_accuracy_stderr']:.3f}", flush=True)
            r = done[weights]
            curves[name].append({"minute": mark, "weights": weights, "answer_accuracy": r["answer_accuracy"],
                                 "answer_accuracy_stderr": r["answer_accuracy_stderr"], "format_rate": r["format_rate"],
                                 "problems": r["problems"]})
    return curves


def report(curves: dict[str, list[dict]]) -> tuple[str, dict]:
    """The table of both curves (ours may run on past TRL's budget) and the minutes each needs to
    reach TRL's final accuracy."""
    final = curves["TRL"][-1]
    target = final["answer_accuracy"]
    reach = {name: minutes_to_reach(curve, target) for name, curve in curves.items()}
    bounds = {name: crossing(curve, final) for name, curve in curves.items()}
    cell = {name: {p["minute"]: f"{100 * p['answer_accuracy']:.1f}% ± {100 * p['answer_accuracy_stderr']:.1f}"
                   for p in curve} for name, curve in curves.items()}
    lines = ["| minute | ours accuracy | TRL accuracy |", "| --- | --- | --- |"]
    for minute in sorted(set(cell["ours"]) | set(cell["TRL"])):
        lines.append(f"| {minute:g} | {cell['ours'].get(minute, '-')} | {cell['TRL'].get(minute, '-')} |")
    ratio = (reach["ours"] / reach["TRL"]) if reach["ours"] is not None and reach["TRL"] else None
    lines.append(f"\nTRL's final accuracy {100 * target:.1f}%: reached by ours at minute "
                 f"{reach['ours'] if reach['ours'] is not None else 'never'}, by TRL at minute {reach['TRL']}"
                 + (f" (ours / TRL time: {ratio:.2f}x)" if ratio is not None else "")
                 + f"; ours within one combined standard error of it from minute "
                   f"{bounds['ours']['earliest'] if bounds['ours']['earliest'] is not None else 'never'}, above it by "
                   f"more than one from minute "
                   f"{bounds['ours']['surely'] if bounds['ours']['surely'] is not None else 'never'}")
    return "\n".join(lines), {"target_accuracy": target, "target_stderr": final["answer_accuracy_stderr"],
                               "minutes_to_target": reach, "time_ratio": ratio, "crossing": bounds}


def plot(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, curve in curves.items():
        ax.errorbar([p["minute"] for p in curve], [100 * p["answer_accuracy"] for p in curve],
                    yerr=[100 * p["answer_accuracy_stderr"] for p in curve], marker="o", capsize=3, label=name)
    ax.set_xlabel("wall-clock minutes (2 CPU cores)")
    ax.set_ylabel(f"held-out accuracy, % (n = {curves['ours'][0]['problems']}, ±1 s.e.)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def argument_parser() -> argparse.ArgumentParser:
    """The benchmark's command line (the hidden --trl-worker, --marks and --start: its TRL child's)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    parser.add_argument("--minutes", type=float, default=30.0, help="wall-clock budget of each system")
    parser.add_argument("--mark-every", type=float, default=3.0, help="minutes between evaluation marks")
    parser.add_argument("--fine-until", type=float, default=0.0,
                        help="marks every --fine-every minutes up to this minute, then every --mark-every")
    parser.add_argument("--fine-every", type=float, default=1.0)
    parser.add_argument("--ours-minutes", type=float, default=None,
                        help="ours' budget when it differs from TRL's: longer (one run: its first --minutes are the "
                             "side-by-side; marks every --late-mark-every after them) or shorter (enough to pass "
                             "TRL's final accuracy)")
    parser.add_argument("--late-mark-every", type=float, default=15.0,
                        help="minutes between ours' marks after --minutes")
    parser.add_argument("--eval-problems", type=int, default=500)
    parser.add_argument("--eval-batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench" / "learn")
    parser.add_argument("--keep-ours", action="store_true",
                        help="reuse our finished run in --out (its weights and start time) and run TRL only")
    parser.add_argument("--skip-eval", action="store_true",
                        help="run both and record their weights at the marks, evaluate later with --eval-only")
    parser.add_argument("--eval-only", action="store_true",
                        help="evaluate and report the marks of finished runs in --out (same --minutes and marks)")
    parser.add_argument("--trl-final-only", action="store_true",
                        help="evaluate TRL at its final mark only (and the base model), not its curve")
    parser.add_argument("--trl-worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--marks", default="", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, default=0.0, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str]) -> int:
    parser = argument_parser()
    args, overrides = parser.parse_known_args(argv)
    if args.trl_worker:
        trl_worker(args.trl_worker, args.config, args.minutes, [float(m) for m in args.marks.split(",")], args.start,
                   args.out, overrides)
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: make bench-learn (or .venv/bin/pip install -r requirements-bench.txt)",
              file=sys.stderr)
        return 2
    folder = args.out
    marks = mark_minutes(args.minutes, args.mark_every, args.fine_until, args.fine_every)
    ours_minutes = args.ours_minutes or args.minutes
    if min(args.mark_every, args.fine_every, args.late_mark_every) <= 0:
        parser.error("mark spacings must be positive")
    ours_marks = sorted({m for m in marks if m <= ours_minutes + 1e-9} | {float(ours_minutes)} |
                        {m for m in mark_minutes(ours_minutes, args.late_mark_every) if m > args.minutes + 1e-9})
    if args.eval_only:  # the marks of runs made with --skip-eval (evaluation needs no quiet machine)
        ours = weights_at_marks(published_versions(folder), ours_marks)
        trl = {float(k): v for k, v in json.loads((folder / "trl-marks.json").read_text()).items()}
        if set(trl) != set(marks):
            parser.error(f"the TRL run in {folder} was marked at {sorted(trl)}, these arguments mark {marks}: "
                         "pass the --minutes and mark spacing it ran with")
    else:
        if args.keep_ours:
            for path in ("trl-snapshots", "trl-output", "eval"):
                shutil.rmtree(folder / path, ignore_errors=True)
            ours = weights_at_marks(published_versions(folder), ours_marks)
        else:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            ours = weights_at_marks(run_ours(args.config, ours_minutes, overrides, folder), ours_marks)
        trl = run_trl(args.config, args.minutes, marks, overrides, folder)
        if args.skip_eval:
            print(f"both runs done; evaluate their marks with the same arguments and --eval-only (in {folder})")
            return 0
    if args.trl_final_only:
        trl = {marks[0]: trl[marks[0]], marks[-1]: trl[marks[-1]]}
    curves = evaluate_marks(args.config, overrides, {"ours": ours, "TRL": trl}, args.eval_problems,
                            args.eval_batch_size, folder)
    text, summary = report(curves)
    print(text)
    title = f"{args.config.stem}: held-out accuracy against wall-clock time"
    plot(curves, folder / "accuracy_vs_minutes.png", title)
    (folder / "result.json").write_text(json.dumps({"config": str(args.config), "overrides": overrides,
                                                    "minutes": args.minutes, "ours_minutes": ours_minutes,
                                                    "marks": marks,
                                                    "ours_marks": ours_marks, "cpu_count": os.cpu_count(),
                                                    "curves": curves, **summary}, indent=1))
    print(f"wrote {folder / 'result.json'} and {folder / 'accuracy_vs_minutes.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
