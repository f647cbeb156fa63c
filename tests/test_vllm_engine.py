"""The vLLM engine, real, on the embedded SmolLM2 (the CPU build here; `make test-vllm` after
`make install-vllm`, a separate CI step). Without vLLM: the error that says how to install it."""

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from grpo.config import load_config
from grpo.data.problems import load_problems
from grpo.data.prompts import build_prompts
from grpo.model.loading import add_lora, load_model, load_tokenizer
from grpo.model.logprobs import completion_logprobs
from grpo.sampler.batches import SamplerModels, make_batch
from grpo.sampler.rollout import make_engine, prompt_seeds
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.sampler.rollout.vllm_arguments import VllmUnavailable, cpu_threads_environment, engine_arguments
from grpo.weights.folder import WeightWatcher, publish, stager_for_model, verify, version_dir

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (make install-vllm)")
# the largest |vLLM's recorded log-prob - the trainer's fp32 shared-prefix recompute| seen here:
# 4.9e-5 over 988 tokens, kept with headroom for other CPUs' kernels
LOGP_BOUND = 5e-4


def vllm_config(*overrides):
    return load_config(None, ["sampling.engine=vllm", "sampling.max_new_tokens=24", "lora.r=8",
                              "sampling.vllm.kv_cache_gb=1", "data.few_shot=0", *overrides])


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_selecting_vllm_without_it_says_how_to_install(tiny_model_dir):
    tokenizer = load_tokenizer(load_config(None, [f"model.name_or_path={tiny_model_dir}"]).model)
    with pytest.raises(VllmUnavailable, match="sampling.engine=vllm needs vLLM: make install-vllm"):
        make_engine(load_config(None, ["sampling.engine=vllm"]), model=None, tokenizer=tokenizer)


def test_engine_arguments_fit_the_machine_and_refuse_what_the_trainer_cannot_match():
    args = engine_arguments(vllm_config(), cuda=False, available_bytes=16 * 2**30)
    assert (args["kv_cache_memory_bytes"], args["max_lora_rank"], args["generation_config"]) == (2**30, 8, "vllm")
    assert args["logprobs_mode"] == "processed_logprobs" and args["max_model_len"] == 512 + 24
    assert (args["enable_chunked_prefill"], args["max_num_batched_tokens"]) == (False, 4096)  # the CPU build
    assert "enable_chunked_prefill" not in engine_arguments(vllm_config(), cuda=True, available_bytes=0)
    assert engine_arguments(vllm_config("lora.r=4"), cuda=True, available_bytes=0)["gpu_memory_utilization"] == 0.5
    assert engine_arguments(vllm_config("lora.r=4"), cuda=True, available_bytes=0)["max_lora_rank"] == 8
    with pytest.raises(VllmUnavailable, match=r"sampling.vllm.kv_cache_gb=1 is more than half the memory available "
                                              r"\(1.5 GiB\): lower it"):
        engine_arguments(vllm_config(), cuda=False, available_bytes=int(1.5 * 2**30))
    with pytest.raises(VllmUnavailable, match="the distribution top_k made, the trainer computes them over the full "
                                              r"softmax\(logits / T\): use sampling.old_logps=recompute"):
        engine_arguments(vllm_config("sampling.top_k=20"), cuda=False, available_bytes=16 * 2**30)
    assert "max_lora_rank" not in engine_arguments(vllm_config("lora.enabled=false", "training.reference_on=sampler"),
                                                   False, 16 * 2**30)


@pytest.fixture(scope="module")
def served():
    """One vLLM engine for the module (it takes ~30 s to start), the sampler's scoring model with
    the adapter, the tokenizer, and two GSM8K chat prompts."""
    cfg = vllm_config()
    tokenizer = load_tokenizer(cfg.model)
    torch.manual_seed(cfg.seed)
    model = add_lora(load_model(cfg.model), cfg.lora).eval()
    prompts, _ = build_prompts(tokenizer, cfg.data, load_problems(cfg.data.path, "train")[0][:2])
    engine = make_engine(cfg, model, tokenizer)
    yield cfg, model, tokenizer, engine, [p.token_ids for p in prompts]
    engine.close()


def trained_adapter(cfg, seed):
    model = add_lora(load_model(cfg.model), cfg.lora)
    torch.manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


@needs_vllm
def test_rollouts_are_prompt_major_repeatable_under_a_seed_and_keep_eos(served):
    cfg, model, tokenizer, engine, prompts = served
    first, again, other = (engine.generate(prompts, 4, seed=s) for s in (7, 7, 8))
    assert len(first.completion_ids) == len(first.logps) == len(first.truncated) == 8
    assert all(torch.equal(a, b) for a, b in zip(first.completion_ids, again.completion_ids))
    # the same tokens; their log-probs within the engine's kernel tolerance, not bit for bit: the
    # repeat reads the prompt's KV from the prefix cache, computed by another kernel path (CI saw >1e-5)
    gaps = torch.cat([(a - b).abs() for a, b in zip(first.logps, again.logps)])
    print(f"repeat under one seed: log-prob gap max {gaps.max():.2e}")
    assert gaps.max() < LOGP_BOUND
    assert any(not torch.equal(a, b) for a, b in zip(first.completion_ids, other.completion_ids))
    for ids, logps, cut in zip(first.completion_ids, first.logps, first.truncated):
        assert len(ids) == len(logps) <= cfg.sampling.max_new_tokens and logps.dtype == torch.float32
        assert cut == (int(ids[-1]) != tokenizer.eos_token_id)  # stopped: the EOS is the kept last token
        assert len(ids) == cfg.sampling.max_new_tokens or not cut


@needs_vllm
def test_seeded_prompts_longer_than_a_steps_token_budget_together_are_each_what_it_draws_alone(served):
    """12 prompts of 500 tokens, 2 samples each: 12 000 prompt tokens, three times the CPU build's
    token budget per engine step. Each prompt is prefilled whole in some step (a prompt split across
    steps would make the CPU build rewind its seeded generator, which kills the engine), and each
    sample is what its request draws alone."""
    cfg, model, tokenizer, engine, prompts = served
    long = [(prompts[i % 2] * 8)[7 * i:7 * i + 500] for i in range(12)]  # no two alike: no prefix-cache hits
    together = engine.generate(long, 2, seed=21)
    firsts = prompt_seeds(21, 12)
    for j in (0, 7, 23):
        alone, logps, _ = engine.complete(long[j // 2], firsts[j // 2] + j % 2, cfg.sampling.max_new_tokens)
        assert alone.tolist() == together.completion_ids[j].tolist()
        assert (logps - together.logps[j]).abs().max() < LOGP_BOUND


@needs_vllm
def test_a_stop_string_ends_each_vllm_completion_at_the_token_that_completes_it(served):
    """As on the HF engine (tests/test_generation_settings.py): the same seeds with sampling.stop give
    each completion up to the first token after which its text holds the string, not truncated."""
    cfg, model, tokenizer, engine, prompts = served
    free = engine.generate(prompts, 2, seed=11)
    stop = tokenizer.decode(free.completion_ids[0][6:8])
    cfg.sampling.stop = [stop]  # read by each request
    try:
        stopped = engine.generate(prompts, 2, seed=11)
    finally:
        cfg.sampling.stop = []
    for whole, cut, truncated in zip(free.completion_ids, stopped.completion_ids, stopped.truncated):
        ends = [j + 1 for j in range(len(whole)) if stop in tokenizer.decode(whole[:j + 1])]
        assert cut.tolist() == whole[:ends[0] if ends else len(whole)].tolist()
        assert not truncated if ends else truncated == (len(whole) == cfg.sampling.max_new_tokens)
    assert stop in tokenizer.decode(stopped.completion_ids[0])


@needs_vllm
def test_vllm_draws_with_the_repetition_penalty_and_min_p(served):
    """sampling.repetition_penalty=5 and min_p on vLLM (with sampling.old_logps=recompute): the same
    seeds draw fewer repeated tokens than without."""
    cfg, model, tokenizer, engine, prompts = served

    def repeats(rollouts) -> int:
        return sum(len(ids) - len(set(ids.tolist())) for ids in rollouts.completion_ids)

    free = engine.generate(prompts, 4, seed=13)
    cfg.sampling.repetition_penalty, cfg.sampling.min_p = 5.0, 0.05
    try:
        penalised = engine.generate(prompts, 4, seed=13)
    finally:
        cfg.sampling.repetition_penalty, cfg.sampling.min_p = 1.0, 0.0
    print(f"repeated tokens: {repeats(free)} without the penalty, {repeats(penalised)} with it")
    assert repeats(penalised) < repeats(free)


@needs_vllm
def test_recorded_logps_are_the_trainers_tempered_logps(served):
    cfg, model, tokenizer, engine, prompts = served
    rollouts = engine.generate(prompts, 4, seed=3)
    with torch.no_grad():
        ours = completion_logprobs(model, [torch.tensor(p) for p in prompts], rollouts.completion_ids, [4, 4],
                                   temperature=cfg.sampling.temperature)
    gaps = torch.cat([(a - b).abs() for a, b in zip(rollouts.logps, ours)])
    print(f"vLLM vs shared-prefix recompute over {len(gaps)} tokens: mean {gaps.mean():.2e}, max {gaps.max():.2e}")
    assert gaps.max() < LOGP_BOUND


def chat_prompts(tokenizer):
    from grpo.data.problems import Problem
    from grpo.data.prompts import Prompt

    questions = ("Say hello in one word.", "Name one colour.")
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    return [Prompt(Problem(f"p{i}", q, "x"), tokenizer(t, add_special_tokens=False)["input_ids"])
            for i, (q, t) in enumerate(zip(questions, texts))]


def runs_of(mask: torch.Tensor) -> list[tuple[bool, int, int]]:
    """(model's, start, end) of each stretch of an episode's mask, in order."""
    runs, start = [], 0
    for k in range(1, len(mask) + 1):
        if k == len(mask) or mask[k] != mask[start]:
            runs.append((bool(mask[start]), start, k))
            start = k
    return runs


@needs_vllm
@pytest.mark.parametrize("continued", [True, False], ids=["one-task-per-episode", "turn-by-turn"])
def test_episodes_on_vllm_record_the_trainers_log_probs_of_every_model_turn(served, continued):
    """Multi-turn episodes with a scripted environment, each episode a task of the async engine (or turn
    by turn, with continuous batching off): every model turn's recorded log-probs match the trainer's
    shared-prefix recompute of the whole episode within the single-turn bound, and the environment's
    tokens sit exactly where the mask says."""
    from conftest import REPO

    from grpo.environments.pool import EnvironmentPool
    from grpo.sampler.episodes import EpisodeRunner

    cfg, model, tokenizer, engine, _ = served
    prompts = chat_prompts(tokenizer)
    pool = EnvironmentPool(f"{REPO}/tests/scripted_envs.py:Scripted", {"length": 3}, 10.0)
    try:
        runner = EpisodeRunner(pool, tokenizer, 96, 4, continued=continued)
        run = runner.run(engine, prompts, 3, seed=5)
    finally:
        pool.close()
    assert any(e.turns >= 2 for e in run.episodes), [e.turns for e in run.episodes]
    for e, ids, mask in zip(run.episodes, run.rollouts.completion_ids, run.rollouts.model_masks):
        shown = [runner.reply_tokens(f"reply {k + 1} to {m[:3]!r}", "user") for k, m in enumerate(e.messages)]
        segments = [ids[a:b].tolist() for model_s, a, b in runs_of(mask) if not model_s]  # the environment's
        assert len(segments) <= len(shown)
        for segment, reply in zip(segments, shown):  # only the last one may be cut, at the token budget
            assert segment == reply[:len(segment)] and (len(segment) == len(reply) or e.truncated)
    with torch.no_grad():
        recomputed = completion_logprobs(model, [torch.tensor(p.token_ids) for p in prompts],
                                         run.rollouts.completion_ids,
                                         [3, 3], temperature=cfg.sampling.temperature)
    gap = max((a - b)[m].abs().max().item()
              for a, b, m in zip(run.rollouts.logps, recomputed, run.rollouts.model_masks))
    print(f"vLLM episodes: largest model-token log-prob gap {gap:.2e} over "
          f"{sum(int(m.sum()) for m in run.rollouts.model_masks)} tokens, turns {[e.turns for e in run.episodes]}")
    assert gap < LOGP_BOUND


@needs_vllm
def test_agent_sessions_on_vllm_record_the_trainers_log_probs_of_every_turn_the_sdk_received(served):
    """Your own agent loop (grpo/agent/runner.py) on vLLM: a two-turn openai-SDK harness, each turn a request
    of the async engine; the row is the first request's render, then every turn as sampled, the harness's
    messages between them masked; the recorded log-probs are the trainer's recompute within the bound. The second
    request's max_tokens=4 caps its answer (cut there: "length"); the first's stop="." ends it at the token that
    completes a "." (its text returned without it). The third request edits the model's second answer: that turn is
    sampled in a new row, from the prompt and the edited conversation's render alone."""
    import openai

    from grpo.agent.runner import AgentRunner

    cfg, model, tokenizer, engine, _ = served
    prompts = chat_prompts(tokenizer)
    first, second = [], []

    def agent(row, base_url, key):
        api = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
        messages = [{"role": "user", "content": row["question"]}]
        for k in range(3):
            try:
                reply = api.chat.completions.create(model="policy", messages=messages,
                                                    **({"max_tokens": 4} if k else {"stop": "."}))
            except openai.BadRequestError:  # the edited conversation no longer fits the session's budget
                break
            if k == 1:
                second.append((reply.choices[0].finish_reason, reply.usage.completion_tokens))
            elif k == 0:
                first.append(reply.choices[0].message.content or "")
            if k == 2 or (reply.choices[0].finish_reason == "length" and k == 0):
                break
            answer = reply.choices[0].message.model_dump(exclude_none=True)
            messages += [{**answer, "content": "Edited."} if k else answer, {"role": "user", "content": "More."}]
        return 1.0

    settings = load_config(None, ["agent.entrypoint=unused:fn", "data.prefill=", "agent.max_turns=3"]).agent
    runner = AgentRunner(settings, tokenizer, 96, 256, "policy", entrypoint=agent)
    try:
        run = runner.run(engine, prompts, 3, seed=5)
    finally:
        runner.close()
    assert [p.token_ids for p in run.prompts] == [p.token_ids for p in prompts]  # the same chat, rendered alike
    assert any(e.turns >= 2 for e in run.episodes) and second
    assert all(n == 4 if reason == "length" else n <= 4 for reason, n in second), second
    assert len(first) == 6 and not any("." in text for text in first), first
    assert all(set(e.breaks) <= {"context_length_exceeded"} and not e.environment_failed for e in run.episodes)
    assert sum(sum(e.continued.values()) for e in run.episodes) == sum(e.turns - 1 for e in run.episodes)
    three = [e for e in run.episodes if e.turns == 3]
    assert three and all(e.new_rows == {"assistant_changed": 1} and len(e.row_starts) == 1 for e in three)
    with torch.no_grad():
        recomputed = completion_logprobs(model, [torch.tensor(p.token_ids) for p in run.prompts],
                                         run.rollouts.completion_ids, [3, 3], temperature=cfg.sampling.temperature,
                                         segments=run.rollouts.segments)
    gap = max((a - b)[m].abs().max().item()
              for a, b, m in zip(run.rollouts.logps, recomputed, run.rollouts.model_masks))
    print(f"vLLM agent sessions: largest model-token log-prob gap {gap:.2e}, turns {[e.turns for e in run.episodes]}")
    assert gap < LOGP_BOUND


@needs_vllm
def test_vllm_episodes_call_a_slow_environment_at_once_and_draw_what_each_draws_alone(served):
    """6 episodes of an environment taking 0.5 s a step, 6 lanes: the calls of different episodes run at
    once while the others decode, and each episode is what its messages draw as requests on their own
    (each message seeded for its episode and turn, from the whole context so far): the same tokens,
    log-probs within the engine's kernel tolerance. The step's metrics say how many waited."""
    from conftest import REPO
    from test_continuous import TimedLanes, most_at_once

    from grpo.environments.lanes import Lanes
    from grpo.environments.pool import EnvironmentPool
    from grpo.sampler.episodes import EpisodeRunner
    from grpo.sampler.rollout import prompt_seeds
    from grpo.sampler.rollout.sequences import episode_seed

    cfg, model, tokenizer, engine, _ = served
    prompts = chat_prompts(tokenizer)
    lanes = TimedLanes(lambda first: EnvironmentPool(f"{REPO}/tests/scripted_envs.py:Slow",
                                                     {"length": 3, "delay": 0.5}, 10.0), 6)
    assert isinstance(lanes, Lanes)
    engine.loop_metrics.take()
    try:
        run = EpisodeRunner(lanes, tokenizer, 96, 4).run(engine, prompts, 3, seed=5)
    finally:
        lanes.close()
    metrics = engine.loop_metrics.take()
    assert most_at_once(lanes.steps) >= 2 and len(lanes.steps) >= 6
    assert metrics["env/waiting_mean"] > 0 and metrics["timing/env_idle_s"] >= 0
    firsts, compared = prompt_seeds(5, 2), 0
    for j, (ids, mask, logps) in enumerate(zip(run.rollouts.completion_ids, run.rollouts.model_masks,
                                               run.rollouts.logps)):
        context, turn = list(prompts[j // 3].token_ids), 0
        for model_s, a, b in runs_of(mask):
            if model_s:
                seed = firsts[j // 3] + j % 3 if turn == 0 else episode_seed(5, j, turn)
                alone, alone_logps, _ = engine.complete(context, seed, 96 - a)
                assert alone.tolist() == ids[a:b].tolist(), (j, turn)
                assert (alone_logps - logps[a:b]).abs().max() < LOGP_BOUND
                turn, compared = turn + 1, compared + 1
            context += ids[a:b].tolist()
    assert compared > 6  # some episodes went on past their first message


@needs_vllm
def test_vllm_starts_the_next_calls_completions_as_this_ones_end_and_they_are_what_it_would_draw(served):
    """`then`: the next call's completions start as this call's end (one for each), with the weights
    served now; the next call finds them all started, and they are what it draws without them. A greedy
    call leaves them; another sampled call aborts them."""
    from grpo.sampler.rollout.sequences import NextCall

    cfg, model, tokenizer, engine, prompts = served
    fresh = engine.generate(prompts[1:], 4, seed=12)
    engine.loop_metrics.take()
    engine.generate(prompts[:1], 4, seed=11, then=NextCall(prompts[1:], 4, 12))
    engine.generate(prompts[:1], 1, greedy=True)  # an evaluation between the two: they stay
    carried = engine.generate(prompts[1:], 4, seed=12)
    assert engine.loop_metrics.take()["sampler/started_ahead_fraction"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(carried.completion_ids, fresh.completion_ids))
    assert max((a - b).abs().max() for a, b in zip(carried.logps, fresh.logps)) < LOGP_BOUND
    engine.generate(prompts[:1], 4, seed=11, then=NextCall(prompts[1:], 4, 12))
    assert engine.carried is not None
    engine.generate(prompts[:1], 4, seed=13)  # not the call announced
    assert engine.carried is None and "sampler/started_ahead_fraction" not in engine.loop_metrics.take()


@needs_vllm
def test_a_sampler_step_takes_old_logps_from_vllm_or_recomputes_them(served):
    """sampling.old_logps=generation sends vLLM's recorded log-probs; recompute the scoring model's."""
    cfg, model, tokenizer, engine, prompts = served
    policy = SamplerModels.of(cfg, engine, model, None, tokenizer, {})
    chosen = build_prompts(tokenizer, cfg.data, load_problems(cfg.data.path, "train")[0][:2])[0]
    batches = {source: make_batch(vllm_config(f"sampling.old_logps={source}", "training.beta=0"), policy, chosen,
                                  step=4, metrics_so_far={}, measure_logp_gap=True)
               for source in ("generation", "recompute")}
    rollouts = engine.generate(prompts, cfg.sampling.group_size, seed=cfg.seed * 1_000_003 + 4)  # the step's seed
    assert all(torch.equal(a, b) for a, b in zip(batches["generation"].completion_ids, rollouts.completion_ids))
    # within the kernel tolerance: the repeat reads the prompts' KV from the prefix cache (see above)
    assert all(torch.allclose(a, b, rtol=0, atol=LOGP_BOUND)
               for a, b in zip(batches["generation"].old_logps, rollouts.logps))
    with torch.no_grad():
        ours = completion_logprobs(model, batches["recompute"].prompt_ids, batches["recompute"].completion_ids,
                                   batches["recompute"].group_sizes, temperature=cfg.sampling.temperature,
                                   shared_prefix=cfg.training.shared_prefix)
    assert all(torch.equal(a, b) for a, b in zip(batches["recompute"].old_logps, ours))
    assert batches["generation"].meta["metrics"]["sampler/engine_logp_gap_max"] < LOGP_BOUND


@needs_vllm
def test_a_published_adapter_is_swapped_in_and_a_bad_one_keeps_the_old_serving(served, tmp_path):
    """v1 changes greedy outputs to exactly the HF engine's with the same adapter, and aborts the next
    call's completions started with the weights before; a corrupted v2 is refused before the engine sees
    it; an adapter vLLM cannot load leaves v1 serving."""
    from grpo.sampler.rollout.sequences import NextCall

    cfg, model, tokenizer, engine, prompts = served
    base = engine.generate(prompts, 1, greedy=True).completion_ids
    engine.generate(prompts[:1], 2, seed=1, then=NextCall(prompts[1:], 2, 2))
    assert engine.carried is not None
    publish(trained_adapter(cfg, seed=1), tmp_path, version=1, step=1)
    watcher = WeightWatcher(tmp_path, [stager_for_model(model), engine.stage_weights])
    assert (watcher.poll().loaded
            and (engine.version, engine.weights_digest) == (1, verify(version_dir(tmp_path, 1))["digest"]))
    assert engine.carried is None
    swapped = engine.generate(prompts, 1, greedy=True).completion_ids
    hf = HFEngine(model, tokenizer, cfg.sampling).generate(prompts, 1, greedy=True).completion_ids
    assert [t.tolist() for t in swapped] == [t.tolist() for t in hf]
    assert [t.tolist() for t in swapped] != [t.tolist() for t in base]

    v2 = publish(trained_adapter(cfg, seed=2), tmp_path, version=2, step=2)
    with open(v2 / "adapter_model.safetensors", "r+b") as f:
        f.seek(-8, 2)
        f.write(b"\x00" * 8)
    assert not watcher.poll().loaded and engine.version == 1

    bad = tmp_path / "wider"  # passes its checksums, but rank 64 is above the engine's max_lora_rank
    publish(add_lora(load_model(cfg.model), load_config(None, ["lora.r=64"]).lora), bad, version=3, step=3)
    with pytest.raises(Exception):
        engine.load_weights(version_dir(bad, 3), verify(version_dir(bad, 3)), 3)
    assert engine.version == 1
    assert ([t.tolist() for t in engine.generate(prompts, 1, greedy=True).completion_ids]
            == [t.tolist() for t in swapped])


@needs_vllm
def test_in_flight_live_requests_move_to_a_new_adapter_and_each_token_is_its_versions(served, tmp_path):
    """sampling.in_flight_updates on vLLM: a version published while a call decodes is loaded mid-way, and
    each live request is made again from its tokens so far with the new adapter. Completions span both
    versions, each token's recorded log-prob is its token's under its own version given its whole prefix
    (the trainer's recompute with that version's adapter), the adapter before is removed once no request
    uses it, and the call counts the load and the moved requests."""
    import time

    cfg, model, tokenizer, engine, prompts = served
    old, new = trained_adapter(cfg, seed=21), trained_adapter(cfg, seed=22)
    watcher = WeightWatcher(tmp_path, [engine.stage_weights])
    publish(old, tmp_path, version=1, step=1)
    assert watcher.poll().loaded
    started = time.monotonic()

    def poll() -> bool:  # v2 is published 1 s into the call (its 2 x 4 x 96 tokens take seconds here)
        if watcher.version == 1 and time.monotonic() - started > 1.0:
            publish(new, tmp_path, version=2, step=2)
        result = watcher.poll()
        return result is not None and result.loaded
    engine.poll_weights = poll
    try:
        engine.loop_metrics.take()
        rollouts = engine.generate(prompts, 4, seed=31, max_new_tokens=[96, 96])
    finally:
        engine.poll_weights = None
    metrics = engine.loop_metrics.take()
    assert engine.version == 2 and metrics["sampler/in_flight_loads"] == 1
    assert set(engine.adapters()) == {engine.lora_request.lora_int_id}  # v1's removed
    versions = rollouts.token_versions
    spanning = [j for j, v in enumerate(versions) if set(v.tolist()) == {1, 2}]
    assert spanning and metrics["sampler/in_flight_resumed"] >= len(spanning)
    assert all(bool((v[1:] >= v[:-1]).all()) for v in versions)  # a sequence moves forward only
    with torch.no_grad():
        under = {version: completion_logprobs(m, [torch.tensor(p) for p in prompts], rollouts.completion_ids,
                                              [4, 4], temperature=cfg.sampling.temperature)
                 for version, m in ((1, old), (2, new))}
    gaps = torch.cat([(logps - torch.where(v == 1, under[1][j], under[2][j])).abs()
                      for j, (logps, v) in enumerate(zip(rollouts.logps, versions))])
    print(f"{len(spanning)} of 8 completions span v1 and v2, {int(metrics['sampler/in_flight_resumed'])} requests "
          f"moved; recorded vs recompute under each token's version: max {gaps.max():.2e}")
    assert gaps.max() < LOGP_BOUND, gaps.max()
    # and the moved tokens are not what the old adapter gives them: the check above tells the versions apart
    moved = torch.cat([(under[1][j] - under[2][j])[versions[j] == 2].abs() for j in spanning])
    assert moved.max() > 100 * LOGP_BOUND


@needs_vllm
def test_in_flight_the_next_steps_completions_move_to_a_newer_adapter_and_a_step_back_drops_them(served, tmp_path):
    """With in-flight updates, the completions started for the next step follow a newer adapter loaded
    between steps (the next step finds them all started, their tokens v1's or v2's); a version that moves back (a
    trainer resumed from an older checkpoint) drops them: their versions no longer name those weights."""
    from grpo.sampler.rollout.sequences import NextCall

    cfg, model, tokenizer, engine, prompts = served
    watcher = WeightWatcher(tmp_path, [engine.stage_weights])
    publish(trained_adapter(cfg, seed=23), tmp_path, version=1, step=1)
    assert watcher.poll().loaded
    engine.poll_weights = lambda: False  # in-flight updates on; nothing new while the calls decode
    try:
        engine.generate(prompts[:1], 2, seed=1, then=NextCall(prompts[1:], 2, 2, [64]))
        publish(trained_adapter(cfg, seed=24), tmp_path, version=2, step=2)
        assert watcher.poll().loaded and engine.carried is not None  # moved on, not dropped
        engine.loop_metrics.take()
        carried = engine.generate(prompts[1:], 2, seed=2, max_new_tokens=[64])
        assert engine.loop_metrics.take()["sampler/started_ahead_fraction"] == 1.0
        assert all(set(v.tolist()) <= {1, 2} for v in carried.token_versions)  # v2's if they were still decoding
        engine.generate(prompts[:1], 2, seed=3, then=NextCall(prompts[1:], 2, 4, [64]))
        publish(trained_adapter(cfg, seed=25), tmp_path, version=1, step=1)  # LATEST back at v1, other weights
        assert watcher.poll().loaded and engine.version == 1 and engine.carried is None
    finally:
        engine.poll_weights = None


@needs_vllm
def test_each_prompt_and_each_step_draws_its_own_noise(served):
    """vLLM seeds sample j of a request with seed + j. With one seed per call, the same prompt twice
    in a call got the same G samples, and sample j + 1 of seed s was sample j of seed s + 1."""
    cfg, model, tokenizer, engine, prompts = served
    twice = engine.generate([prompts[0], prompts[0]], 4, seed=11).completion_ids
    assert [t.tolist() for t in twice[:4]] != [t.tolist() for t in twice[4:]]
    step, next_step = (engine.generate([prompts[0]], 4, seed=s).completion_ids for s in (11, 12))
    assert [t.tolist() for t in step[1:]] != [t.tolist() for t in next_step[:3]]
    assert [t.tolist() for t in twice[:4]] == [t.tolist() for t in step]  # still a function of the seed


@needs_vllm
def test_a_version_republished_with_other_weights_is_served_with_them(served, tmp_path):
    """A trainer resumed from an older checkpoint republishes v1 with other weights: the engine must
    not serve the prompts' KV cached under the first v1 (names and ids count loads, not versions)."""
    cfg, model, tokenizer, engine, prompts = served
    outputs = []
    for seed in (1, 2):
        trained = trained_adapter(cfg, seed=seed)
        folder = publish(trained, tmp_path / f"run{seed}", version=1, step=1)
        engine.load_weights(folder, verify(folder), 1)
        served_logps = engine.generate(prompts, 2, seed=5)
        with torch.no_grad():
            ours = completion_logprobs(trained.eval(), [torch.tensor(p) for p in prompts], served_logps.completion_ids,
                                       [2, 2], temperature=cfg.sampling.temperature)
        gaps = torch.cat([(a - b).abs() for a, b in zip(served_logps.logps, ours)])
        assert gaps.max() < LOGP_BOUND, (seed, gaps.max())
        outputs.append(served_logps)
    assert any(not torch.allclose(a, b) for a, b in zip(outputs[0].logps, outputs[1].logps))


@needs_vllm
def test_an_adapter_the_scoring_copy_refuses_is_dropped_by_vllm_too(served, tmp_path):
    """vLLM could load it, the scoring model (another rank) cannot: both keep the version they serve."""
    cfg, model, tokenizer, engine, prompts = served
    folder = publish(trained_adapter(cfg, seed=3), tmp_path / "ok", version=1, step=1)
    engine.load_weights(folder, verify(folder), 1)
    serving, before = (engine.version, engine.weights_digest), engine.generate(prompts, 1, greedy=True).completion_ids
    narrow = add_lora(load_model(cfg.model), load_config(None, ["lora.r=4"]).lora)
    publish(trained_adapter(cfg, seed=4), tmp_path / "other", version=2, step=2)
    watcher = WeightWatcher(tmp_path / "other", [engine.stage_weights, stager_for_model(narrow)], initial_version=1)
    assert not watcher.poll().loaded
    assert (engine.version, engine.weights_digest) == serving
    after = engine.generate(prompts, 1, greedy=True).completion_ids
    assert [t.tolist() for t in after] == [t.tolist() for t in before]
    assert len(engine.adapters()) == 1  # the staged adapter was removed again


@needs_vllm
def test_full_weights_are_reloaded_into_the_running_engine(tmp_path):
    cfg = vllm_config("lora.enabled=false", "training.reference_on=sampler")
    tokenizer = load_tokenizer(cfg.model)
    model = load_model(cfg.model).eval()
    prompts, _ = build_prompts(tokenizer, cfg.data, load_problems(cfg.data.path, "train")[0][:2])
    prompts = [p.token_ids for p in prompts]
    engine = make_engine(cfg, model, tokenizer)
    try:
        base = engine.generate(prompts, 1, greedy=True).completion_ids
        torch.manual_seed(0)
        with torch.no_grad():  # every parameter, the input embeddings (tied to the output head) too
            for name, p in model.named_parameters():
                p.add_(torch.randn_like(p) * 0.02 * p.abs().mean())
        publish(model, tmp_path, version=1, step=1)
        assert WeightWatcher(tmp_path, [engine.stage_weights]).poll().loaded and engine.version == 1
        reloaded = engine.generate(prompts, 1, greedy=True).completion_ids
        hf = HFEngine(model, tokenizer, cfg.sampling).generate(prompts, 1, greedy=True).completion_ids
        assert [t.tolist() for t in reloaded] == [t.tolist() for t in hf] != [t.tolist() for t in base]
        # the served distribution is the published one: the recorded log-probs are the trainer's. With
        # the tied head's CPU kernel left from the old embeddings this gap was 0.145
        sampled = engine.generate(prompts, 2, seed=1)
        with torch.no_grad():
            recomputed = completion_logprobs(model, [torch.tensor(p) for p in prompts], sampled.completion_ids,
                                             [2, 2], temperature=cfg.sampling.temperature)
        gap = max((a - b).abs().max().item() for a, b in zip(sampled.logps, recomputed))
        print(f"full weights reloaded: recorded - recomputed log-prob max {gap:.2e}")
        assert gap < LOGP_BOUND
    finally:
        engine.close()


def grpo_check(run_dir, steps, *options):
    """`grpo check` on a finished run folder, as CI and a user run it."""
    check = subprocess.run([sys.executable, "-m", "grpo", "check", str(run_dir), "--steps", str(steps), *options],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr[-3000:]


@needs_vllm
def test_two_step_full_weights_run_of_the_real_processes_with_vllm(tmp_path):
    """The full weights reloaded in place (collective_rpc reload_weights) between the two steps. With a teacher
    that is the starting model: the first step's completions are the teacher's own, and the reverse KL is the
    engine/trainer gap alone; at max_staleness 0 every step's sampler/trainer gap is the engine's alone."""
    from test_launch import launch

    shutil.rmtree(tmp_path, ignore_errors=True)
    proc = launch(tmp_path, "smollm2-135m-instruct", "gsm8k-embedded", "sampling.engine=vllm", "training.steps=2",
                  "sampling.max_new_tokens=24", "lora.enabled=false", "training.reference_on=sampler",
                  "distill.teacher=smollm2-135m-instruct", "sampling.vllm.kv_cache_gb=1", "training.beta=0",
                  "sampling.max_staleness=0")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["staleness"] == 0 and r["sampling/sampling_logp_difference/mean"] < 1e-3 for r in rows), rows
    assert abs(rows[0]["distill/reverse_kl"]) < 1e-3, rows
    grpo_check(tmp_path, 2, "--max-logp-difference", "1e-3")


@needs_vllm
def test_a_lora_vllm_run_with_in_flight_updates_trains_batches_whose_every_token_is_within_the_bound(tmp_path):
    """LoRA adapters swapped in, sampling.in_flight_updates at max_staleness 2: each trained batch's oldest token
    is its policy_version, within the bound, and every version its tokens name is one the trainer published.
    The first step's batch is all the starting policy's, which is also the teacher: its sampler/trainer gap and
    its reverse KL are the engine's alone."""
    from test_launch import launch

    shutil.rmtree(tmp_path, ignore_errors=True)
    proc = launch(tmp_path, "smollm2-135m-instruct", "gsm8k-embedded", "sampling.engine=vllm", "training.steps=4",
                  "sampling.max_new_tokens=48", "lora.r=8", "distill.teacher=smollm2-135m-instruct",
                  "sampling.vllm.kv_cache_gb=1", "training.beta=0", "sampling.max_staleness=2",
                  "sampling.in_flight_updates=true", "weights.keep_last=4")
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-5000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    published = {int(p.name[1:]) for p in (tmp_path / "weights").glob("v*")} | {0}
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["staleness/token_max"] == row["staleness"] <= 2 and row["policy_version"] in published
    assert rows[0]["staleness/token_max"] == 0 and rows[0]["sampling/sampling_logp_difference/mean"] < 1e-3, rows[0]
    assert abs(rows[0]["distill/reverse_kl"]) < 1e-3, rows[0]
    grpo_check(tmp_path, 4)
    print("in-flight loads per step:", [r.get("sampler/in_flight_loads", 0) for r in rows],
          "spanning:", [r["staleness/multi_version_fraction"] for r in rows])


def test_vllm_on_the_cpu_gets_the_samplers_threads_unless_the_user_set_them():
    assert cpu_threads_environment([0, 1, 2, 3], 2, {}) == {"VLLM_CPU_OMP_THREADS_BIND": "0,1",
                                                             "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    assert cpu_threads_environment([5], 4, {})["VLLM_CPU_OMP_THREADS_BIND"] == "5"
    assert cpu_threads_environment([0, 1], 1, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}) == {}


@needs_vllm
def test_vllm_serves_a_merged_export_as_transformers_does(tmp_path):
    """grpo export --merge writes a plain model folder: vLLM (the CPU build here, with the
    engine settings of the sampler) loads it by path, and its greedy tokens equal transformers'
    greedy tokens on the same folder."""
    import os

    import psutil
    import vllm
    from transformers import AutoModelForCausalLM, GenerationConfig
    from vllm.inputs import TokensPrompt

    from grpo.commands.export import export
    from grpo.config import save_config

    cfg = vllm_config(f"run.dir={tmp_path / 'run'}")
    save_config(cfg, tmp_path / "run" / "config.yaml")
    publish(trained_adapter(cfg, seed=1), tmp_path / "run" / "weights", version=1, step=1)
    export(tmp_path / "run", None, tmp_path / "merged", merge=True)

    merged = vllm_config(f"model.name_or_path={tmp_path / 'merged'}", "lora.enabled=false",
                         "training.reference_on=sampler")
    tokenizer = load_tokenizer(merged.model)
    prompts = [p.token_ids for p in build_prompts(tokenizer, cfg.data, load_problems(cfg.data.path, "train")[0][:2])[0]]
    cuda = torch.cuda.is_available()
    if not cuda:  # as VllmEngine does: the sampler's threads
        os.environ.update(cpu_threads_environment(sorted(os.sched_getaffinity(0)), torch.get_num_threads(), os.environ))
    args = engine_arguments(merged, cuda, psutil.virtual_memory().available)
    assert args["model"] == str(tmp_path / "merged") and "enable_lora" not in args
    llm = vllm.LLM(**args)
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[tokenizer.eos_token_id])
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        served = [list(request.outputs[0].token_ids) for request in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    greedy = GenerationConfig(do_sample=False, max_new_tokens=16, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id)  # not the folder's generation_config, as vLLM
    with torch.no_grad():
        hf = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             generation_config=greedy)[0, len(p):].tolist() for p in prompts]
    print(f"merged export, vLLM greedy: {served}")
    assert served == hf


TOOL_CALL_TEXTS = [
    'The answer is 4.',
    'x\n<tool_call>\n{"name": "calculate", "arguments": {"expression": "48 / 2"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> then '
    '<tool_call>{"name": "b", "arguments": {"n": [1, 2]}}</tool_call>',
    '<tool_call>{"name": "a", "arguments": {"s": "é"}}',  # unclosed at the end of the message
    '{"name": "calculate", "parameters": {"expression": "2 + 2"}}',
    '<|python_tag|>{"name": "a", "arguments": {"n": 1}}; {"name": "b", "arguments": {}}',
    'I think {x} is 3',
]


@needs_vllm
@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_our_tool_call_parsers_agree_with_vllms_of_the_same_name(parser):
    """On every text where vLLM's parser finds calls, ours find the same names and arguments; where
    it finds none, ours find none or report a malformed call (which vLLM takes as plain content)."""
    from vllm.tool_parsers import ToolParserManager

    from grpo.environments.tool_calls import PARSERS

    tokenizer = load_tokenizer(load_config(None, []).model)
    tokenizer.add_tokens(["<|python_tag|>"])  # the llama3_json parser looks its start token up
    theirs = ToolParserManager.get_tool_parser(parser)(tokenizer)
    found = 0
    for text in TOOL_CALL_TEXTS:
        expected = theirs.extract_tool_calls(text, request=None)
        ours = PARSERS[parser](text)
        if expected.tools_called:
            found += 1
            assert [(c.name, c.arguments) for c in ours] == \
                [(c.function.name, json.loads(c.function.arguments)) for c in expected.tool_calls], text
        else:
            assert all(c.error is not None for c in ours), text
    assert found >= 2
