"""The sampling process: rollouts, rewards, advantages, old/ref log-probs, batches over ZeroMQ.

    python sampling_worker.py [--config config.yaml] [key=value ...]   (or python -m grpo.workers.sampler)

One loop, one step per training step k (with N samplers, sampler i makes the global steps
g = i, i + N, i + 2N, ...: prompts, seeds and the staleness gate follow g, so N samplers make
the batches one sampler would; grpo/wire/delivery.py):
  wait until weights v >= g - max_staleness are loaded -> take B prompts -> G completions each
  -> rewards (per function and weighted) -> group-relative advantages -> old log-probs (the
  generating weights) and reference log-probs (adapter off / frozen copy; only when beta > 0
  and training.reference_on=sampler) with the shared-prefix forward at the sampling
  temperature -> spool and send the RolloutBatch -> save the data cursor (after the send, so a
  restart neither repeats nor skips prompts). The step, top to bottom: grpo/sampler/sampling_step.py;
  delivery (spool, re-sending to a restarted trainer): grpo/wire/delivery.py.

Old log-probs: `sampling.old_logps=recompute` runs the forward the trainer uses, so the
importance ratio is exactly 1 for on-policy data; `generation` uses the log-probs the engine
recorded while sampling (one forward pass fewer; they differ from the recompute by float
rounding, ~5e-5 on the embedded model, logged on the first step). The policy may be up to
`sampling.max_staleness` versions behind.

Exit codes: 0 done; 2 a config, run folder, model, data or start-up error (one line);
EXIT_REWARD_FAILED (8) a reward failed on every sample of rewards.max_failed_steps steps in a row;
EXIT_ENVIRONMENT_FAILED (9) the environment failed on every episode of env.max_failed_steps steps
in a row (each one line: what failed, its error and where it was raised, what to do).
"""

from __future__ import annotations

import copy
import dataclasses
import faulthandler
import logging
import signal
import sys

import torch

from grpo.agent.runner import rollout_runner
from grpo.common.files import RunFolderError, ensure_writable
from grpo.common.imports import user_code_importable
from grpo.common.model_files import resolve_device
from grpo.common.run_folder import RunFolder
from grpo.common.sources import SourceError
from grpo.config import Config, exit_code, help_requested, parse_cli
from grpo.data.cursor import PromptCursor
from grpo.data.mixture import MixtureCursor, evaluation_source, source_configs
from grpo.data.problems import load_split
from grpo.data.prompts import build_prompts
from grpo.environments import prompt_options
from grpo.environments.pool import IsolationError
from grpo.model.loading import (
    add_lora,
    check_teacher_tokenizer,
    load_model,
    load_processor,
    load_teacher,
    load_tokenizer,
)
from grpo.model.logprobs import check_supported
from grpo.objective import Objective
from grpo.rewards.reward_model import RewardModelError
from grpo.rewards.sandbox import reward_sandbox
from grpo.rewards.services import ServiceSettings, ServiceStartError, start_services
from grpo.rewards.strict import checks_of
from grpo.run.epochs import with_epochs_as_steps
from grpo.run.history import ResumeRefused, refuse_a_changed_resume, save_run_config, settings_a_resume_keeps
from grpo.run.preflight import named_code_problems
from grpo.run.progress import log_milestone
from grpo.run.secret import run_secret
from grpo.run.start import trained_nothing
from grpo.sampler.batches import SamplerModels
from grpo.sampler.episodes import TemplateRoleError
from grpo.sampler.evaluation import TrainingEvaluator, append_metrics_row, evaluated_through_at_start
from grpo.sampler.failures import AlwaysFailing, RewardAlwaysFails
from grpo.sampler.in_flight import in_flight_poll, settle_in_flight
from grpo.sampler.remote_teacher import RemoteTeacher, TeacherServerError
from grpo.sampler.rollout import make_engine
from grpo.sampler.sampling_step import SamplerRun, run_step
from grpo.sampler.state import SamplerState, drop_a_start_made_otherwise
from grpo.weights import open_watcher
from grpo.weights.folder import stager_for_model
from grpo.wire.behaviour import behaviour_of
from grpo.wire.delivery import Redelivery, Spool, SpoolError, TrainerState, global_step, resume_step, steps_of_sampler
from grpo.wire.staleness import oldest_version, wait_for_version
from grpo.wire.transport import BatchSender

log = logging.getLogger("sampler")
EXIT_REWARD_FAILED = 8  # a reward failed on every sample of rewards.max_failed_steps steps in a row
EXIT_ENVIRONMENT_FAILED = 9  # the environment failed on every episode of env.max_failed_steps steps in a row


def main(argv: list[str]) -> int:
    if help_requested(argv, __doc__):
        return 0
    cfg = with_epochs_as_steps(parse_cli(argv, checks=[named_code_problems]))
    sampler = cfg.sampling.worker_index  # the delivery key is (sampler, step)
    name = "sampler" if cfg.sampling.num_workers == 1 else f"sampler{sampler}"
    logging.basicConfig(level=cfg.logging.level, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the launcher asks for the stacks of a silent start
    policy = None
    try:
        try:  # a run folder, model or data that cannot be had: one line, no traceback
            run_dir = ensure_writable(cfg.run_dir)
            policy, sources = load_policy_and_prompts(cfg)
            prompts = [prompt for source in sources for prompt in source]  # one table; a mixture's cursor knows where
            eval_prompts = evaluation_prompts(cfg, policy.tokenizer) if cfg.eval.every and sampler == 0 else None
            start_services(cfg.rewards.names, policy.services)
        except (RunFolderError, SourceError, TemplateRoleError, IsolationError, ServiceStartError,
                RewardModelError, TeacherServerError) as e:
            log.error("%s", e)
            return 2
        return sample(cfg, run_dir, policy, sources, prompts, eval_prompts)
    finally:  # every way out, the final evaluation's scoring included, before the jails go
        if policy is not None and policy.sandbox is not None:
            policy.sandbox.close()
        if policy is not None and policy.episodes is not None:
            policy.episodes.close()


def sample(cfg: Config, run_dir, policy: SamplerModels, sources: list[list], prompts: list,
           eval_prompts: list | None) -> int:
    """This sampler's steps, from where the run stands to its last, then the final evaluation (sampler 0
    with eval.every): the exit code."""
    sampler = cfg.sampling.worker_index
    try:  # before this sampler writes anything, as the trainer does
        changed = refuse_a_changed_resume(cfg)
    except ResumeRefused as e:
        log.error("%s", e)
        return 2
    if changed:
        log.info("%s", changed)
    if trained_nothing(run_dir, cfg.weights_dir):  # else the trainer has recorded the config
        if drop_a_start_made_otherwise(run_dir, sampler, settings_a_resume_keeps(cfg)):
            log.info("no step of this run was trained and an earlier start with other settings left a position and "
                     "spooled batches: dropped; starting at step 0")
        if sampler == 0:
            save_run_config(cfg)
    spool = Spool.of_sampler(run_dir, sampler)
    state = SamplerState.of_sampler(run_dir, sampler)
    cursor, start_step = resume_position(cfg, state, spool, [len(source) for source in sources], run_dir)
    watcher = open_watcher(cfg, weight_stagers(policy))
    sender = BatchSender(cfg.transport.address, high_water_mark=cfg.transport.high_water_mark,
                         send_timeout_s=cfg.transport.send_timeout_s, secret=run_secret(cfg.transport.secret, run_dir))
    flushed = False
    try:
        redelivery = Redelivery(spool, sender.send_frames, RunFolder(run_dir).trainer_state, sampler,
                                sender.signature_problem)
        evaluator = training_evaluator(cfg, eval_prompts, policy, start_step)
        if cfg.sampling.in_flight_updates:  # new versions load between decode steps too, not only between steps
            policy.engine.poll_weights = in_flight_poll(cfg.sampling, policy, watcher, evaluator)
        end_step = steps_of_sampler(sampler, cfg.training.steps, cfg.sampling.num_workers)
        loop = SamplerRun(cfg, policy, prompts, cursor, watcher, redelivery, sender, spool, state, evaluator,
                          start_step, end_step)
        try:
            for step in range(start_step, end_step):
                run_step(loop, step)
        except AlwaysFailing as e:  # a reward or an environment that never works: one line, not a run of hours
            log.error("%s", e)
            return EXIT_REWARD_FAILED if isinstance(e, RewardAlwaysFails) else EXIT_ENVIRONMENT_FAILED
        except (SpoolError, TeacherServerError) as e:  # a spooled batch not the run's own or unreadable (never
            log.error("%s", e)  # sent); the teacher's server down or answering wrongly after its retries
            return 2

        redelivery.wait_until_checkpointed(end_step, cfg.sampling.wait_timeout_s)
        if evaluator is not None:
            settle_in_flight(policy.engine)
            evaluate_to_the_end(cfg, evaluator, watcher, policy.engine, run_dir)
        sender.close()  # after what is queued has left (within transport.send_timeout_s)
        flushed = True
        policy.engine.close()
        log.info("done: %d steps", end_step)
        return 0
    finally:
        if not flushed:  # any other way out: what is queued is spooled, for the next start; no wait for a trainer
            sender.close(flush=False)


# ----------------------------------------------------------------------------- the steps of main

def load_policy_and_prompts(cfg: Config) -> tuple[SamplerModels, list[list]]:
    """The tokenizer, the scoring model (with the LoRA adapter), a frozen reference for a full
    fine-tune with beta > 0, distill.teacher's model, the rollout engine, the rewards' jail, and the
    tokenised training prompts of each source (data.path, or each of data.sources)."""
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.sampling.device)
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template_kwargs)
    base = load_model(dataclasses.replace(cfg.model, gradient_checkpointing=False, dtype=cfg.sampler_dtype), device)
    check_supported(base, cfg)
    sources = [source_prompts(cfg, tokenizer, source, k) for k, source in enumerate(source_configs(cfg.data))]
    objective = Objective.of(cfg)  # the one of this process: the models carry it to every step
    reference = copy.deepcopy(base).eval() if objective.beta > 0 and not cfg.lora.enabled else None
    model = (add_lora(base, cfg.lora, cfg.model.train_vision) if cfg.lora.enabled else base).eval()
    teacher = load_distill_teacher(cfg, tokenizer, device, base.config.get_text_config().vocab_size)
    policy = SamplerModels(make_engine(cfg, model, tokenizer), model, reference, tokenizer,
                           behaviour_of(cfg, tokenizer, objective.header()), objective, ServiceSettings.of(cfg),
                           episodes=rollout_runner(cfg, tokenizer), sandbox=reward_sandbox(cfg.rewards),
                           teacher=teacher)
    return policy, sources


def load_distill_teacher(cfg: Config, tokenizer, device, vocab_size: int):
    """distill.teacher: its server, checked to answer prompt log-probs (distill.teacher_url), or its model, scored
    with the same shared-prefix forward as the policy; None without a teacher."""
    if not cfg.distill.teacher:
        return None
    if cfg.distill.teacher_url:
        check_teacher_tokenizer(cfg, tokenizer)
        teacher = RemoteTeacher(cfg.distill.teacher_url, cfg.distill.served_name or cfg.distill.teacher,
                                cfg.distill.timeout_s, cfg.distill.api_key_env)
        longest = max(source.max_prompt_tokens for source in source_configs(cfg.data)) + cfg.sampling.max_new_tokens
        teacher.check(tokenizer.encode("The teacher scores these tokens.", add_special_tokens=False), longest,
                      decode=lambda token: tokenizer.decode([token]))
        log_milestone(log, "distill.teacher=%s answers prompt log-probs at %s", teacher.model, teacher.url)
        return teacher
    teacher = load_teacher(cfg, tokenizer, device, vocab_size)
    check_supported(teacher, cfg, f"distill.teacher={cfg.distill.teacher}")
    return teacher


def source_prompts(cfg: Config, tokenizer, source, k: int) -> list:
    """One source's prompts (a mixture's ids prefixed with the source's number: ids stay unique)."""
    problems, _ = load_split(source, source.split)
    prompts, dropped = build_prompts(tokenizer, source, problems, **prompt_options(cfg.env),
                                     processor=load_processor(cfg.model, source, tokenizer))
    if cfg.data.sources:
        prompts = [dataclasses.replace(p, problem=dataclasses.replace(p.problem, id=f"{k}:{p.problem.id}"))
                   for p in prompts]
    weight = f", weight {cfg.data.sources[k]['weight']:g}" if cfg.data.sources else ""
    log_milestone(log, "%d prompts from %s/%s%s (%d longer than %d tokens dropped)", len(prompts), source.path,
                  source.split, weight, dropped, source.max_prompt_tokens)
    return prompts


def evaluation_prompts(cfg: Config, tokenizer) -> list:
    """The first eval.num_problems problems of eval.split, as prompts like the training ones."""
    source = evaluation_source(cfg.data)  # data.eval_path, else the training data; the few-shot turns are the latter's
    problems, _ = load_split(source, cfg.eval.split)
    prompts, _ = build_prompts(tokenizer, source_configs(cfg.data)[0], problems[:cfg.eval.num_problems],
                               **prompt_options(cfg.env), processor=load_processor(cfg.model, source, tokenizer))
    log.info("evaluation every %d versions on %d problems of %s/%s", cfg.eval.every, len(prompts), source.path,
             cfg.eval.split)
    return prompts


def resume_position(cfg: Config, state: SamplerState, spool: Spool, sizes: list[int],
                    run_dir) -> tuple[PromptCursor | MixtureCursor, int]:
    """The data cursor and the first step to generate: after the last one sent, unless the
    trainer needs steps the spool no longer holds (grpo/wire/delivery.py, rule 5). The loop seeks the
    cursor to each step's global position; a saved cursor still refuses other data or seed."""
    cursor = MixtureCursor(sizes, [s["weight"] for s in cfg.data.sources], cfg.seed) if cfg.data.sources \
        else PromptCursor(sizes[0], cfg.seed)
    saved = state.load()
    saved_step = 0
    if saved is not None:
        cursor.load_state_dict(saved["cursor"])  # refuses a cursor from other data or another seed
        saved_step = saved["next_step"]
    sampler = cfg.sampling.worker_index
    start_step = resume_step(spool, TrainerState.load(RunFolder(run_dir).trainer_state), sampler, saved_step)
    if start_step:
        log.info("resuming at step %d (global step %d)", start_step,
                 global_step(sampler, start_step, cfg.sampling.num_workers))
    return cursor, start_step


def training_evaluator(cfg: Config, eval_prompts: list | None, policy: SamplerModels,
                       start_step: int) -> TrainingEvaluator | None:
    """The evaluator of the marks to come, on sampler 0 with eval.every (None without evaluation prompts)."""
    if eval_prompts is None:
        return None
    # resumed: the step before start_step served at least version g - 1 - max_staleness and
    # evaluated every mark up to it (their rows exist)
    g = global_step(cfg.sampling.worker_index, start_step, cfg.sampling.num_workers)
    served = oldest_version(g - 1, cfg.sampling.max_staleness) if start_step else None
    return TrainingEvaluator(cfg.eval, eval_prompts, policy.tokenizer, cfg.data.prefill,
                             evaluated_through=evaluated_through_at_start(cfg.eval, served),
                             checks=checks_of(cfg.rewards), episodes=policy.episodes, call=policy.sandbox)


def evaluate_to_the_end(cfg: Config, evaluator: TrainingEvaluator, watcher, engine, run_dir) -> None:
    """After the last step, once the trainer has written its last row: the marks no step served (the
    trainer published them after the sampler's last step), then the final weights; each row
    appended after the trainer's."""
    last = cfg.training.steps - cfg.training.steps % cfg.weights.publish_every  # the last version published
    while evaluator.next_mark < last:
        wait_for_version(watcher, evaluator.next_mark, cfg.sampling.wait_timeout_s, prefer=evaluator.next_mark)
        if engine.version >= last:
            break
        append_metrics_row(run_dir, evaluator.run(engine, engine.version), cfg.logging, cfg.run.name)
    wait_for_version(watcher, last, cfg.sampling.wait_timeout_s)
    append_metrics_row(run_dir, evaluator.run(engine, engine.version), cfg.logging, cfg.run.name)


def weight_stagers(policy: SamplerModels) -> list:
    """An engine that generates with the scoring model itself (HF) loads each version once; an engine
    with its own copy of the weights (vLLM) takes each version together with the scoring model
    (recomputed and reference log-probs), or neither does (grpo.weights.folder.WeightWatcher)."""
    if policy.engine.generates_with_scoring_model:
        return [policy.engine.stage_weights]
    return [stager_for_model(policy.model), policy.engine.stage_weights]


def entry(argv: list[str] | None = None) -> None:
    """The sampler process, as `python sampling_worker.py` and the launcher start it."""
    user_code_importable()
    sys.exit(exit_code(main, sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    entry()
