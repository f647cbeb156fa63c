"""Answer correctness for GSM8K-style problems: the answer is read and compared by math-verify.

math-verify (Hugging Face's answer checker, used by TRL's and open-r1's accuracy rewards) parses
the answer block as LaTeX or a plain expression and compares it with the reference symbolically:
'$1,234', '1234.00', '72 dollars', '\\frac{1}{2}' against '0.5', '\\boxed{72}', '18 + 54 = 72'.
Where a block holds several values it takes one (the last, or the right side of an equation),
so listing candidates ('72 or 73') wins nothing. The tags stay ours and strict: only the last
`<answer>` block counts, and without one the answer is wrong (the lenient variant reads the last
number of the text instead).
"""

from __future__ import annotations

import re
import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from grpo.rewards.parsing import find_numbers

CORRECT, WRONG = 1.0, -1.0
ANSWER_BLOCK_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
EXTRACTION = [LatexExtractionConfig(), ExprExtractionConfig()]
PARSE_TIMEOUT_S = 5  # math-verify's own default; its alarm-based timeout works in the main thread only
MAX_ANSWER_CHARS = 1_000  # a longer "answer" is not one; sympy on megabytes of model output is slow


def last_answer_block(completion: str) -> str | None:
    blocks = ANSWER_BLOCK_RE.findall(completion)
    return blocks[-1] if blocks else None


def _timeout() -> int | None:
    return PARSE_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def same_answer(text: str, reference: str) -> bool:
    """Whether math-verify reads `text` as the value of `reference` (False when it reads nothing)."""
    if len(text) > MAX_ANSWER_CHARS:
        return False
    predicted = parse(text, extraction_config=EXTRACTION, parsing_timeout=_timeout())
    gold = parse(reference, extraction_config=EXTRACTION, parsing_timeout=_timeout())
    return bool(predicted) and bool(gold) and verify(gold, predicted, timeout_seconds=_timeout())


def gsm8k_answer(completion: str, answer: str) -> float:
    """+1 when the last <answer> block is the reference value (math-verify), else -1."""
    block = last_answer_block(completion)
    return CORRECT if block is not None and same_answer(block, answer) else WRONG


def gsm8k_answer_lenient(completion: str, answer: str) -> float:
    """Shaped variant: the last <answer> block, else the last number in the text.

    For small models that rarely use the tags yet (they often end with GSM8K's '#### 72'):
    correct arithmetic still earns credit while the format reward teaches the tags.
    """
    block = last_answer_block(completion)
    if block is not None:
        return gsm8k_answer(completion, answer)
    numbers = find_numbers(completion)
    return CORRECT if numbers and same_answer(numbers[-1], answer) else WRONG
