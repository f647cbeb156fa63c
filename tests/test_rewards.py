"""Rewards: worked examples, malformed and adversarial output, the error fallback, and the
sandbox that times out a reward that hangs."""

import math
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from conftest import REPO
from rewards import REWARD_FUNCTIONS, get_reward, score_completions
from rewards.gsm8k_answer import gsm8k_answer, gsm8k_answer_lenient
from rewards.sandbox import RewardSandbox
from rewards.think_format import think_answer_format, think_answer_format_partial

GOOD = "<think>\n3 + 4 = 7\n</think>\n<answer>\n7\n</answer>"


@pytest.mark.parametrize("completion, answer, expected", [
    (GOOD, "7", 1.0),
    ("<think>x</think><answer>72.0</answer>", "72", 1.0),  # 72.0 == 72
    ("<answer>$1,234</answer>", "1234", 1.0),  # $ and thousands comma
    ("<answer>1,234.50</answer>", "1234.5", 1.0),
    ("<answer> -5 </answer>", "-5", 1.0),
    ("<answer>72 apples</answer>", "72", 1.0),  # one number, words around it
    ("<answer>72.</answer>", "72", 1.0),  # sentence period
    ("<answer>7</answer> then <answer>8</answer>", "8", 1.0),  # the last block counts
    ("<answer>7</answer> then <answer>8</answer>", "7", -1.0),
    ("<answer>72 or 73</answer>", "72", -1.0),  # listing candidates does not win
    ("<answer>seventy-two</answer>", "72", -1.0),
    ("<answer></answer>", "72", -1.0),
    ("The answer is 72.", "72", -1.0),  # no block
    ("#### 72", "72", -1.0),
    ("<answer>72", "72", -1.0),  # unclosed
    ("<answer>7.2</answer>", "72", -1.0),
    ("<answer>1e3</answer>", "1000", -1.0),  # not how GSM8K writes numbers
    ("", "72", -1.0),
    ("<answer>" + "9" * 5000 + "</answer>", "72", -1.0),  # huge number, no crash
    ("\x00\uffff<answer>\u0667\u0662</answer>", "72", -1.0),  # odd characters
])
def test_gsm8k_answer_worked_examples(completion, answer, expected):
    assert gsm8k_answer(completion, answer) == expected


@pytest.mark.parametrize("completion, expected", [
    (GOOD, 1.25),
    ("<think>a</think><answer>1</answer>", 1.25),
    ("  \n<think>a</think>\n\n<answer>1</answer>\n ", 1.25),  # whitespace outside tolerated
    ("<think>a</think><answer>72 apples</answer>", 1.25),  # one number, as gsm8k_answer reads it
    ("<think>a</think><answer>$1,234.50</answer>", 1.25),
    ("<think></think><answer>1</answer>", -1.0),  # no reasoning
    ("<think> \n </think><answer>1</answer>", -1.0),
    ("<think>a</think><answer></answer>", -1.0),  # no number
    ("<think>\nreasoning\n</think>\n<answer>\nnumber\n</answer>", -1.0),  # a placeholder template
    ("<think>a</think><answer>72 or 73</answer>", -1.0),  # two numbers
    ("Sure! <think>a</think><answer>1</answer>", -1.0),  # text before
    ("<think>a</think><answer>1</answer> Hope this helps", -1.0),  # text after
    ("<think>a</think> so <answer>1</answer>", -1.0),  # text between
    ("<answer>1</answer><think>a</think>", -1.0),  # wrong order
    ("<think>a</think><answer>1</answer><answer>2</answer>", -1.0),  # a second answer
    ("<think>a<think>b</think><answer>1</answer>", -1.0),  # nested tag
    ("<think>a</think>", -1.0),
    ("<answer>1</answer>", -1.0),
    ("<think>a<answer>1</answer>", -1.0),
    ("<THINK>a</THINK><ANSWER>1</ANSWER>", -1.0),  # tags are case-sensitive
    ("", -1.0),
])
def test_think_answer_format_worked_examples(completion, expected):
    assert think_answer_format(completion, "unused") == expected


@pytest.mark.parametrize("completion, expected", [
    (GOOD, 1.25),
    ("no tags at all #### 7", -1.0),
    ("<think>a", 0.25),
    ("<think>a</think>", 0.5),
    ("<think>a</think><answer>7", 0.75),
    ("<think>a</think> text <answer>7</answer>", 1.0),  # all four tags in order, text between
    ("<think>a</think><answer>number</answer>", 1.0),  # the tags, but no number: not the format
    ("<answer>7</answer>", 0.5),  # tags after the missing ones still count in order
    ("</think><think>", 0.25),  # out of order: only the first found in sequence counts
    ("<think><think></think>", 0.25),  # a repeated tag earns nothing
])
def test_partial_format_gives_credit_per_tag_in_order(completion, expected):
    assert think_answer_format_partial(completion, "") == expected


@pytest.mark.parametrize("completion, expected", [
    ("so the total is 7 apples.\n#### 7", 1.0),  # no block: the last number counts
    ("#### 8", -1.0),
    ("<answer>7</answer> and later 9", 1.0),  # a block wins over later numbers
    ("<answer>7 or 8</answer>", -1.0),
    ("no number", -1.0),
])
def test_lenient_answer_falls_back_to_the_last_number(completion, expected):
    assert gsm8k_answer_lenient(completion, "7") == expected


def test_registry_lists_valid_names_on_unknown():
    with pytest.raises(ValueError, match="unknown reward 'answer'; valid names: gsm8k_answer, gsm8k_answer_lenient"):
        get_reward("answer")
    assert set(REWARD_FUNCTIONS) >= {"gsm8k_answer", "think_answer_format"}


def test_score_completions_keeps_each_function_and_weights_the_sum():
    scores = score_completions([GOOD, "#### 7"], ["7", "7"], ["gsm8k_answer", "think_answer_format"],
                               [1.0, 0.5], fallback=-1.0)
    assert scores.per_function.tolist() == [[1.0, 1.25], [-1.0, -1.0]]
    assert scores.total.tolist() == [1.0 + 0.625, -1.5]
    assert scores.failures == {"gsm8k_answer": 0, "think_answer_format": 0}


def test_a_reward_that_raises_gets_the_fallback_and_is_counted(monkeypatch):
    def flaky(completion, answer):
        if "boom" in completion:
            raise RuntimeError("bug in reward")
        return math.nan if "nan" in completion else 2.0

    monkeypatch.setitem(REWARD_FUNCTIONS, "flaky", flaky)
    scores = score_completions(["ok", "boom", "nan"], ["1", "1", "1"], ["flaky"], [1.0], fallback=-3.0)
    assert torch.equal(scores.per_function[:, 0], torch.tensor([2.0, -3.0, -3.0]))
    assert scores.failures == {"flaky": 2}


def troublesome(completion, answer):
    """Hangs in Python, hangs inside `re` (holding the GIL), raises, or scores 2."""
    if "spin" in completion:
        while True:
            pass
    if "regex" in completion:
        re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: years
    if "boom" in completion:
        raise RuntimeError("bug in reward")
    return 2.0


def test_sandboxed_rewards_time_out_fall_back_and_keep_going(monkeypatch):
    monkeypatch.setitem(REWARD_FUNCTIONS, "troublesome", troublesome)  # before the fork: the child has it
    sandbox = RewardSandbox(timeout_s=0.5)
    try:
        texts = ["ok", "spin", "ok", "regex", "boom", GOOD]
        started = time.monotonic()
        scores = score_completions(texts, ["7"] * 6, ["troublesome", "gsm8k_answer"], [1.0, 1.0], fallback=-3.0,
                                   call=sandbox)
        elapsed = time.monotonic() - started
    finally:
        sandbox.close()
    assert scores.per_function[:, 0].tolist() == [2.0, -3.0, 2.0, -3.0, -3.0, 2.0]
    assert scores.per_function[:, 1].tolist() == [-1.0, -1.0, -1.0, -1.0, -1.0, 1.0]  # the same as in-process
    assert scores.failures == {"troublesome": 3, "gsm8k_answer": 0}
    assert elapsed < 10  # two 0.5 s timeouts and two forks, not a hang


def test_sandbox_replaces_a_child_that_was_killed():
    sandbox = RewardSandbox(timeout_s=5)
    try:
        assert sandbox("gsm8k_answer", GOOD, "7") == 1.0
        os.kill(sandbox._process.pid, signal.SIGKILL)
        sandbox._process.join()
        assert sandbox("gsm8k_answer", GOOD, "7") == 1.0
    finally:
        sandbox.close()


ORPHAN = """
import sys, time
sys.path.insert(0, {repo!r})
from rewards.sandbox import RewardSandbox
sandbox = RewardSandbox(timeout_s=5)
print(sandbox._process.pid, flush=True)
time.sleep(600)
"""


def test_the_reward_child_dies_with_a_killed_sampler():
    parent = subprocess.Popen([sys.executable, "-c", ORPHAN.format(repo=str(REPO))], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert psutil.pid_exists(child)
        parent.kill()  # SIGKILL: no clean-up code runs in the parent
        parent.wait()
        psutil.wait_procs([psutil.Process(child)], timeout=10)
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    finally:
        parent.kill()
