"""The strict GSM8K rates every run reports, whatever rewards it trains on."""

from __future__ import annotations

from rewards.gsm8k_answer import CORRECT, gsm8k_answer
from rewards.think_format import FORMAT_OK, think_answer_format


def strict_rates(texts: list[str], answers: list[str]) -> dict[str, float]:
    """The strict answer accuracy and exact-format rate of completions against their reference answers."""
    n = max(len(texts), 1)
    return {"strict/answer_accuracy": sum(gsm8k_answer(t, a) == CORRECT for t, a in zip(texts, answers)) / n,
            "strict/format_rate": sum(think_answer_format(t, a) == FORMAT_OK for t, a in zip(texts, answers)) / n}
