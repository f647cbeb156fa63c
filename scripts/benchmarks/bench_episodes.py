"""Multi-turn episodes on the HF engine: in one decode loop (each episode going on from its KV as
soon as its environment replied) against turn by turn (each later turn `generate` on its whole
context), side by side in one run: generation tokens/s, wall time, turns.
The sampled runs of the two paths differ in their tokens (below); `--greedy` runs the same episodes on both.
`--reply-tokens` measures long environment replies: the loop with each feed limit
(sampling.episode_feed_tokens; 0 = a reply in one step) against turn by turn, per reply length.

    .venv/bin/python scripts/benchmarks/bench_episodes.py                       # calculator: 2 prompts x 8, 320 tokens
    .venv/bin/python scripts/benchmarks/bench_episodes.py --reply-tokens 20,100,400 --repeats 2  # feeds 0,8,16,32
    .venv/bin/python scripts/benchmarks/bench_episodes.py --prompts 4 --repeats 3 --threads 2
    .venv/bin/python scripts/benchmarks/bench_episodes.py --config configs/gsm8k_tools.yaml
    .venv/bin/python scripts/benchmarks/bench_episodes.py --check-exact --repeats 0 --prompts 1 --group-size 4
    .venv/bin/python scripts/benchmarks/bench_episodes.py "env.name=tests/scripted_envs.py:Scripted" \\
        "env.args={length: 4}"

Both paths run the same prompts (default configs/gsm8k_calculator.yaml: the embedded model, the
calculator in its child process, two solved examples in every prompt) under the same step seed, in
one process, after a warm-up of each (1 prompt x 2), alternating (loop, turn by turn, turn by turn,
loop, ...: drift of the machine hits both alike). Their tokens differ: the loop draws each
episode's turn from its own seeded generator, turn by turn draws one stream per turn across
episodes; both are the model's distribution. `--check-exact` also runs the loop's reference (each
episode alone, each turn re-prefilled, seeded alike: tests/test_continuous.py) and compares tokens
and log-probs.

With `--reply-tokens N,...` the environment is tests/scripted_envs.py:LongReplies, which answers
each of an episode's first two messages with a reply of about N tokens (its word count is chosen so
that the rendered turn, template and prefill included, is N tokens on the model's tokenizer; the
length used is printed) and ends the episode at the third; each episode's budget is
--max-new-tokens plus the two replies. For each N: turn by turn, then the loop at each --feeds value,
alternating as above, each with its forwards and the token-rows they computed (rows x tokens fed,
masked columns included).

Generation time is the run's wall time less the environment's (its steps and openings, timed);
model tokens are the ones the model drew; context tokens count the environment's replies too.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

from grpo.common.model_files import resolve_device  # noqa: E402
from grpo.config import parse_cli  # noqa: E402
from grpo.data.problems import load_split  # noqa: E402
from grpo.data.prompts import build_prompts  # noqa: E402
from grpo.environments import prompt_options  # noqa: E402
from grpo.model.loading import load_model, load_tokenizer  # noqa: E402
from grpo.run.preflight import named_code_problems  # noqa: E402
from grpo.sampler.episodes import EpisodeRunner, episode_runner  # noqa: E402
from grpo.sampler.rollout.hf_engine import HFEngine  # noqa: E402

CONFIG = ROOT / "configs" / "gsm8k_calculator.yaml"


class EnvironmentClock:
    """Time spent in the environment (the runner's openings and answers), to leave out of generation."""

    def __init__(self, runner):
        self.seconds = 0.0
        for name in ("_answer", "_opened"):
            setattr(runner, name, self._timed(getattr(type(runner), name).__get__(runner)))

    def _timed(self, call):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t
        return timed


class ForwardCounter:
    """Forwards of the model and the token-rows they computed (rows x tokens fed, masked ones included)."""

    def __init__(self, model):
        self.forwards = self.token_rows = 0
        model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.forwards += 1
            self.token_rows += ids.numel()


def measured_run(runner, clock, engine, prompts, group_size: int, seed: int, continued: bool, greedy: bool,
                 counter: ForwardCounter | None = None) -> dict:
    runner.continued = continued
    env_before, t = clock.seconds, time.perf_counter()
    forwards, token_rows = (counter.forwards, counter.token_rows) if counter else (0, 0)
    out = runner.run(engine, prompts, group_size, seed=seed, greedy=greedy)
    wall = time.perf_counter() - t
    masks = out.rollouts.model_masks
    return {"wall_s": wall, "generate_s": wall - (clock.seconds - env_before),
            "model_tokens": int(sum(int(m.sum()) for m in masks)),
            "context_tokens": sum(len(c) for c in out.rollouts.completion_ids), "out": out,
            "turns": statistics.mean(e.turns for e in out.episodes),
            "forwards": counter.forwards - forwards if counter else 0,
            "token_rows": counter.token_rows - token_rows if counter else 0}


def report(name: str, runs: list[dict]) -> dict:
    row = {key: statistics.median(r[key] for r in runs) for key in ("wall_s", "generate_s", "model_tokens",
                                                                     "context_tokens", "turns", "forwards",
                                                                     "token_rows")}
    row["tokens_per_s"] = statistics.median(r["model_tokens"] / r["generate_s"] for r in runs)
    print(f"{name:16s} wall {row['wall_s']:7.1f} s  generate {row['generate_s']:7.1f} s  "
          f"model tokens {row['model_tokens']:6.0f} ({row['tokens_per_s']:6.1f}/s)  "
          f"context tokens {row['context_tokens']:6.0f}  turns/episode {row['turns']:.2f}"
          + (f"  forwards {row['forwards']:5.0f}  token-rows {row['token_rows']:7.0f}" if row["forwards"] else ""))
    return row


def reply_words(runner, tokens: int) -> tuple[int, int]:
    """LongReplies' word count whose reply, as the runner renders it (template and prefill included),
    comes closest to `tokens` tokens; and that reply's length."""
    def length(words: int) -> int:
        return len(runner.reply_tokens(" ".join(f"w{k % 10}" for k in range(words)), "user"))

    words = min(range(1, tokens + 1), key=lambda w: abs(length(w) - tokens))
    return words, length(words)


def reply_sweep(args, overrides: list[str], greedy: bool) -> None:
    """Per reply length: turn by turn and the loop at each feed limit, side by side, with their ratios."""
    feeds = [int(f) for f in args.feeds.split(",")]
    variants = [("turn by turn", False, None)] + [(f"loop, feed {f}" if f else "loop, whole reply", True, f)
                                                   for f in feeds]
    env = ["env.name=tests/scripted_envs.py:LongReplies", "env.max_turns=3"]
    cfg = parse_cli(["--config", str(args.config), f"sampling.max_new_tokens={args.max_new_tokens}", *env,
                     "env.args={words: 1, length: 3}", *overrides], checks=[named_code_problems])
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, resolve_device(cfg.sampling.device)).eval()
    prompts = bench_prompts(cfg, tokenizer, args.prompts)
    engine, counter = HFEngine(model, tokenizer, cfg.sampling), ForwardCounter(model)
    print(f"{args.config.name} {' '.join(overrides)}: {args.prompts} prompts "
          f"({', '.join(str(len(p.token_ids)) for p in prompts)} tokens) x {args.group_size}, two replies an episode, "
          f"generation_batch_size {cfg.sampling.generation_batch_size}, {torch.get_num_threads()} threads, "
          f"device {engine.device}")
    for tokens in [int(n) for n in args.reply_tokens.split(",")]:
        words, shown = reply_words(EpisodeRunner(None, tokenizer, tokens, 3, cfg.data.prefill), tokens)
        budget = args.max_new_tokens + 2 * shown
        run_cfg = parse_cli(["--config", str(args.config), f"sampling.max_new_tokens={budget}", *env,
                             f"env.args={{words: {words}, length: 3}}", *overrides], checks=[named_code_problems])
        runner = episode_runner(run_cfg, tokenizer)
        clock = EnvironmentClock(runner)
        runs = {name: [] for name, _, _ in variants}
        try:
            for name, continued, feed in variants:  # warm-up, in no one's time
                engine.cfg.episode_feed_tokens = feed or 0
                measured_run(runner, clock, engine, prompts[:1], 2, args.seed + 1, continued, greedy)
            for repeat in range(args.repeats):
                for name, continued, feed in (variants if repeat % 2 == 0 else variants[::-1]):
                    engine.cfg.episode_feed_tokens = feed or 0
                    runs[name].append(measured_run(runner, clock, engine, prompts, args.group_size,
                                                   args.seed + repeat, continued, greedy, counter))
        finally:
            runner.pool.close()
        print(f"\nreplies of {shown} tokens ({words} words), episodes of at most {budget} tokens:")
        rows = {name: report(name, runs[name]) for name, _, _ in variants}
        by_turn, whole = rows["turn by turn"], rows.get("loop, whole reply")
        for name, continued, feed in variants[1:]:
            row = rows[name]
            print(f"  {name:16s} tokens/s ratio: {row['tokens_per_s'] / by_turn['tokens_per_s']:.2f}x turn by turn"
                  + (f", {row['tokens_per_s'] / whole['tokens_per_s']:.2f}x the whole reply in one step"
                     if whole and feed else ""))


def bench_prompts(cfg, tokenizer, count: int) -> list:
    problems, _ = load_split(cfg.data, cfg.data.split)
    # the first data.few_shot train problems are the solved examples, never asked
    asked = problems[:count + cfg.data.few_shot]
    prompts = build_prompts(tokenizer, cfg.data, asked, **prompt_options(cfg.env))[0][:count]
    if len(prompts) < count:
        raise SystemExit(f"only {len(prompts)} prompts fit data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    return prompts


def check_exact(runner, engine, prompts, group_size: int, seed: int) -> None:
    """The loop against its reference (each episode alone, re-prefilled at every turn, seeded alike)."""
    from test_continuous import OneAtATime

    runner.continued = True
    loop = runner.run(engine, prompts, group_size, seed=seed)
    alone = runner.run(OneAtATime(engine), prompts, group_size, seed=seed)
    pairs = list(zip(loop.rollouts.completion_ids, alone.rollouts.completion_ids, strict=True))
    same = sum(torch.equal(a, b) for a, b in pairs)
    gaps = [(a - b).abs().max().item() for (x, y), a, b in zip(pairs, loop.rollouts.logps, alone.rollouts.logps)
            if torch.equal(x, y) and len(a)]
    first = [next((i for i, (p, q) in enumerate(zip(x.tolist(), y.tolist())) if p != q), min(len(x), len(y)))
             for x, y in pairs if not torch.equal(x, y)]
    print(f"exactness: {same} of {len(pairs)} episodes drew the reference's tokens; largest log-prob gap of "
          f"those {max(gaps, default=0.0):.2e}" + (f"; the others part at token {first}" if first else ""))


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=320)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each path (medians are printed)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--check-exact", action="store_true", help="also compare the loop with its reference")
    parser.add_argument("--greedy", action="store_true",
                        help="greedy episodes: both paths draw the same tokens "
                             "(one episode per prompt, --group-size 1)")
    parser.add_argument("--reply-tokens", default="",
                        help="comma-separated reply lengths in tokens (e.g. 20,100,400): replies of the scripted "
                             "environment tests/scripted_envs.py:LongReplies, turn by turn against the loop at "
                             "--feeds")
    parser.add_argument("--feeds", default="0,8,16,32",
                        help="with --reply-tokens: the loop's sampling.episode_feed_tokens values (0: a reply in "
                             "one step)")
    args, overrides = parser.parse_known_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reply_tokens:
        reply_sweep(args, overrides, args.greedy)
        return
    cfg = parse_cli(["--config", str(args.config), f"sampling.max_new_tokens={args.max_new_tokens}", *overrides],
                    checks=[named_code_problems])
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model, resolve_device(cfg.sampling.device)).eval()
    prompts = bench_prompts(cfg, tokenizer, args.prompts)
    engine = HFEngine(model, tokenizer, cfg.sampling)
    runner = episode_runner(cfg, tokenizer)
    clock = EnvironmentClock(runner)
    print(f"{args.config.name} {' '.join(overrides)}: {args.prompts} prompts "
          f"({', '.join(str(len(p.token_ids)) for p in prompts)} tokens) x {args.group_size}, max_new_tokens "
          f"{args.max_new_tokens}, generation_batch_size {cfg.sampling.generation_batch_size}, "
          f"{torch.get_num_threads()} threads, device {engine.device}")
    try:
        if args.check_exact:
            check_exact(runner, engine, prompts, args.group_size, args.seed)
            if args.repeats == 0:  # the check alone
                return
        for continued in (True, False):  # warm-up, in neither's time: a first forward of a shape costs extra on CPU
            measured_run(runner, clock, engine, prompts[:1], 2, args.seed + 1, continued, args.greedy)
        runs = {True: [], False: []}
        for repeat in range(args.repeats):
            for continued in ((True, False) if repeat % 2 == 0 else (False, True)):
                runs[continued].append(measured_run(runner, clock, engine, prompts, args.group_size,
                                                    args.seed + repeat, continued, args.greedy))
    finally:
        runner.pool.close()
    loop, by_turn = report("one loop", runs[True]), report("turn by turn", runs[False])
    if args.greedy:
        a, b = runs[True][0]["out"], runs[False][0]["out"]
        same = sum(torch.equal(x, y) for x, y in zip(a.rollouts.completion_ids, b.rollouts.completion_ids))
        print(f"greedy: {same} of {len(a.episodes)} episodes the same tokens on both paths")
    print(f"generation tokens/s ratio (one loop / turn by turn): {loop['tokens_per_s'] / by_turn['tokens_per_s']:.2f}x"
          f"   wall time ratio (turn by turn / one loop): {by_turn['wall_s'] / loop['wall_s']:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
