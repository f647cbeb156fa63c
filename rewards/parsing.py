"""Number parsing for the answer rewards."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# a number as written in math word problems: optional sign, digit groups with commas, decimals
NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+", re.ASCII)  # ASCII: "٧٢" is not GSM8K's 72
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))", re.ASCII)


def find_numbers(text: str) -> list[str]:
    """All numbers in `text`, with `$`, thousands commas and a trailing period removed."""
    text = text.replace("$", "")
    return [_THOUSANDS_COMMA.sub("", m.group()).rstrip(",") for m in NUMBER_RE.finditer(text)]


def to_decimal(text: str) -> Decimal | None:
    """'1,234.50' -> Decimal('1234.50'); anything that is not one number -> None."""
    cleaned = _THOUSANDS_COMMA.sub("", text.strip().replace("$", "")).rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def same_number(a: str, b: str) -> bool:
    """Numeric equality, so that '72.0' equals '72' and '1,000' equals '1000'."""
    x, y = to_decimal(a), to_decimal(b)
    return x is not None and y is not None and x == y
