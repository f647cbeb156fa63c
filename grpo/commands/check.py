"""Check a finished run folder the way a user would use it (CI's smoke step runs this after `make train`).

    grpo check runs/ci-smoke --steps 2 [--max-logp-difference 1e-3] [--completions 2]
    (or grpo check ...)

Asserts: `metrics.jsonl` has one row per step 1..N (with env.name, each with the episode metrics; and, if asked,
every row's
`sampling/sampling_logp_difference/mean` below the bound: the sampler/trainer mismatch; a service reward,
e.g. an HTTP one,
scored some sample); `completions.jsonl` shows completions of every step (printed: the last ones, to
read); `weights/LATEST` is N and that version's
checksums verify; and, for a LoRA run, the published adapter loads with `peft.PeftModel.from_pretrained`
on the base model (a real client, not our loader) and changes its logits. Exit 1 with the reason
otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from grpo.common.run_folder import RunFolder
from grpo.config import load_config
from grpo.model.loading import load_model, load_tokenizer
from grpo.run.rows import is_evaluation_row
from grpo.sampler.shown_completions import shown_text
from grpo.weights.folder import read_latest, verify, version_dir


def check(run_dir: Path, steps: int, max_logp_difference: float | None = None, completions: int = 2) -> list[str]:
    """What is wrong with the run folder (empty when nothing is)."""
    problems = []
    rows = [json.loads(line) for line in RunFolder(run_dir).metrics.read_text().splitlines() if line.strip()]
    rows = [row for row in rows if not is_evaluation_row(row)]
    if [row["step"] for row in rows] != list(range(1, steps + 1)):
        problems.append(f"metrics.jsonl steps are {[row['step'] for row in rows]}, expected 1..{steps}")
    cfg = load_config(RunFolder(run_dir).config, written_by_a_run=True)
    if cfg.env.name:  # episodes: every row reports them
        missing = [row["step"] for row in rows if "env/turns/mean" not in row]
        if missing:
            problems.append(f"env.name={cfg.env.name} but steps {missing} have no env/turns/mean")
        print("env/turns/mean, env/tool_calls/mean per step:",
              [(row.get("env/turns/mean"), row.get("env/tool_calls/mean")) for row in rows])
    problems += service_problems(cfg, rows)
    problems += completion_problems(run_dir, cfg.logging.completions_per_step, steps, completions)
    key = "sampling/sampling_logp_difference/mean"
    if max_logp_difference is not None:
        gaps = [row.get(key) for row in rows]
        print(f"{key} per step: {gaps}")
        if not all(gap is not None and gap < max_logp_difference for gap in gaps):
            problems.append(f"{key} is {gaps}, expected every step below {max_logp_difference:g}")
    latest = read_latest(cfg.weights_dir)
    if latest != steps:
        return problems + [f"weights/LATEST is {latest}, expected {steps}"]
    folder = version_dir(cfg.weights_dir, latest)
    manifest = verify(folder)
    if manifest["kind"] != "lora":
        return problems
    from peft import PeftModel

    tokenizer = load_tokenizer(cfg.model)
    ids = torch.tensor([tokenizer("What is 2 + 3?")["input_ids"]])
    base = load_model(cfg.model).eval()
    with torch.no_grad():
        base_logits = base(ids).logits
        adapted = PeftModel.from_pretrained(base, str(folder)).eval()
        adapted_logits = adapted(ids).logits
    if torch.equal(base_logits, adapted_logits):
        problems.append(f"the adapter in {folder} loads but leaves the base model's logits unchanged")
    print(f"{folder.name}: PeftModel.from_pretrained loaded it; max |logit change| "
          f"{(adapted_logits - base_logits).abs().max().item():.3e}")
    return problems


def service_problems(cfg, rows: list[dict]) -> list[str]:
    """A reward model, HTTP reward or judge that failed on every sample of every step (its server
    was never up, say): the run learned nothing from it, which would otherwise pass unseen."""
    from grpo.rewards.services import is_service_name

    per_round = cfg.sampling.prompts_per_step * cfg.sampling.group_size
    problems = []
    for name in filter(is_service_name, cfg.rewards.names):
        failures = [row.get(f"rewards/{name}/failures") for row in rows]
        # dynamic sampling scores several rounds a step: every one of them must have failed
        scored = [per_round * row.get("sampling/dynamic_rounds", 1.0) for row in rows]
        print(f"rewards/{name}/failures per step: {failures}")
        if failures and all(f is not None and f >= n for f, n in zip(failures, scored)):
            problems.append(f"the reward {name} failed on every sample of every step ({failures}): the run learned "
                            "nothing from it; see sampler.log")
    return problems


def completion_problems(run_dir: Path, per_step: int, steps: int, shown: int) -> list[str]:
    """completions.jsonl holds each step's shown completions (logging.completions_per_step); the last
    `shown` of them are printed to read."""
    if not per_step:
        return []
    path = RunFolder(run_dir).completions
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    for record in records[len(records) - shown:] if shown else []:
        print(readable_completion(record))
    shown_steps = sorted({record["step"] for record in records})
    if shown_steps != list(range(1, steps + 1)):
        return [f"completions.jsonl has completions of steps {shown_steps}, expected 1..{steps} "
                f"(logging.completions_per_step={per_step})"]
    return []


def readable_completion(record: dict, width: int = 600) -> str:
    """One shown completion for a terminal: its step, rewards and advantage, the prompt's last turn
    and the completion (each cut at `width` characters)."""
    rewards = ", ".join(f"{name} {'failed' if value is None else f'{value:g}'}"
                        for name, value in record["rewards"].items())
    reward = "failed" if record["reward"] is None else f"{record['reward']:g}"
    last = record["prompt"][-1] if record["prompt"] else {"role": "user", "content": ""}
    return (f"--- step {record['step']} (sampler {record['sampler']}), {record['sample_id']}: reward {reward} "
            f"({rewards}), advantage {record['advantage']:+.3f}\n{last['role']}: {shown_text(last['content'], width)}\n"
            f"model: {shown_text(record['completion'], width)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--max-logp-difference", type=float, help="bound on every row's mean sampler/trainer gap")
    parser.add_argument("--completions", type=int, default=2, help="the last N shown completions to print (0: none)")
    args = parser.parse_args(argv)
    problems = check(args.run_dir, args.steps, args.max_logp_difference, args.completions)
    for problem in problems:
        print(f"check_run: {problem}", file=sys.stderr)
    if not problems:
        print(f"check_run: {args.run_dir} has {args.steps} metrics rows, weights v{args.steps}, all checks passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
