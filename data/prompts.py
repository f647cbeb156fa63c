"""Chat prompts: the system prompt, the question, and an optional prefill of the answer."""

from __future__ import annotations

from dataclasses import dataclass

from data.gsm8k import Problem


@dataclass(frozen=True)
class Prompt:
    problem: Problem
    token_ids: list[int]  # the whole prompt, prefill included, no padding


def prompt_text(tokenizer, question: str, system_prompt: str, prefill: str = "") -> str:
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + prefill


def encode_prompts(tokenizer, problems: list[Problem], system_prompt: str, prefill: str,
                   max_prompt_tokens: int) -> tuple[list[Prompt], int]:
    """Tokenised prompts, and how many were dropped for being longer than `max_prompt_tokens`."""
    prompts, dropped = [], 0
    for problem in problems:
        text = prompt_text(tokenizer, problem.question, system_prompt, prefill)
        # the chat template already holds the special tokens; do not add BOS twice
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        prompts.append(Prompt(problem, ids))
    return prompts, dropped
