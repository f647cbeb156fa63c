"""What the jail costs: a tool call and a rule reward, each in a jail of its own (grpo/common/jail.py),
against the same call made where it ran before the jail (the tool in the environments' child, the
reward in a forked child that serves every sample), side by side in one run, alternating.

    .venv/bin/python scripts/benchmarks/bench_jail.py                 # 200 calls each, 4 lanes x 12 slow calls
    .venv/bin/python scripts/benchmarks/bench_jail.py --calls 50 --slow-calls 4
    .venv/bin/python scripts/benchmarks/bench_jail.py --only-batch --samples 128 --workers 2

Printed: ms per call of a trivial tool (a new episode's first step through EnvironmentPool: open
it, parse the call, run it, build the reply), of the calculator tool, and of a trivial reward (RewardSandbox
against the forked child); then episodes/s on the 1-second tool workload (each episode one step
whose tool sleeps 1 s, `--lanes` lanes at once, as env.concurrency runs them); then ms to start the
environments' child (as at a run's start and after a hung step), forked from a sampler holding
`--sampler-mb` MB against started by exec, as the child now is. Last, a sampler step's scoring:
`--samples` completions scored by the default run's rewards and its two reported checks, a call for
each (four a sample) on one warden, against a call a sample for the four (the sandbox's prefetch) on
one warden and on `--workers` wardens at once (rewards.workers), alternating.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from grpo.common.child import Child  # noqa: E402
from grpo.config import load_config  # noqa: E402
from grpo.environments import Reply  # noqa: E402
from grpo.environments.pool import EnvironmentPool, isolated_episodes  # noqa: E402
from grpo.environments.tool_calls import PARSERS  # noqa: E402
from grpo.environments.tools import load_tools, shown  # noqa: E402
from grpo.rewards.registry import score_completions  # noqa: E402
from grpo.rewards.sandbox import RewardSandbox  # noqa: E402
from grpo.rewards.strict import checks_of, strict_rates  # noqa: E402
from grpo.settings import EnvConfig  # noqa: E402

HERE = str(Path(__file__).resolve())
CALCULATE = "grpo.environments.calculator:calculate"


def noop(x: int) -> int:
    """Return x.

    Args:
        x: A number.
    """
    return x


def slow(x: int) -> int:
    """Wait one second, then return x.

    Args:
        x: A number.
    """
    time.sleep(1.0)
    return x


def trivial_reward(completion: str, row: dict) -> float:
    return float(completion == row["reference_answer"])


class DirectTools:
    """The tool environment as it ran before the jail: each function called in the environments' child."""

    reply_roles = ("tool",)

    def __init__(self, row: dict, tools: list[str], parser: str = "hermes"):
        self.functions = {name: fn for name, (_, fn) in load_tools(tools).items()}
        self.parse = PARSERS[parser]

    def step(self, message: str) -> Reply:
        calls = self.parse(message)
        return Reply(text=[shown(self.functions[c.name](**c.arguments)) for c in calls], role="tool",
                     tool_calls=len(calls))


def _forked_rewards(pipe_fd: int):
    """The former reward child's handler: every sample scored in one forked process."""
    from grpo.rewards.builtins import rule_reward

    return (lambda request: rule_reward(request[0])(request[1], request[2])), "ready"


def pools(tool: str, lanes: int = 1) -> dict[str, list[EnvironmentPool]]:
    args = {"tools": [tool], "parser": "hermes"}
    return {"before": [EnvironmentPool(f"{HERE}:DirectTools", args, 30.0) for _ in range(lanes)],
            "jailed": [EnvironmentPool("tools", args, 30.0) for _ in range(lanes)]}


def tool_message(name: str, arguments: dict) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def per_call_ms(steps: dict, calls: int) -> dict[str, float]:
    """Median ms per call of each variant, calls alternating between them in blocks of 10."""
    times = {name: [] for name in steps}
    for block in range(0, calls, 10):
        for name in (list(steps) if block % 20 == 0 else list(steps)[::-1]):
            for _ in range(min(10, calls - block)):
                started = time.perf_counter()
                steps[name]()
                times[name].append((time.perf_counter() - started) * 1000)
    return {name: statistics.median(t) for name, t in times.items()}


def report(label: str, ms: dict[str, float]) -> None:
    print(f"{label:<34} before {ms['before']:7.2f} ms   jailed {ms['jailed']:7.2f} ms   "
          f"extra {ms['jailed'] - ms['before']:6.2f} ms   ratio {ms['jailed'] / ms['before']:5.2f}x")


def bench_tool(tool: str, name: str, arguments: dict, calls: int, label: str) -> None:
    made = pools(tool)
    message = tool_message(name, arguments)
    try:
        # a new episode each call (an episode has env.args max_calls=8 calls): its opening is in both
        steps = {variant: (lambda pool=found[0]: pool.step(uuid.uuid4().hex, {}, [], message))
                 for variant, found in made.items()}
        for step in steps.values():
            step()  # warm-up: the child and the jail started, the modules imported
        report(label, per_call_ms(steps, calls))
    finally:
        for found in made.values():
            found[0].close()


def bench_reward(calls: int) -> None:
    forked, jailed = Child("rewards", _forked_rewards), RewardSandbox(timeout_s=10.0)
    name, row = f"{HERE}:trivial_reward", {"reference_answer": "7"}
    try:
        steps = {"before": lambda: forked.call([name, "7", row], 10.0, "timeout"),
                 "jailed": lambda: jailed(name, "7", row)}
        for step in steps.values():
            step()
        report("trivial reward (one sample)", per_call_ms(steps, calls))
    finally:
        forked.close()
        jailed.close()


def bench_slow_tool(lanes: int, per_lane: int) -> None:
    made = pools(f"{HERE}:slow", lanes)
    message = tool_message("slow", {"x": 1})
    try:
        rates = {}
        for variant in ("before", "jailed", "jailed", "before"):
            def lane(pool):
                for n in range(per_lane):
                    pool.step(f"e{n}", {}, [], message)
            started = time.perf_counter()
            threads = [threading.Thread(target=lane, args=(pool,)) for pool in made[variant]]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            rates.setdefault(variant, []).append(lanes * per_lane / (time.perf_counter() - started))
        before, jailed = statistics.mean(rates["before"]), statistics.mean(rates["jailed"])
        print(f"{'1-second tool, episodes/s':<34} before {before:7.3f}      jailed {jailed:7.3f}      "
              f"ratio {jailed / before:5.3f}x ({lanes} lanes x {per_lane} episodes, two runs each)")
    finally:
        for found in made.values():
            for pool in found:
                pool.close()


def bench_child_start(starts: int, held_mb: int) -> None:
    """The environments' child started and closed: forked from this process holding `held_mb` MB (as a
    sampler holds its model and data), against a new Python started by exec (which holds none of it)."""
    held = bytearray(held_mb << 20)
    held[::4096] = b"\1" * len(held[::4096])  # every page touched: resident, as a loaded model is
    arguments = [f"{HERE}:DirectTools", {"tools": [f"{HERE}:noop"], "parser": "hermes"}, asdict(EnvConfig()), 30.0]
    steps = {"fork": lambda: Child("environments", functools.partial(isolated_episodes, *arguments)).close(),
             "exec": lambda: Child("environments", ("grpo.environments.pool:isolated_episodes", arguments),
                                   clean=True).close()}
    for step in steps.values():
        step()  # warm-up
    ms = per_call_ms(steps, starts)
    print(f"{'environments child start':<34} forked from the sampler ({held_mb} MB) {ms['fork']:7.1f} ms   "
          f"started by exec {ms['exec']:7.1f} ms   ratio {ms['exec'] / ms['fork']:5.2f}x")
    del held


ANSWERS = ["<think>\n3 + 4 = 7\n</think>\n<answer>\n7\n</answer>", "<think>\n3 + 4 = 8\n</think>\n<answer>8</answer>",
           "<think>\nIt is $\\frac{14}{2}$.\n</think>\n<answer>$\\frac{14}{2}$</answer>", "The answer is 7.",
           "<think>\n7 apples\n</think>\n<answer>7 apples</answer>\nextra", "<answer>1,234.50</answer>"]


def bench_reward_batch(samples: int, workers: int, rounds: int = 3) -> None:
    """A sampler step's rule-reward scoring (score_completions, then strict_rates) of `samples` completions:
    a call for each reward and sample on one warden (as before), the built-ins a call a sample (prefetch) on
    one warden, and on `workers`; alternating, seconds per batch, medians of `rounds`."""
    rewards = load_config(None, []).rewards
    checks = checks_of(rewards)
    rows = [{"reference_answer": "7"} for _ in range(samples)]
    each, one, many = (RewardSandbox(rewards.timeout_s, names=[*rewards.names, *checks], workers=n)
                       for n in (1, 1, workers))
    variants = {"a call each, 1 warden": lambda name, completion, row: each(name, completion, row),  # no prefetch
                "a call a sample, 1 warden": one, f"a call a sample, {workers} wardens": many}
    try:
        seconds: dict[str, list[float]] = {label: [] for label in variants}
        for round_ in range(rounds):  # each round's samples new, as each step's are: no value kept from before
            texts = [f"(step {round_}, sample {i}) {ANSWERS[i % len(ANSWERS)]}" for i in range(samples)]
            for label, call in variants.items():
                started = time.perf_counter()
                score_completions(texts, rows, rewards.names, rewards.weights, None, call=call, also=checks)
                strict_rates(texts, rows, checks, call=call)
                seconds[label].append(time.perf_counter() - started)
        medians = {label: statistics.median(found) for label, found in seconds.items()}
        before = medians["a call each, 1 warden"]
        print(f"a step scored, {samples} samples (the default run's 2 rewards and 2 checks), medians of {rounds}:")
        for label, median in medians.items():
            print(f"  {label:<28} {median:6.2f} s   {before / median:5.2f}x")
    finally:
        for sandbox in (each, one, many):
            sandbox.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--lanes", type=int, default=4)
    parser.add_argument("--slow-calls", type=int, default=12, help="episodes per lane on the 1-second tool")
    parser.add_argument("--starts", type=int, default=20, help="starts of the environments' child per variant")
    parser.add_argument("--sampler-mb", type=int, default=2048, help="memory the sampler holds when it forks")
    parser.add_argument("--only-starts", action="store_true", help="measure the child's start alone")
    parser.add_argument("--samples", type=int, default=128, help="completions of the scored step")
    parser.add_argument("--workers", type=int, default=2, help="wardens scoring at once (rewards.workers)")
    parser.add_argument("--only-batch", action="store_true", help="measure a step's scoring alone")
    args = parser.parse_args()
    if args.only_starts:
        return bench_child_start(args.starts, args.sampler_mb)
    if args.only_batch:
        return bench_reward_batch(args.samples, args.workers)
    bench_tool(f"{HERE}:noop", "noop", {"x": 1}, args.calls, "trivial tool (one episode step)")
    bench_tool(CALCULATE, "calculate", {"expression": "48 / 2 + 7 * 3"}, args.calls, "calculator tool (one step)")
    bench_reward(args.calls)
    bench_slow_tool(args.lanes, args.slow_calls)
    bench_child_start(args.starts, args.sampler_mb)
    bench_reward_batch(args.samples, args.workers)


if __name__ == "__main__":
    main()
