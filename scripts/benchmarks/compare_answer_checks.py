"""How many GSM8K answer verdicts math-verify changes against the hand-written rule it replaced, and why.

    .venv/bin/python scripts/benchmarks/compare_answer_checks.py runs/eval/base.samples.jsonl [more.samples.jsonl ...]
    .venv/bin/python scripts/benchmarks/compare_answer_checks.py --solutions      # GSM8K test's own worked solutions

Samples files are what grpo evaluate writes next to its summary (the completion and the
reference answer of each problem). `--solutions` builds one completion per GSM8K test problem
from its worked solution: the reasoning in <think> and, in <answer>, the solution's last
sentence as written (units, '$', the sum that gives the number) — the way a verbose model
states an answer. Each changed verdict is put in a class by what the answer block holds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from decimal import Decimal, InvalidOperation
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from grpo.rewards.gsm8k_answer import CORRECT, gsm8k_answer, last_answer_block  # noqa: E402
from grpo.rewards.parsing import THOUSANDS_COMMA, find_numbers  # noqa: E402


def previous_rule(completion: str, answer: str) -> bool:
    """The hand-written check math-verify replaced: the last <answer> block holds exactly one
    number ('$', thousands commas and a closing period removed) equal to the reference as a Decimal."""
    block = last_answer_block(completion)
    numbers = find_numbers(block) if block is not None else []
    if len(numbers) != 1:
        return False
    try:
        return Decimal(THOUSANDS_COMMA.sub("", numbers[0]).rstrip(".")) == Decimal(answer)
    except InvalidOperation:
        return False


def change_class(block: str | None) -> str:
    """What an answer block holds, for the table of changed verdicts."""
    if block is None:
        return "no <answer> block"
    numbers = find_numbers(block)
    if "\\" in block or "{" in block:
        return "LaTeX"
    if "=" in block:
        return "an equation (the value after '=')"
    if "/" in block and len(numbers) == 2:
        return "a fraction"
    if "%" in block:
        return "a percentage"
    if len(numbers) > 1:
        return "several numbers (math-verify reads one value)"
    if len(numbers) == 1:
        return "one number with other text"
    return "no number"


def compare(samples: list[dict]) -> dict:
    """Verdict counts under both checks, and the changed ones by class with an example each."""
    changes: Counter = Counter()
    examples: dict[str, str] = {}
    both = {"right both": 0, "wrong both": 0, "right only with math-verify": 0, "right only with the previous rule": 0}
    for s in samples:
        new, old = gsm8k_answer(s["completion"], s["answer"]) == CORRECT, previous_rule(s["completion"], s["answer"])
        key = {(True, True): "right both", (True, False): "right only with math-verify",
               (False, True): "right only with the previous rule", (False, False): "wrong both"}[new, old]
        both[key] += 1
        if new != old:
            block = last_answer_block(s["completion"])
            label = f"{'+' if new else '-'} {change_class(block)}"
            changes[label] += 1
            examples.setdefault(label, f"{(block or '').strip()[:80]!r} vs reference {s['answer']}")
    return {"samples": len(samples), **both, "changed": sum(changes.values()),
            "changes": [{"class": k, "count": v, "example": examples[k]} for k, v in changes.most_common()]}


def solution_samples() -> list[dict]:
    """GSM8K test's worked solutions as completions whose answer is the last sentence as written."""
    from grpo.data.embedded import embedded_rows
    from grpo.data.problems import parse_final_answer, solution_reasoning

    samples = []
    for row in embedded_rows("test"):
        reasoning = solution_reasoning(row["answer"])
        last = [line for line in reasoning.splitlines() if line.strip()][-1]
        samples.append({"completion": f"<think>\n{reasoning}\n</think>\n<answer>{last}</answer>",
                        "answer": parse_final_answer(row["answer"])})
    return samples


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("samples", nargs="*", type=Path)
    parser.add_argument("--solutions", action="store_true",
                        help="GSM8K test's worked solutions, last sentence as the answer")
    args = parser.parse_args(argv)
    sets = {str(p): [json.loads(line) for line in p.read_text().splitlines() if line.strip()] for p in args.samples}
    if args.solutions:
        sets["GSM8K test worked solutions"] = solution_samples()
    for name, samples in sets.items():
        print(f"{name}: {json.dumps(compare(samples), indent=1)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
