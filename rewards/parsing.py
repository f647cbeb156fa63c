"""Numbers as written in a completion (the lenient reward's last number, the format reward's count).
Whether two answers are equal is math-verify's to say (rewards/gsm8k_answer.py)."""

from __future__ import annotations

import re

# a number as written in math word problems: optional sign, digit groups with commas, decimals
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+", re.ASCII)  # ASCII: "٧٢" is not GSM8K's 72
THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))", re.ASCII)


def find_numbers(text: str) -> list[str]:
    """All numbers in `text`, with `$`, thousands commas and a trailing period removed."""
    text = text.replace("$", "")
    return [THOUSANDS_COMMA.sub("", m.group()).rstrip(",") for m in NUMBER_RE.finditer(text)]
