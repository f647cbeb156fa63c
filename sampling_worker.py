"""The sampling process: rollouts, rewards, advantages, old/ref log-probs, batches over ZeroMQ.

    python sampling_worker.py [--config config.yaml] [key=value ...]

One loop, one step per training step k:
  wait until weights v >= k - max_staleness are loaded -> take B prompts -> G completions each
  -> rewards (per function and weighted) -> group-relative advantages -> old log-probs (the
  generating weights) and reference log-probs (adapter off / frozen copy; only when beta > 0
  and training.reference_on=sampler) with the shared-prefix forward at the sampling
  temperature -> send the RolloutBatch -> save the data cursor (after the send, so a restart
  neither repeats nor skips prompts).

Old log-probs: `sampling.old_logps=recompute` runs the forward the trainer uses, so the
importance ratio is exactly 1 for on-policy data; `generation` records them while sampling
(one forward pass fewer; they differ from the recompute by float rounding, ~5e-5 on the
embedded model, logged on the first step). The policy may be up to `sampling.max_staleness`
versions behind.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import sys
import time

import torch

from data.cursor import PromptCursor
from data.gsm8k import load_problems
from data.prompts import build_prompts
from grpo.advantages import group_advantages
from grpo.batch import RolloutBatch
from grpo.config import parse_cli, save_config
from grpo.delivery import Redelivery, Spool, TrainerState, resume_step
from grpo.files import RunFolderError, ensure_writable
from grpo.logprobs import completion_logprobs
from grpo.models import load_model, load_tokenizer, add_lora, resolve_device
from grpo.rollout import make_engine
from grpo.sampling import (SamplerState, loss_counts, required_version, sampler_metrics, strict_rates,
                           wait_for_version)
from grpo.sources import SourceError
from grpo.transport import BatchSender
from grpo.weights import WeightWatcher, into_model
from rewards import score_completions
from rewards.sandbox import RewardSandbox

log = logging.getLogger("sampler")
SAMPLER_ID = 0  # the delivery key is (sampler, step); one sampler per run for now


def main(argv: list[str]) -> int:
    cfg = parse_cli(argv)
    logging.basicConfig(level=cfg.logging.level, format="%(asctime)s sampler %(levelname)s %(message)s")
    try:
        run_dir = ensure_writable(cfg.run_dir)
    except RunFolderError as e:
        log.error("%s", e)
        return 2
    save_config(cfg, run_dir / "config.yaml")
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.sampling.device)

    # ------------------------------------------------------------------ model, data, state
    try:
        tokenizer = load_tokenizer(cfg.model)
        base = load_model(dataclasses.replace(cfg.model, gradient_checkpointing=False), device)
        problems, _ = load_problems(cfg.data.path, cfg.data.split)
        prompts, dropped = build_prompts(tokenizer, cfg.data, problems)
    except SourceError as e:  # offline Hub id, missing folder, damaged embedded copy: one line, no traceback
        log.error("%s", e)
        return 2
    reference = None
    if cfg.training.beta > 0 and not cfg.lora.enabled:
        reference = copy.deepcopy(base).eval()  # full fine-tuning: a frozen copy of the start
    model = (add_lora(base, cfg.lora) if cfg.lora.enabled else base).eval()

    log.info("%d prompts from %s/%s (%d longer than %d tokens dropped)", len(prompts), cfg.data.path,
             cfg.data.split, dropped, cfg.data.max_prompt_tokens)
    s, G = cfg.sampling, cfg.sampling.group_size
    cursor = PromptCursor(len(prompts), cfg.seed)
    state = SamplerState(run_dir / "sampler_state.json")
    saved = state.load()
    start_step = 0
    if saved is not None:
        cursor.load_state_dict(saved["cursor"])  # refuses a cursor from other data or another seed
        start_step = saved["next_step"]
    spool = Spool.of_sampler(run_dir, SAMPLER_ID)
    saved_step, start_step = start_step, resume_step(spool, TrainerState.load(run_dir / "trainer_state.json"),
                                                      SAMPLER_ID, start_step)
    if start_step != saved_step:  # rewound: the spool lost steps the trainer still needs
        cursor.seek(start_step * s.prompts_per_step)
    if start_step:
        log.info("resuming at step %d (cursor epoch %d, index %d)", start_step, cursor.state.epoch,
                 cursor.state.index)

    engine = make_engine(cfg, model, tokenizer)
    # the HF engine generates with the scoring model itself; an engine with its own copy of the
    # weights (vLLM) gets each version too, after the scoring model (recomputed and reference log-probs)
    loaders = [engine.load_weights] if cfg.sampling.engine == "hf" else [into_model(model), engine.load_weights]
    watcher = WeightWatcher(cfg.weights_dir, loaders)
    sender = BatchSender(cfg.transport.address, high_water_mark=cfg.transport.high_water_mark,
                         send_timeout_s=cfg.transport.send_timeout_s, secret=cfg.transport.secret)
    redelivery = Redelivery(spool, sender.send_frames, run_dir / "trainer_state.json", SAMPLER_ID)
    sandbox = RewardSandbox(cfg.rewards.timeout_s) if cfg.rewards.timeout_s > 0 else None

    # ------------------------------------------------------------------ the loop
    previous_send_s = 0.0
    for step in range(start_step, cfg.training.steps):
        redelivery.check(step)  # a (re)started trainer first gets the spooled steps it lacks
        t, loaded_before = time.perf_counter(), watcher.load_seconds
        wait_for_version(watcher, required_version(step, s.max_staleness, cfg.weights.publish_every),
                         s.wait_timeout_s, on_poll=lambda: redelivery.check(step))
        timings = {"timing/weights_wait_s": time.perf_counter() - t,  # loading included
                   "timing/weight_load_s": watcher.load_seconds - loaded_before,
                   "timing/previous_send_s": previous_send_s}  # this batch's own send is not over when it is encoded
        chosen = [prompts[i] for i in cursor.take(s.prompts_per_step)]
        prompt_ids = [torch.tensor(p.token_ids, dtype=torch.long) for p in chosen]

        t = time.perf_counter()
        from_generation = s.old_logps == "generation"
        rollouts = engine.generate([p.token_ids for p in chosen], G, seed=cfg.seed * 1_000_003 + step)
        timings["timing/generate_s"] = time.perf_counter() - t

        t = time.perf_counter()
        texts = [cfg.data.prefill + x for x in tokenizer.batch_decode(rollouts.completion_ids,
                                                                       skip_special_tokens=True)]
        answers = [p.problem.answer for p in chosen for _ in range(G)]
        scores = score_completions(texts, answers, cfg.rewards.names, cfg.rewards.weights, cfg.rewards.fallback,
                                   call=sandbox)
        advantages = group_advantages(scores.total, G, scale=cfg.training.advantage_scale)
        timings["timing/rewards_s"] = time.perf_counter() - t

        t = time.perf_counter()
        args = (prompt_ids, rollouts.completion_ids, [G] * len(chosen))
        kwargs = dict(temperature=s.temperature, shared_prefix=cfg.training.shared_prefix)
        with torch.no_grad():
            old_logps = rollouts.logps if from_generation else completion_logprobs(model, *args, **kwargs)
            ref_logps = None
            if cfg.training.beta > 0 and cfg.lora.enabled and cfg.training.reference_on == "sampler":
                with model.disable_adapter():
                    ref_logps = completion_logprobs(model, *args, **kwargs)
            elif reference is not None:
                ref_logps = completion_logprobs(reference, *args, **kwargs)
        timings["timing/logprobs_s"] = time.perf_counter() - t

        truncated = torch.tensor(rollouts.truncated, dtype=torch.bool)
        num_tokens, num_sequences = loss_counts(rollouts.completion_ids, truncated,
                                                cfg.training.mask_truncated_completions)
        batch = RolloutBatch(
            step=step, sampler=SAMPLER_ID, policy_version=watcher.version, prompt_ids=prompt_ids,
            completion_ids=rollouts.completion_ids, group_sizes=[G] * len(chosen),
            old_logps=[x.float().cpu() for x in old_logps],
            ref_logps=[x.float().cpu() for x in ref_logps] if ref_logps is not None else None,
            rewards=scores.per_function, reward_names=list(cfg.rewards.names), advantages=advantages,
            truncated=truncated, num_tokens=num_tokens, num_sequences=num_sequences,
            meta={"sample_ids": [p.problem.id for p in chosen]})
        metrics = sampler_metrics(batch, scores.total, scores.failures, timings)
        metrics["sampler/weight_load_failures"] = float(watcher.failures)
        metrics.update(strict_rates(texts, answers))
        if not from_generation or step == start_step:
            # the engine's sampled log-probs against the recomputed ones: at every step when the
            # recompute runs anyway; once per start when the recorded ones replace it
            recomputed = old_logps
            if from_generation:
                with torch.no_grad():
                    recomputed = completion_logprobs(model, *args, **kwargs)
            gaps = [(a - b.float().cpu()).abs().max().item() for a, b in zip(rollouts.logps, recomputed)]
            metrics["sampler/engine_logp_gap_max"] = max(gaps)
            if from_generation:
                log.info("old log-probs read off generation differ from the recomputed ones by at most %.2e",
                         max(gaps))
        batch.meta["metrics"] = metrics

        t = time.perf_counter()
        frames = sender.encode(batch)
        spool.put(step, frames)  # kept until the trainer checkpoints past it (at-least-once delivery)
        sender.send_frames(frames)  # blocks at the high-water mark: a slow trainer applies back-pressure
        previous_send_s = time.perf_counter() - t
        state.save(step + 1, cursor.state_dict())
        log.info("step %d v%d reward %.3f gen %.1fs logp %.1fs len %.0f", step, watcher.version,
                 metrics["reward"], timings["timing/generate_s"], timings["timing/logprobs_s"],
                 metrics["completions/mean_length"])

    if sandbox is not None:
        sandbox.close()
    redelivery.wait_until_checkpointed(cfg.training.steps, s.wait_timeout_s)
    sender.close()
    log.info("done: %d steps", cfg.training.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
