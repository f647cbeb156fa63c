"""Answer correctness for GSM8K-style problems."""

from __future__ import annotations

import re

from rewards.parsing import find_numbers, same_number

CORRECT, WRONG = 1.0, -1.0
ANSWER_BLOCK_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def last_answer_block(completion: str) -> str | None:
    blocks = ANSWER_BLOCK_RE.findall(completion)
    return blocks[-1] if blocks else None


def gsm8k_answer(completion: str, answer: str) -> float:
    """+1 when the last <answer> block holds exactly one number and it equals `answer`, else -1.

    Exactly one number: '<answer>72 or 73</answer>' must not win by listing candidates.
    """
    block = last_answer_block(completion)
    if block is None:
        return WRONG
    numbers = find_numbers(block)
    return CORRECT if len(numbers) == 1 and same_number(numbers[0], answer) else WRONG


def gsm8k_answer_lenient(completion: str, answer: str) -> float:
    """Shaped variant: the last <answer> block's number, else the last number in the text.

    For small models that rarely use the tags yet (they often end with GSM8K's '#### 72'):
    correct arithmetic still earns credit while the format reward teaches the tags.
    """
    block = last_answer_block(completion)
    numbers = find_numbers(block if block is not None else completion)
    if block is not None and len(numbers) != 1:
        return WRONG
    return CORRECT if numbers and same_number(numbers[-1], answer) else WRONG
