"""Rule rewards in a jail (grpo/common/jail.py): each sample scored by a process of its own that holds
nothing of the run but that sample's row, so a reward that runs the model's code (unit_tests) or
hangs on a sample costs that sample's score (it fails there: rewards.on_failure), never the run,
and reaches no other sample's answer, the sampler, the network or the run's files.

The jail is a Python started by exec that imports each reward once; each call is forked from it
into its own namespaces with Landlock file rules, a seccomp filter and budgets for its whole
process tree (docs/environments.md, "What the sandbox allows", has the table and its tests). A
batched reward gets `rewards.timeout_s` per completion, in one call. The call sees the environment
variables every child does (grpo/common/child.py: PATH, HOME, LANG, LC_*, its own TMPDIR) and the ones
named in `pass_env`; no network unless `network`.

A warden serves one call at a time; `workers` wardens score a batch's samples at once (`map`), each
sample still in a process of its own, for the built-ins that run nothing of the completion (AT_ONCE). A
reward that runs the model's code is scored one sample at a time: its processes could take the CPU
from a neighbour's call and make that honest sample time out. Where a call could signal another
warden's (no PID namespace and no Landlock signal scope), there is one warden. Those built-ins are
also scored together (`prefetch`): one call a sample gives each of them, the step's rewards and its
reported checks alike, and the calls that ask for them next take the values kept.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from grpo.common.child import ChildFailed
from grpo.common.jail import Jail, JailLimits, jail_description
from grpo.rewards.builtins import ENV_REWARD, REWARD_FUNCTIONS

log = logging.getLogger(__name__)

WARM_UP = "<think>1</think>\n<answer>1</answer>"  # a sample the built-ins score once in the jail's warden
# the built-ins that run nothing of the completion (math-verify builds sympy objects from it and imports or calls
# none of its names: one core and the call's memory at most); a reasoning-gym task's scorer may eval the answer
# (countdown, puzzle24, ...), so it is not among them
AT_ONCE = frozenset([*REWARD_FUNCTIONS, ENV_REWARD])
SIGNAL_SCOPE_ABI = 6  # the Landlock ABI that keeps a call's signals within its own domain
TOGETHER = "together:"  # a target that scores a sample with the AT_ONCE built-ins it names, comma-separated
KEPT_LIMIT = 100_000  # values `prefetch` keeps (about 15 MB at most): the oldest dropped past it
NOT_KEPT = object()


class RewardFailed(ChildFailed):
    """The function raised in the jail (`where`: the line), ran past the timeout or a budget."""


class RewardSandbox:
    def __init__(self, timeout_s: float, pass_env=(), limits: JailLimits = JailLimits(), names=(), workers: int = 1):
        """`names`: the rule rewards the jail imports (and warms) as it starts, not in a first call's time.
        `workers`: wardens, started at once; each serves one call at a time."""
        if workers < 1:
            raise ValueError(f"a reward sandbox needs at least one worker; got {workers}")
        self.timeout_s = timeout_s
        # each warden started, called and restarted on a thread of its own that lives as long as the sandbox: a
        # warden dies with the thread that started it (its parent-death signal), never with a caller's thread
        self._threads = [ThreadPoolExecutor(1, thread_name_prefix=f"reward-jail-{i}") for i in range(workers)]
        started = [thread.submit(Jail, "rewards", "grpo.rewards.sandbox:jailed_reward", list(names), limits,
                                 pass_env=pass_env) for thread in self._threads]
        failed = [f.exception() for f in started if f.exception() is not None]
        self._jails = [f.result() for f in started if f.exception() is None]
        self.closed = False
        if failed:
            self.close()
            raise failed[0]
        if workers > 1 and not shields_siblings(self._jails[0].info):
            log.warning("rule rewards: one warden, not %d: a call here could signal another warden's (no PID "
                        "namespace, Landlock below ABI %d)", workers, SIGNAL_SCOPE_ABI)
            for jail, thread in zip(self._jails[1:], self._threads[1:]):
                jail.close()
                thread.shutdown(wait=False)
            self._jails, self._threads = self._jails[:1], self._threads[:1]
        self.calls = [0] * self.workers  # the calls each warden served
        self.most_at_once: dict[str, int] = {}  # each reward's most calls at once
        self._running: dict[str, int] = {}
        self._counting = threading.Lock()
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()  # wardens not serving a call
        for index in range(self.workers):
            self._free.put(index)
        self._kept: dict[tuple[str, bytes], float | None] = {}  # (name, request's digest) -> the value `prefetch` got

    @property
    def workers(self) -> int:
        return len(self._jails)

    @property
    def confinement(self) -> dict:
        """What confines a call here (namespaces, Landlock's ABI, budgets: grpo/common/jail.py)."""
        return self._jails[0].info

    def __call__(self, name: str, completion: str | list[str], row: dict | list[dict]):
        """One sample's reward, or a batched reward's list (completion and row are then lists), on
        the first warden free."""
        batched = isinstance(completion, list)
        limit = self.timeout_s * (len(completion) if batched else 1)
        if self.closed:
            raise RewardFailed("the rewards jail is closed")
        if self._kept and not batched and name in AT_ONCE:
            kept = self._kept.get((name, _request(completion, row)), NOT_KEPT)
            if kept is not NOT_KEPT:
                return kept
        index = self._free.get()
        self._count(name, +1)
        try:
            self.calls[index] += 1
            return self._threads[index].submit(
                self._jails[index].call, name, [completion, row], limit,
                f"no answer within rewards.timeout_s={self.timeout_s:g} s" + (" per completion" if batched else "")
            ).result()
        except ChildFailed as e:
            raise RewardFailed(str(e), e.where) from None
        finally:
            self._count(name, -1)
            self._free.put(index)

    def _count(self, name: str, change: int) -> None:
        with self._counting:
            self._running[name] = self._running.get(name, 0) + change
            self.most_at_once[name] = max(self.most_at_once.get(name, 0), self._running[name])

    def map(self, name: str, completions: list[str], rows: list[dict]) -> list:
        """Each sample's reward (as `self(name, completion, row)` gives it, or the exception it
        raised), in order: spread over the wardens for a reward in AT_ONCE, else one at a time."""
        def one(completion, row):
            try:
                return self(name, completion, row)
            except Exception as e:
                return e
        if self.workers == 1 or len(completions) < 2 or not (name in AT_ONCE or name.startswith(TOGETHER)):
            return [one(c, r) for c, r in zip(completions, rows, strict=True)]
        with ThreadPoolExecutor(min(self.workers, len(completions))) as pool:
            return list(pool.map(one, completions, rows))

    def prefetch(self, names, completions: list[str], rows: list[dict]) -> None:
        """Each sample scored with every name of `names` in AT_ONCE in one call (a process of its own, as
        each call is), the values kept for the calls that ask for them (the same request gets the same
        value: a step's later rounds and its checks). Where that call failed, or a function raised in it,
        nothing is kept: the sample's own calls then fail or score as they would have."""
        together = list(dict.fromkeys(n for n in names if n in AT_ONCE))
        if len(together) < 2:
            return
        kept = self._kept  # read by the calls with .get alone: filled in place, never left half-built
        asked: dict[bytes, tuple[str, dict]] = {}  # each request once, unless all its values are kept
        for completion, row in zip(completions, rows, strict=True):
            request = _request(completion, row)
            if request is not None and any((name, request) not in kept for name in together):
                asked.setdefault(request, (completion, row))
        samples = list(asked.values())
        answers = self.map(TOGETHER + ",".join(together), [c for c, _ in samples], [r for _, r in samples])
        for request, answer in zip(asked, answers, strict=True):
            if not isinstance(answer, list) or len(answer) != len(together):
                continue
            for name, got in zip(together, answer):
                if isinstance(got, list) and len(got) == 2 and got[0] == "ok":
                    kept[(name, request)] = got[1]
        for oldest in list(itertools.islice(kept, max(len(kept) - KEPT_LIMIT, 0))):
            del kept[oldest]

    def close(self) -> None:
        self.closed = True
        for jail in self._jails:
            jail.close()
        for thread in self._threads:
            thread.shutdown(wait=False)


def _request(completion, row) -> bytes | None:
    """The digest of a call's arguments as the warden gets them (JSON), the key of a kept value; None where they
    are not JSON."""
    try:
        return hashlib.blake2b(json.dumps([completion, row]).encode(), digest_size=16).digest()
    except (TypeError, ValueError):
        return None


def shields_siblings(info: dict) -> bool:
    """Whether a call confined as `info` says (Jail.info) cannot signal another warden's call: it has a PID
    namespace of its own, or Landlock scopes its signals."""
    return bool(info.get("namespaces")) or info.get("landlock_abi", 0) >= SIGNAL_SCOPE_ABI


def default_workers() -> int:
    """rewards.workers=0: a warden for each core this sampler may use (no more than its OMP_NUM_THREADS, the
    launcher's share on a CPU-only machine), at most 8."""
    cores, threads = len(os.sched_getaffinity(0)), os.environ.get("OMP_NUM_THREADS", "")
    return max(1, min(8, cores, int(threads) if threads.isdigit() else cores))


def reward_sandbox(rewards) -> RewardSandbox | None:
    """The jail of the config's rule rewards (its rewards section), None with rewards.timeout_s 0."""
    if rewards.timeout_s <= 0:
        return None
    limits = JailLimits(memory_mb=rewards.memory_mb, max_processes=rewards.max_processes,
                        network=rewards.network == "allow")
    from grpo.rewards.services import is_service_name

    names = dict.fromkeys(n for n in [*rewards.names, rewards.accuracy_reward, rewards.format_reward]
                          if not is_service_name(n))
    sandbox = RewardSandbox(rewards.timeout_s, rewards.pass_env, limits, names, rewards.workers or default_workers())
    log.info("rule rewards run in a jail per sample (%d at once): %s", sandbox.workers,
             jail_description(sandbox.confinement))
    return sandbox


def jailed_reward(name: str) -> Callable:
    """What the jail runs for the rule reward `name` (run in its warden: rewards/builtins.py, no torch):
    the function, its value made JSON (a number, None, or a batched reward's list of them). Ours are
    warmed once there (math-verify's first parse), and a built-in's `prepare(row)` (the reasoning-gym
    scorer's dataset) runs there before each call's fork, from the row, never the completion."""
    from grpo.rewards.builtins import REWARD_FUNCTIONS, rule_reward

    if name.startswith(TOGETHER):
        return _together(name.removeprefix(TOGETHER).split(","))
    fn = rule_reward(name)
    if name in REWARD_FUNCTIONS:
        fn(WARM_UP, {"reference_answer": "1"})

    def score(completion, row):
        value = fn(completion, row)
        return [_number(v) for v in value] if isinstance(completion, list) else _number(value)
    score.__wrapped__ = fn  # the jail reads the user's module through it (grpo/common/jail_warden.py: served_files)
    prepare = getattr(fn, "prepare", None)
    if callable(prepare):
        score.prepare = lambda completion, row: [prepare(r) for r in (row if isinstance(row, list) else [row])]
    return score


def _together(names: list[str]) -> Callable:
    """What the jail runs for a TOGETHER target: each name's value for the sample, as ["ok", value], or ["error"]
    where that function raised (its own call then reports it)."""
    outside = [n for n in names if n not in AT_ONCE]
    if outside:
        raise ValueError(f"{', '.join(outside)} may run the completion: never scored together")
    scores = [jailed_reward(name) for name in names]

    def together(completion: str, row: dict) -> list:
        answers = []
        for score in scores:
            try:
                answers.append(["ok", score(completion, row)])
            except Exception:
                answers.append(["error"])
        return answers
    return together


def _number(value) -> float | None:
    return None if value is None else float(value)
