"""Format rewards for `<think>...</think><answer>...</answer>` completions."""

from __future__ import annotations

import re

from grpo.rewards.parsing import find_numbers

FORMAT_OK, FORMAT_BAD = 1.25, -1.0
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
STRICT_RE = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)


def think_answer_format(completion: str, answer: str) -> float:
    """+1.25 for exactly `<think>…</think>` then `<answer>…</answer>` (whitespace around tolerated)
    with nothing else outside, no tag repeated inside, some reasoning in the think block and
    exactly one number in the answer block (as `gsm8k_answer` reads it); else -1.

    The content checks keep the format from being met by empty or placeholder blocks: a model
    learns `<think></think><answer>number</answer>` in a few steps if that is enough.
    """
    match = STRICT_RE.fullmatch(completion)
    if match is None:
        return FORMAT_BAD
    reasoning, final = match.groups()
    if any(tag in part for part in (reasoning, final) for tag in TAGS):
        return FORMAT_BAD
    if not reasoning.strip() or len(find_numbers(final)) != 1:
        return FORMAT_BAD
    return FORMAT_OK


def think_answer_format_partial(completion: str, answer: str) -> float:
    """Shaped variant: 0.25 per tag that appears once in the expected order, +0.25 when the
    strict format holds (max 1.25), -1 when none of the tags is there.

    Gives GRPO a reward with variance inside a group before any completion has the exact
    format; the strict reward stays the reported metric.
    """
    if think_answer_format(completion, answer) == FORMAT_OK:
        return FORMAT_OK
    credit, cursor = 0.0, 0
    for tag in TAGS:
        position = completion.find(tag, cursor)
        if position < 0 or completion.count(tag) != 1:
            continue
        credit += 0.25
        cursor = position + len(tag)
    return credit if credit > 0 else FORMAT_BAD


ANSWER_ONLY_RE = re.compile(r"\s*<answer>(.*?)</answer>\s*", re.DOTALL)
ANSWER_OK = 1.0


def answer_format(completion: str, answer: str) -> float:
    """+1 for exactly one `<answer>…</answer>` block with something in it and nothing outside
    (whitespace tolerated), else -1: the format of a recipe that asks for the answer alone."""
    match = ANSWER_ONLY_RE.fullmatch(completion)
    if match is None or not match.group(1).strip() or any(tag in match.group(1) for tag in TAGS):
        return FORMAT_BAD
    return ANSWER_OK
