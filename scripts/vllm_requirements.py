"""requirements.txt with the pins of a vLLM requirements file taking precedence (for .venv-vllm).

    python scripts/vllm_requirements.py requirements-vllm-cpu.txt > merged.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package(line: str) -> str | None:
    """The normalised package name a requirement line pins, or None for comments and blanks."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#", 1)[0])
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else None


def merged(base: list[str], overrides: list[str]) -> list[str]:
    replaced = {package(line) for line in overrides} - {None}
    kept = [line for line in base if package(line) is not None and package(line) not in replaced]
    return kept + [line for line in overrides if package(line) is not None]


if __name__ == "__main__":
    base = (ROOT / "requirements.txt").read_text().splitlines()
    print("\n".join(merged(base, Path(sys.argv[1]).read_text().splitlines())))
