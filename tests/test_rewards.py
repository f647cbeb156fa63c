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
from conftest import REPO, checked_config

from grpo.objective.advantages import group_advantages, worst_of_batch
from grpo.rewards import REWARD_FUNCTIONS, get_reward, score_completions
from grpo.rewards.gsm8k_answer import gsm8k_answer, gsm8k_answer_lenient
from grpo.rewards.overlong import overlong_penalty
from grpo.rewards.sandbox import TOGETHER, RewardFailed, RewardSandbox, default_workers, jailed_reward, shields_siblings
from grpo.rewards.strict import passes, strict_rates
from grpo.rewards.think_format import think_answer_format, think_answer_format_partial
from grpo.settings.tree import ConfigError

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
    ("<answer>72 or 73</answer>", "72", -1.0),  # listing candidates does not win: math-verify reads one (73)
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


@pytest.mark.parametrize("completion, answer, expected", [
    # what math-verify reads that the hand-written parser did not (scripts/benchmarks/compare_answer_checks.py)
    ("<answer>9 * 2 = $18</answer>", "18", 1.0),  # an equation: the value after '='
    ("<answer>She makes 9 * 2 = $18 every day.</answer>", "18", 1.0),  # GSM8K's own last sentence
    ("<answer>\\frac{1}{2}</answer>", "0.5", 1.0),  # LaTeX
    ("<answer>1/2</answer>", "0.5", 1.0),  # a fraction
    ("<answer>\\boxed{72}</answer>", "72", 1.0),
    ("<answer>$\\$1,234$</answer>", "1234", 1.0),
    ("<answer>72 dollars</answer>", "72", 1.0),  # units
    ("<answer>9 * 2 = $18</answer>", "2", -1.0),  # an operand is not the answer
    ("<answer>72 or 73</answer>", "73", 1.0),  # the one value math-verify reads; 72 is wrong (above)
    ("<answer>\\frac{1}{3}</answer>", "0.33", -1.0),  # no rounding to the reference's digits
])
def test_math_verify_reads_equations_fractions_and_latex(completion, answer, expected):
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


@pytest.mark.parametrize("completion, expected", [
    ("<answer>7</answer>", 1.0),
    ("\n <answer> 7 apples </answer>\n", 1.0),  # whitespace outside, any text inside
    ("<answer> </answer>", -1.0),  # empty
    ("<answer>7</answer> because 3 + 4", -1.0),  # text after
    ("Sure: <answer>7</answer>", -1.0),
    ("<answer>7</answer><answer>8</answer>", -1.0),  # two blocks
    ("<answer>7", -1.0),  # unclosed
    ("<think>a</think><answer>7</answer>", -1.0),  # reasoning was not asked for
])
def test_answer_format_is_one_answer_block_and_nothing_else(completion, expected):
    assert get_reward("answer_format")(completion, {"reference_answer": "7"}) == expected


def rows(*answers):
    """Dataset rows as rewards get them: the reference answer the loader parsed, under its key."""
    return [{"reference_answer": a} for a in answers]


def test_registry_lists_valid_names_on_unknown():
    with pytest.raises(ValueError, match="unknown reward 'answer'; valid names: answer_format, env_reward, "
                                         "gsm8k_answer, gsm8k_answer_lenient, reasoning_gym, think_answer_format"):
        get_reward("answer")
    assert set(REWARD_FUNCTIONS) >= {"gsm8k_answer", "think_answer_format"}


def test_score_completions_keeps_each_function_and_weights_the_sum():
    scores = score_completions([GOOD, "#### 7"], rows("7", "7"), ["gsm8k_answer", "think_answer_format"],
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
    scores = score_completions(["ok", "boom", "nan"], rows("1", "1", "1"), ["flaky"], [1.0], fallback=-3.0)
    assert torch.equal(scores.per_function[:, 0], torch.tensor([2.0, -3.0, -3.0]))
    assert scores.failures == {"flaky": 2}


def test_without_a_fallback_a_sample_a_reward_failed_on_is_marked_to_score_its_groups_worst(monkeypatch):
    """rewards.on_failure=worst: no value is made up. "boom" fails flaky (weight 1) but not gsm8k_answer
    (weight 0.5): the sample is marked `worst` (its total would mix a real score with a missing one), and
    worst_of_batch gives it the batch's lowest honest total, 1.5, never better."""
    def flaky(completion, answer):
        if "boom" in completion:
            raise RuntimeError("bug in reward")
        return 2.0

    monkeypatch.setitem(REWARD_FUNCTIONS, "flaky", flaky)
    scores = score_completions(["<answer>1</answer>", "boom <answer>1</answer>", "x"], rows("1", "1", "1"),
                               ["flaky", "gsm8k_answer"], [1.0, 0.5], fallback=None)
    assert scores.per_function.tolist() == [[2.0, 1.0], [0.0, 1.0], [2.0, -1.0]]
    assert scores.failed.tolist() == [[False, False], [True, False], [False, False]]
    assert scores.scored.tolist() == [True, True, True] and scores.worst.tolist() == [False, True, False]
    assert scores.failures == {"flaky": 1, "gsm8k_answer": 0} and scores.applies.all()
    total, scored = worst_of_batch(scores.total, scores.scored, scores.worst)
    assert total.tolist() == [2.5, 1.5, 1.5] and scored.all()


def test_a_failure_on_the_sample_outweighs_a_reward_that_could_not_be_asked(monkeypatch):
    """Sample 0: flaky raised on it and its environment could not open (env_reward unasked); left out,
    it would escape the worst its failure earns. It is scored (worst); sample 1, only unasked, is
    left out; sample 2 is honest."""
    def flaky(completion, answer):
        if "boom" in completion:
            raise RuntimeError("bug in reward")
        return 1.0

    monkeypatch.setitem(REWARD_FUNCTIONS, "flaky", flaky)
    scores = score_completions(["boom", "ok", "ok"], [{"env_reward": None, "reference_answer": "1"},
                                                      {"env_reward": None, "reference_answer": "1"},
                                                      {"env_reward": 2.0, "reference_answer": "1"}],
                               ["flaky", "env_reward"], [1.0, 1.0], fallback=None,
                               environment_failures=[("it did not open", True), ("it did not open", True), None])
    assert scores.worst.tolist() == [True, False, False] and scores.scored.tolist() == [True, False, True]
    total, scored = worst_of_batch(scores.total, scores.scored, scores.worst)
    assert total.tolist() == [3.0, 1.0, 3.0] and scored.tolist() == [True, False, True]


def test_a_failure_of_a_reward_of_weight_0_decides_nothing(monkeypatch):
    """A reward only logged (weight 0) that fails marks the sample failed for that reward's metrics, but
    the sample keeps its honest total and its place in the group."""
    def flaky(completion, answer):
        raise RuntimeError("bug in reward")

    monkeypatch.setitem(REWARD_FUNCTIONS, "flaky", flaky)
    scores = score_completions(["<answer>1</answer>", "x"], rows("1", "1"), ["flaky", "gsm8k_answer"], [0.0, 1.0],
                               fallback=None)
    assert scores.failed[:, 0].all() and scores.scored.all() and not scores.worst.any()
    assert scores.total.tolist() == [1.0, -1.0]


def test_the_reported_rates_count_a_sample_its_reward_failed_on_as_not_passing(monkeypatch):
    """strict/answer_accuracy of ["7" right, "8" wrong, "boom" failed]: 1 of 3. A failure is never a pass, and
    leaving it out would let a model that crashes the reward on its wrong answers raise its own accuracy."""
    def accuracy(completion, answer):
        if "boom" in completion:
            raise RuntimeError("bug in reward")
        return float(completion == answer)

    monkeypatch.setitem(REWARD_FUNCTIONS, "accuracy", accuracy)
    assert strict_rates(["7", "8", "boom"], rows("7", "7", "7"), ("accuracy", "accuracy")) == {
        "strict/answer_accuracy": 1 / 3, "strict/format_rate": 1 / 3}
    assert strict_rates(["boom"], rows("7"), ("accuracy", "accuracy"))["strict/answer_accuracy"] == 0.0
    assert passes("accuracy", ["7", "8", "boom"], rows("7", "7", "7")) == [True, False, False]


def troublesome(completion, row):
    """Hangs in Python, hangs inside `re` (holding the GIL), raises, or scores 2."""
    if "spin" in completion:
        while True:
            pass
    if "regex" in completion:
        re.match(r"(a+)+$", "a" * 64 + "b")  # catastrophic backtracking: years
    if "boom" in completion:
        raise RuntimeError("bug in reward")
    return 2.0


def test_sandboxed_rewards_time_out_fall_back_and_keep_going():
    troublesome_path = f"{__file__}:troublesome"  # the jail imports it by its path
    sandbox = RewardSandbox(timeout_s=0.5)
    try:
        texts = ["ok", "spin", "ok", "regex", "boom", GOOD]
        started = time.monotonic()
        scores = score_completions(texts, rows(*["7"] * 6), [troublesome_path, "gsm8k_answer"], [1.0, 1.0],
                                   fallback=-3.0, call=sandbox)
        elapsed = time.monotonic() - started
    finally:
        sandbox.close()
    assert scores.per_function[:, 0].tolist() == [2.0, -3.0, 2.0, -3.0, -3.0, 2.0]
    assert scores.per_function[:, 1].tolist() == [-1.0, -1.0, -1.0, -1.0, -1.0, 1.0]  # the same as in-process
    assert scores.failures == {troublesome_path: 3, "gsm8k_answer": 0}
    assert elapsed < 10  # two 0.5 s timeouts, not a hang


def test_wardens_scoring_at_once_give_what_one_gives_each_sample_alone():
    """rewards.workers: a batch with hangs, a raise and math-verify's samples, spread over two wardens, scores,
    fails and reports as one warden does, every sample still a call of its own (each warden served some)."""
    troublesome_path = f"{__file__}:troublesome"
    texts = ["ok", "spin", GOOD, "regex", "boom", GOOD, "<answer>8</answer>", "spin"]
    names = [troublesome_path, "gsm8k_answer", "think_answer_format_partial"]
    got = {}
    for workers in (1, 2):
        sandbox = RewardSandbox(timeout_s=0.5, workers=workers)
        try:
            scores = score_completions(texts, rows(*["7"] * 8), names, [1.0, 1.0, 0.5], fallback=None, call=sandbox)
            rates = strict_rates(texts, rows(*["7"] * 8), call=sandbox)
            got[workers] = (scores, rates, list(sandbox.calls))
            # a function of yours may run the completion's code: one call at a time, so that what it starts cannot
            # take the CPU from a neighbour's call
            assert sandbox.most_at_once[troublesome_path] == 1
        finally:
            sandbox.close()
    (one, one_rates, one_calls), (two, two_rates, two_calls) = got[1], got[2]
    assert one.per_function[:, 0].tolist() == [2.0, 0.0, 2.0, 0.0, 0.0, 2.0, 2.0, 0.0]  # 0.0: failed (worst)
    assert one.per_function[:, 1].tolist() == [-1.0, -1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -1.0]
    assert one.failures == {troublesome_path: 4, "gsm8k_answer": 0, "think_answer_format_partial": 0}
    assert one_rates == {"strict/answer_accuracy": 0.25, "strict/format_rate": 0.25}
    for field in ("per_function", "applies", "failed", "total", "scored", "worst"):
        assert torch.equal(getattr(one, field), getattr(two, field)), field
    assert (one.failures, one.errors, one_rates) == (two.failures, two.errors, two_rates)
    assert one.errors[troublesome_path] == "no answer within rewards.timeout_s=0.5 s"  # the first, a spin
    # the two built-ins together, a call for each different sample (GOOD and "spin" come twice; kept for the
    # accuracy check, gsm8k_answer too); a call a sample for your function and for the format check
    assert one_calls == [6 + 8 + 8] and sum(two_calls) == 6 + 8 + 8 and min(two_calls) > 0


def test_a_reward_sandbox_with_no_worker_is_refused_and_the_setting_is_checked():
    with pytest.raises(ValueError, match="at least one worker; got 0"):
        RewardSandbox(timeout_s=1.0, workers=0)
    for wrong in (-1, 65):
        expected = rf"rewards.workers must be in \[0, 64\] \(0 = by the cores\); got {wrong}"
        with pytest.raises(ConfigError, match=expected):
            checked_config(None, [f"rewards.workers={wrong}"])
    with pytest.raises(RewardFailed, match="the rewards jail is closed"):
        sandbox = RewardSandbox(timeout_s=1.0)
        sandbox.close()
        sandbox("gsm8k_answer", GOOD, {"reference_answer": "7"})


SLOW_LATEX = "<think>x</think>\n<answer>$2^{2^{2^{2^5}}}$</answer>"  # math-verify works on it until its own 5 s alarm


def test_a_samples_built_ins_scored_in_one_call_give_what_a_call_each_gives():
    """The default run's rewards and reported checks, a call a sample (prefetch) against a call each: the same
    values, failures, errors and rates; a sample whose call runs past the limit is scored by its own calls."""
    texts = [GOOD, "<answer>8</answer>", "<think>x</think>\n<answer>$\\frac{14}{2}$</answer>", "no tags", SLOW_LATEX]
    names, checks = ["gsm8k_answer_lenient", "think_answer_format_partial"], ("gsm8k_answer", "think_answer_format")
    together, each = RewardSandbox(timeout_s=1.0, workers=2), RewardSandbox(timeout_s=1.0)
    try:
        got = []
        for call in (together, lambda name, completion, row: each(name, completion, row)):  # no prefetch, no map
            scores = score_completions(texts, rows(*["7"] * 5), names, [1.0, 1.0], fallback=None, call=call,
                                       also=checks)
            got.append((scores, strict_rates(texts, rows(*["7"] * 5), checks, call=call)))
        calls_together, calls_each = sum(together.calls), sum(each.calls)
    finally:
        together.close()
        each.close()
    (one, one_rates), (other, other_rates) = got
    fast = score_completions(texts[:4], rows(*["7"] * 4), names, [1.0, 1.0], fallback=None)  # in this process
    assert torch.equal(one.per_function[:4], fast.per_function) and not one.failed[:4].any()
    assert one.failed[4].tolist() == [True, False]  # math-verify past rewards.timeout_s=1; the format scored
    assert one.per_function[4, 1] == think_answer_format_partial(SLOW_LATEX, "7")
    for field in ("per_function", "applies", "failed", "total", "scored", "worst"):
        assert torch.equal(getattr(one, field), getattr(other, field)), field
    assert (one.failures, one.errors, one_rates) == (other.failures, other.errors, other_rates)
    passing = [sum(passes(check, texts[:4], rows(*["7"] * 4))) for check in checks]  # the slow one's answer fails
    assert one_rates == {"strict/answer_accuracy": passing[0] / 5,
                         "strict/format_rate": (passing[1] + (think_answer_format(SLOW_LATEX, "7") >= 1)) / 5}
    assert calls_each == 5 * 4 and calls_together == 5 + 4  # one a sample; the slow one's four made again
    with pytest.raises(ValueError, match="unit_tests may run the completion: never scored together"):
        jailed_reward(TOGETHER + "gsm8k_answer,unit_tests")


def test_a_built_in_that_fails_in_the_call_together_fails_in_its_own_and_the_others_are_kept():
    """env_reward reads the row: a value that is no number fails inside the call together, so that sample and
    reward get a call of their own, which fails as it would have; None (does not apply) is kept as None."""
    texts, names = [GOOD, GOOD, "no tags"], ["env_reward", "think_answer_format_partial"]
    scored = [{"reference_answer": "7", "env_reward": 0.5}, {"reference_answer": "7", "env_reward": "abc"},
              {"reference_answer": "7"}]
    together, each = RewardSandbox(timeout_s=5.0), RewardSandbox(timeout_s=5.0)
    try:
        one = score_completions(texts, scored, names, [1.0, 1.0], fallback=None, call=together)
        other = score_completions(texts, scored, names, [1.0, 1.0], fallback=None,
                                  call=lambda name, completion, row: each(name, completion, row))
        again = score_completions(texts, scored, names, [1.0, 1.0], fallback=None, call=together)  # a later round
        calls = list(together.calls)
    finally:
        together.close()
        each.close()
    assert one.per_function[:, 0].tolist() == [0.5, 0.0, 0.0] and one.applies[:, 0].tolist() == [True, True, False]
    assert one.failed[:, 0].tolist() == [False, True, False] and one.failures["env_reward"] == 1
    assert one.errors["env_reward"].startswith("ValueError: could not convert string to float: 'abc'")
    for field in ("per_function", "applies", "failed", "total", "scored", "worst"):
        assert torch.equal(getattr(one, field), getattr(other, field)), field
        assert torch.equal(getattr(one, field), getattr(again, field)), field
    assert (one.failures, one.errors) == (other.failures, other.errors) == (again.failures, again.errors)
    # a call a sample and the failed one's own; the same samples again (a later round): that one's two alone
    assert calls == [3 + 1 + 1 + 1]


def test_wardens_run_at_once_only_where_no_call_can_signal_another(monkeypatch):
    assert shields_siblings({"namespaces": True, "landlock_abi": 0})  # its own PID namespace
    assert shields_siblings({"namespaces": False, "landlock_abi": 6})  # Landlock scopes its signals
    assert not shields_siblings({"namespaces": False, "landlock_abi": 5}) and not shields_siblings({})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the launcher's share on a CPU-only machine
    assert default_workers() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "32")  # never more than the cores it may use
    assert default_workers() == min(8, len(os.sched_getaffinity(0)))
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_workers() == min(8, len(os.sched_getaffinity(0)))


def test_the_sandbox_replaces_a_jail_that_was_killed():
    sandbox = RewardSandbox(timeout_s=5)
    try:
        assert sandbox("gsm8k_answer", GOOD, {"reference_answer": "7"}) == 1.0
        os.kill(sandbox._jails[0]._process.pid, signal.SIGKILL)
        sandbox._jails[0]._process.wait()
        assert sandbox("gsm8k_answer", GOOD, {"reference_answer": "7"}) == 1.0
    finally:
        sandbox.close()


ORPHAN = """
import sys, time
sys.path.insert(0, {repo!r})
from grpo.rewards.sandbox import (
    TOGETHER,
    RewardFailed,
    RewardSandbox,
    default_workers,
    jailed_reward,
    shields_siblings,
)
sandbox = RewardSandbox(timeout_s=5)
print(sandbox._jails[0]._process.pid, flush=True)
time.sleep(600)
"""


def test_the_reward_jail_dies_with_a_killed_sampler():
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


USER_REWARDS = '''
from grpo.rewards import batched

def length_penalty(completion, row):
    """-0.01 per character past the row's limit; does not apply to rows without one."""
    if "limit" not in row:
        return None
    return -0.01 * max(0, len(completion) - row["limit"])

@batched
def exact(completions, rows):
    return [1.0 if c.strip() == r["reference_answer"] else 0.0 for c, r in zip(completions, rows)]

@batched
def short(completions, rows):
    return [1.0]

@batched
def fragile(completions, rows):
    """Each completion's length; raises on a batch holding "boom", hangs on one holding "spin"."""
    if any("spin" in c for c in completions):
        import time
        time.sleep(60)
    if any("boom" in c for c in completions):
        raise RuntimeError("bug in reward")
    return [float(len(c)) for c in completions]

CALLS = []

@batched
def always_raises(completions, rows):
    CALLS.append(len(completions))
    raise RuntimeError("broken")

NOT_A_FUNCTION = 3
'''


def test_a_users_reward_module_by_path_with_rows_none_and_the_batch_form(tmp_path):
    """Rewards named 'file.py:function' get (completion, row); None leaves the sample out of that
    reward's mean and adds nothing to the total; a batched reward is called once per batch, in the
    sandbox too; a batch form returning the wrong count falls back for the whole batch."""
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    names = [f"{tmp_path}/my_rewards.py:length_penalty", f"{tmp_path}/my_rewards.py:exact"]
    rows = [{"reference_answer": "7", "limit": 3}, {"reference_answer": "8"}, {"reference_answer": "9", "limit": 10}]
    texts = ["7", "8 is the answer", "nine"]
    sandbox = RewardSandbox(timeout_s=5)
    try:
        here, there = (score_completions(texts, rows, names, [1.0, 2.0], fallback=-3.0, call=call)
                       for call in (None, sandbox))
        broken = score_completions(texts, rows, [f"{tmp_path}/my_rewards.py:short"], [1.0], fallback=-3.0, call=sandbox)
    finally:
        sandbox.close()
    for scores in (here, there):
        assert scores.per_function.tolist() == [[0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]
        assert scores.applies.tolist() == [[True, True], [False, True], [True, True]]
        assert scores.total.tolist() == [2.0, 0.0, 0.0]
    texts[0] = "7 and then some"  # 15 characters, 12 past the limit
    assert score_completions(texts, rows, names[:1], [1.0], -3.0).total[0].item() == pytest.approx(-0.12)
    assert (broken.per_function[:, 0].tolist() == [-3.0] * 3
            and broken.failures == {f"{tmp_path}/my_rewards.py:short": 3})


def test_a_batched_reward_that_fails_on_one_sample_costs_that_sample_alone(tmp_path):
    """A batch form that raises or hangs is called again on the halves of its batch: the samples it
    fails on fall back, the others keep their scores."""
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    name = f"{tmp_path}/my_rewards.py:fragile"
    texts = ["a", "boom", "ccc", "spin", "ee"]
    sandbox = RewardSandbox(timeout_s=0.5)
    try:
        there = score_completions(texts, rows(*"12345"), [name], [1.0], fallback=-3.0, call=sandbox)
    finally:
        sandbox.close()
    here = score_completions(texts[:3], rows(*"123"), [name], [1.0], fallback=-3.0)
    assert there.per_function[:, 0].tolist() == [1.0, -3.0, 3.0, -3.0, 2.0] and there.failures == {name: 2}
    assert here.per_function[:, 0].tolist() == [1.0, -3.0, 3.0] and here.failures == {name: 1}


def test_a_batched_reward_that_always_fails_is_not_split_down_to_every_sample(tmp_path):
    """8 samples: the batch, its first half (4), that half's halves (2, then 1 and 1), then the
    second halves whole (2 and 4): 7 calls, not 8 single ones after the batch's; all fall back."""
    from grpo.rewards.registry import get_reward

    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    name = f"{tmp_path}/my_rewards.py:always_raises"
    scores = score_completions(list("abcdefgh"), rows(*"12345678"), [name], [1.0], fallback=-3.0)
    assert get_reward(name).__globals__["CALLS"] == [8, 4, 2, 1, 1, 2, 4]
    assert scores.per_function[:, 0].tolist() == [-3.0] * 8 and scores.failures == {name: 8}


def test_a_reward_that_cannot_be_imported_is_a_config_error_naming_it(tmp_path):
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    for name, why in [(f"{tmp_path}/my_rewards.py:missing", "AttributeError"),
                      (f"{tmp_path}/nothing_here.py:f", "FileNotFoundError"),
                      ("no_such_package.rewards:f", "ModuleNotFoundError")]:
        with pytest.raises(ConfigError, match=f"rewards.names: cannot import '{re.escape(name)}' \\({why}"):
            checked_config(None, [f"rewards.names=[gsm8k_answer,{name}]", "rewards.weights=[1,1]"])
    with pytest.raises(ConfigError, match="my_rewards.py:NOT_A_FUNCTION' is a int, not a function"):
        checked_config(None, [f"rewards.names=[{tmp_path}/my_rewards.py:NOT_A_FUNCTION]", "rewards.weights=[1]"])


@pytest.mark.parametrize("length, expected", [(0, 0.0), (150, 0.0), (160, 0.0), (170, -0.25), (200, -1.0)])
def test_overlong_penalty_is_dapos_linear_ramp_over_the_buffer(length, expected):
    # L = 200, buffer 40: free up to 160 tokens, then -1/40 per token down to -1 at the limit
    assert overlong_penalty(length, 200, 40) == expected
    assert overlong_penalty(length, 200, 40, factor=0.5) == expected / 2
    assert overlong_penalty(length, 200, 0) == 0.0


LOCATED = '''\
"""A reward that reads a column the data does not have, through a helper."""
import json


def solution_of(row):
    return json.loads(row["solution"])


def exact_match(completion, row):
    return float(completion.strip() == solution_of(row))


def bad_json(completion, row):
    return float(json.loads(completion))
'''


def test_a_rewards_failure_names_the_line_of_the_users_code_that_raised(tmp_path):
    """In the sandbox and in the sampler alike: the last line of the user's file (the helper's), and
    for an error raised inside a library (json), the user's line that called it."""
    path = tmp_path / "located.py"
    path.write_text(LOCATED)
    names = [f"{path}:exact_match", f"{path}:bad_json"]
    sandbox = RewardSandbox(timeout_s=5)
    try:
        there = score_completions(["7", "x"], rows("7", "7"), names, [1.0, 1.0], fallback=-1.0, call=sandbox)
    finally:
        sandbox.close()
    here = score_completions(["7", "x"], rows("7", "7"), names, [1.0, 1.0], fallback=-1.0)
    for scores in (there, here):
        assert scores.failures == {names[0]: 2, names[1]: 1}  # "7" is JSON
        assert scores.errors == {
            names[0]: f"KeyError: 'solution' ({path}:6, in solution_of)",
            names[1]: f"JSONDecodeError: Expecting value: line 1 column 1 (char 0) ({path}:14, in bad_json)"}


QUESTION_REWARD = '''
from grpo.rewards import batched

@batched
def echoes_the_question(completions, rows):
    """TRL's prompts[i][-1]["content"]: the question, from the chat the prompt was rendered from."""
    return [float(row["prompt_turns"][-1]["content"] in c) for c, row in zip(completions, rows)]
'''


def test_a_rule_reward_gets_the_prompts_chat_in_its_row_in_the_sandbox_too(tmp_path):
    from grpo.data.problems import Problem
    from grpo.data.prompts import Prompt
    from grpo.rewards.strict import reward_rows

    (tmp_path / "question_reward.py").write_text(QUESTION_REWARD)
    turns = ({"role": "system", "content": "be brief"}, {"role": "user", "content": "What is 2 + 2?"})
    prompts = [Prompt(Problem(id="p0", question="What is 2 + 2?", answer="4", row={"level": 1}), [1], turns)] * 2
    rows = reward_rows(prompts)
    assert rows[0] == {"level": 1, "reference_answer": "4", "prompt_turns": [dict(t) for t in turns]}
    name = f"{tmp_path}/question_reward.py:echoes_the_question"
    sandbox = RewardSandbox(timeout_s=5)
    try:
        for call in (None, sandbox):
            scores = score_completions(["You asked: What is 2 + 2? It is 4.", "4"], rows, [name], [1.0], -1.0,
                                       call=call)
            assert scores.per_function[:, 0].tolist() == [1.0, 0.0]
    finally:
        sandbox.close()


def test_a_reward_beyond_the_limit_or_beyond_it_weighted_fails_that_sample(tmp_path):
    """1e39 passes float64's finiteness check but is inf in float32; 3e38 is a float32, but two in a
    group give NaN advantages (their sum overflows), and 6e14 is within the limit of 1e15 but not
    weighted by 2. Each is a failure of that reward on that sample (the batch's worst, or the
    fallback), never an inf total or NaN advantages; the other samples keep their scores."""
    (tmp_path / "huge.py").write_text("def huge(completion, row):\n"
                                      "    return {'big': 1e39, 'edge': 3e38, 'weighted': 6e14}.get(completion, 1.0)\n")
    name = f"{tmp_path}/huge.py:huge"
    for call in (None, RewardSandbox(timeout_s=5)):
        try:
            texts = ["big", "edge", "edge", "weighted", "ok"]
            worst = score_completions(texts, rows(*"77777"), [name], [2.0], fallback=None, call=call)
            fallback = score_completions(texts, rows(*"77777"), [name], [2.0], fallback=-1.0, call=call)
        finally:
            if call is not None:
                call.close()
        assert worst.failed[:, 0].tolist() == [True] * 4 + [False] and worst.worst.tolist() == [True] * 4 + [False]
        assert worst.total.tolist() == [0.0] * 4 + [2.0] and worst.failures == {name: 4}
        assert fallback.total.tolist() == [-2.0] * 4 + [2.0]
        assert fallback.per_function[:, 0].tolist() == [-1.0] * 4 + [1.0]
        total, scored = worst_of_batch(worst.total, worst.scored, worst.worst)
        assert group_advantages(total, 5, scored=scored).isfinite().all()


def test_a_reward_service_is_one_line_in_its_table(monkeypatch):
    """A new kind of service joins SERVICES: the config's checks, the start and the scoring find it there."""
    from grpo.config import load_config
    from grpo.rewards import score_completions, services
    from grpo.run.preflight import named_code_problems

    def load(name, settings):
        def score(completions, rows, prompts):
            return [float(len(c)) for c in completions]
        score.service = True
        return score

    dummy = services.Service(lambda name: name.startswith("dummy:"), load,
                             lambda name, settings: [] if name != "dummy:bad" else ["rewards.names: dummy:bad is bad"])
    monkeypatch.setitem(services.SERVICES, "dummy", dummy)
    assert services.is_service_name("dummy:x") and not services.is_service_name("gsm8k_answer")
    bad = load_config(None, ["rewards.names=[dummy:bad]", "rewards.weights=[1.0]"])
    assert "rewards.names: dummy:bad is bad" in named_code_problems(bad)  # the start's checks
    cfg = load_config(None, ["rewards.names=[dummy:x]", "rewards.weights=[1.0]"])
    settings = services.ServiceSettings.of(cfg)
    services.start_services(cfg.rewards.names, settings)
    scores = score_completions(["ab", "abcd"], [{}, {}], ["dummy:x"], [1.0], None, prompts=[[], []],
                               services=settings)
    assert scores.total.tolist() == [2.0, 4.0]
