"""Held-out evaluation: greedy answers to a fixed set of problems, scored with the strict rewards.

One function serves both `grpo evaluate` (any weights, by hand) and the evaluation during
training (`eval.every`): the sampler runs it between steps with the weights it serves, so the
two agree on the same weights. The result's rates are those the configured rewards decide
(rewards/strict.py: GSM8K's strict pair by default), with the binomial standard error of the accuracy.
"""

from __future__ import annotations

import math
import time
import uuid
from pathlib import Path

from grpo.rewards.strict import GSM8K_CHECKS, passes
from grpo.sampler.generation import generate_completions


def greedy_samples(engine, tokenizer, prompts: list, prefill: str, batch_size: int, progress=None,
                   checks: tuple[str, str] = GSM8K_CHECKS, episodes=None, call=None) -> list[dict]:
    """Each prompt's greedy completion (with `episodes`, a grpo.sampler.episodes.EpisodeRunner: its greedy
    episode, judged by its last model message), scored with the (accuracy, format) rewards
    `checks` (run by `call`, the reward sandbox; None: here): the rows of an evaluation."""
    samples = []
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        made = generate_completions(engine, tokenizer, chunk, 1, prefill, episodes, greedy=True)
        rollouts, completions, rows = made.rollouts, made.texts, made.rows
        correct, formatted = passes(checks[0], completions, rows, call), passes(checks[1], completions, rows, call)
        for k, (prompt, completion, ids, cut, ok, form) in enumerate(zip(chunk, completions, rollouts.completion_ids,
                                                                       rollouts.truncated, correct, formatted)):
            samples.append({"id": prompt.problem.id, "answer": prompt.problem.answer, "completion": completion,
                            "correct": ok, "format": form, "tokens": len(ids), "truncated": cut})
            if episodes is not None:  # the whole episode, tool results included, and its counts
                e = made.episodes[k]
                samples[-1].update(episode=prefill + tokenizer.decode(ids, skip_special_tokens=True), turns=e.turns,
                                   tool_calls=e.tool_calls, tool_errors=e.tool_errors,
                                   malformed_calls=e.malformed_calls)
        if progress is not None:
            progress(len(chunk))
    return samples


def summary(samples: list[dict]) -> dict[str, float]:
    n = max(len(samples), 1)
    accuracy = sum(s["correct"] for s in samples) / n
    return {"problems": len(samples), "answer_accuracy": accuracy,
            "answer_accuracy_stderr": math.sqrt(accuracy * (1 - accuracy) / n),
            "format_rate": sum(s["format"] for s in samples) / n,
            "mean_completion_tokens": sum(s["tokens"] for s in samples) / n,
            "truncated_rate": sum(s["truncated"] for s in samples) / n,
            **({"mean_turns": sum(s["turns"] for s in samples) / n,
                "mean_tool_calls": sum(s["tool_calls"] for s in samples) / n,
                # episodes with a call the environment could read, to a tool it has (env/well_formed_call_rate)
                "well_formed_call_rate": sum(s["tool_calls"] > s["malformed_calls"] for s in samples) / n}
               if samples and "turns" in samples[0] else {})}


class TrainingEvaluator:
    """The sampler's evaluation during training: at weights versions 0, N, 2N, ... (eval.every;
    the first served version at or past each mark: with staleness the sampler may skip one) and
    at the end."""

    def __init__(self, eval_cfg, prompts: list, tokenizer, prefill: str, evaluated_through: int = -1,
                 checks: tuple[str, str] = GSM8K_CHECKS, episodes=None, call=None):
        """`evaluated_through`: the marks up to this version are done (-1 on a fresh start; a
        resumed sampler passes the least version its last step could have served). `checks`:
        the (accuracy, format) rewards (rewards.accuracy_reward, rewards.format_reward), run by
        `call` (the reward sandbox)."""
        self.cfg, self.prompts, self.tokenizer, self.prefill = eval_cfg, prompts, tokenizer, prefill
        self.checks, self.episodes, self.call = checks, episodes, call
        self.next_mark = self._mark_after(evaluated_through)
        self.newest_seen = max(evaluated_through, 0)
        self.last_samples: list[dict] = []

    def _mark_after(self, version: int) -> int:
        """The first multiple of eval.every above `version`."""
        return (version // self.cfg.every + 1) * self.cfg.every

    def due(self, version: int) -> bool:
        if version < self.newest_seen:  # the trainer resumed from an older checkpoint: the versions
            self.next_mark = min(self.next_mark, self._mark_after(version))  # after it are new weights
        self.newest_seen = version
        return version >= self.next_mark

    def run(self, engine, version: int) -> dict:
        """The `eval/` metrics of the weights `engine` serves (version `version`), keyed for metrics.jsonl."""
        t = time.perf_counter()
        self.last_samples = greedy_samples(engine, self.tokenizer, self.prompts, self.prefill, self.cfg.batch_size,
                                           checks=self.checks, episodes=self.episodes, call=self.call)
        result = summary(self.last_samples)
        self.next_mark = self._mark_after(version)
        return {"step": version, **{f"eval/{key}": float(value) for key, value in result.items()},
                "eval/seconds": time.perf_counter() - t}


def evaluated_through_at_start(eval_cfg, served_at_least: int | None) -> int:
    """The version through which marks count as done when a sampler starts: on a resume, the least
    version its last step could have served (`served_at_least`; those marks' rows exist); on a
    fresh start -1 (mark 0 is due), or 0 with eval.on_start false."""
    if served_at_least is not None:
        return served_at_least
    return -1 if eval_cfg.on_start else 0


def append_metrics_row(run_dir: Path, row: dict, logging_cfg, run_name: str) -> None:
    """The final evaluation's row, written by the sampler once the trainer has written its last one
    (the run's one metrics writer, appending only; its TensorBoard events in a file of their own, its
    tracker rows in a tracker run of its own in the run folder's group)."""
    from grpo.run.metrics_log import MetricsLog
    from grpo.run.tracking import open_tracker

    tracker = open_tracker(logging_cfg, run_dir, run_name, {}, writer=f"eval-{uuid.uuid4().hex[:12]}")
    log = MetricsLog(run_dir, None, logging_cfg.tensorboard, tracker, events_suffix=".eval")
    try:
        log.write({"wall_time": time.time(), **row})
    finally:
        log.close()
