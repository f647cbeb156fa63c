"""The asynchronous machinery adds no error: the real sampler(s) and trainer (two trainer ranks) at
`sampling.max_staleness: 0` publish, step after step, the weights that a synchronous loop in one
process computes from the same seeds and prompts (same sampled tokens, same update: the whole
batch as one loss, clipped, AdamW), with no transport, spool, sharding, DeepSpeed or hot-swap.
Two samplers make the same batches as one (global step g by sampler g % 2), so the same holds."""

import dataclasses
import json

import pytest
import torch
from peft import get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file
from test_launch import launch

from grpo.config import load_config
from grpo.data.cursor import PromptCursor
from grpo.data.problems import load_problems
from grpo.data.prompts import build_prompts
from grpo.model.loading import load_policy, load_tokenizer
from grpo.sampler.batches import SamplerModels, make_batch
from grpo.sampler.rollout.hf_engine import HFEngine
from grpo.trainer.training_step import micro_batch_loss
from grpo.weights.folder import version_dir

STEPS = 3


def adapter(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def synchronous_run(cfg) -> tuple[list[dict[str, torch.Tensor]], list[tuple[float, float]]]:
    """Generate with the current weights, score, update; the adapter before and after each step,
    and each step's mean reward and mean completion length."""
    torch.manual_seed(cfg.seed)  # as the trainer does before building its model (the LoRA init)
    model = load_policy(cfg).train()
    tokenizer = load_tokenizer(cfg.model)
    prompts, _ = build_prompts(tokenizer, cfg.data, load_problems(cfg.data.path, cfg.data.split)[0])
    cursor = PromptCursor(len(prompts), cfg.seed)
    policy = SamplerModels.of(cfg, HFEngine(model, tokenizer, cfg.sampling), model, None, tokenizer, {})
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.training.learning_rate, weight_decay=cfg.training.weight_decay)
    adapters, rewards = [adapter(model)], []
    for step in range(STEPS):
        chosen = [prompts[i] for i in cursor.take(cfg.sampling.prompts_per_step)]
        batch = make_batch(cfg, policy, chosen, step, {}, measure_logp_gap=False)
        loss, _, _ = micro_batch_loss(model, batch, cfg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.training.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        adapters.append(adapter(model))
        rewards.append((batch.meta["metrics"]["reward"], batch.meta["metrics"]["completions/mean_length"]))
    return adapters, rewards


@pytest.mark.parametrize("samplers", [1, 2])
def test_the_processes_at_staleness_zero_publish_what_one_synchronous_loop_computes(tmp_path, digit_model_dir,
                                                                                   tiny_gsm8k, samplers):
    proc = launch(tmp_path, digit_model_dir, tiny_gsm8k, f"training.steps={STEPS}", "sampling.max_staleness=0",
                  "sampling.group_size=8", "training.learning_rate=1e-3", "launch.trainer_ranks=2",
                  f"weights.keep_last={STEPS}", f"sampling.num_workers={samplers}")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness"] for r in rows] == [0] * STEPS
    assert [(r["sampler/index"], r["sampler_step"]) for r in rows] == [(g % samplers, g // samplers)
                                                                       for g in range(STEPS)]

    cfg = load_config(tmp_path / "config.yaml")
    adapters, outcomes = synchronous_run(dataclasses.replace(
        cfg, sampling=dataclasses.replace(cfg.sampling, num_workers=1)))
    # the same tokens were sampled (and the same update made from them: the adapters below)
    assert [(r["reward"], r["completions/mean_length"]) for r in rows] == outcomes
    difference = 0.0
    for step in range(1, STEPS + 1):
        published = load_file(version_dir(tmp_path / "weights", step) / "adapter_model.safetensors")
        assert published.keys() == adapters[step].keys()
        difference = max(difference, *((published[k] - v).abs().max().item() for k, v in adapters[step].items()))
    moved = max((adapters[-1][k] - v).abs().max().item() for k, v in adapters[0].items())
    # the updates are over 1000x the difference: float32 sums in another order over two ranks (~1e-6
    # absolute on these batches), not a lost or doubled step, which would be of the update's own size
    assert moved > 1e-3 and difference < moved / 1000, (difference, moved)


def test_a_step_started_by_the_step_before_is_the_batch_its_weights_make_alone(tmp_path, chatty_model_dir,
                                                                             tiny_gsm8k):
    """At max_staleness 2 a step may be generated with the weights its predecessor used: the sampler starts
    its completions in the rows the predecessor's leave free (sampling/started_ahead_fraction) and keeps
    those weights for it. Each step's batch is still what its recorded weights version makes from its
    prompts and seed in one synchronous call: the same mean reward and completion length."""
    steps = 5
    proc = launch(tmp_path, chatty_model_dir, tiny_gsm8k, f"training.steps={steps}", "sampling.max_staleness=2",
                  "sampling.group_size=8", "sampling.generation_batch_size=8", "sampling.max_new_tokens=16",
                  "training.learning_rate=1e-3", f"weights.keep_last={steps}")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["staleness"] <= 2 for r in rows)
    assert any(r.get("sampler/started_ahead_fraction", 0) > 0 for r in rows), [r.get("policy_version") for r in rows]

    cfg = load_config(tmp_path / "config.yaml")
    torch.manual_seed(cfg.seed)  # the LoRA init of version 0, as the trainer's
    model = load_policy(cfg).eval()
    initial = adapter(model)
    tokenizer = load_tokenizer(cfg.model)
    prompts, _ = build_prompts(tokenizer, cfg.data, load_problems(cfg.data.path, cfg.data.split)[0])
    cursor = PromptCursor(len(prompts), cfg.seed)
    policy = SamplerModels.of(cfg, HFEngine(model, tokenizer, cfg.sampling), model, None, tokenizer, {})
    for step, row in enumerate(rows):
        version = int(row["policy_version"])
        weights = initial if version == 0 else load_file(version_dir(tmp_path / "weights", version)
                                                         / "adapter_model.safetensors")
        set_peft_model_state_dict(model, weights)
        chosen = [prompts[i] for i in cursor.take(cfg.sampling.prompts_per_step)]
        batch = make_batch(cfg, policy, chosen, step, {}, measure_logp_gap=False)
        metrics = batch.meta["metrics"]
        assert ((metrics["reward"], metrics["completions/mean_length"])
                == (row["reward"], row["completions/mean_length"]))


def test_a_run_loading_weights_between_decode_steps_trains_batches_whose_every_token_is_within_the_bound(
        tmp_path, chatty_model_dir, tiny_gsm8k):
    """sampling.in_flight_updates at max_staleness 2: the sampler loads each version as it is published,
    mid-step too. Every trained batch's oldest token is its policy_version, within the bound (per-token
    staleness max = staleness <= 2), and its tokens' versions are versions the trainer published."""
    steps = 5
    proc = launch(tmp_path, chatty_model_dir, tiny_gsm8k, f"training.steps={steps}", "sampling.max_staleness=2",
                  "sampling.in_flight_updates=true", "sampling.group_size=8", "sampling.generation_batch_size=4",
                  "sampling.max_new_tokens=48", "training.learning_rate=1e-3", f"weights.keep_last={steps}")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    published = {int(p.name[1:]) for p in (tmp_path / "weights").glob("v*")} | {0}
    for row in rows:
        assert row["staleness/token_max"] == row["staleness"] <= 2
        assert 0 <= row["staleness/token_mean"] <= row["staleness/token_max"] and row["policy_version"] in published
        assert (row["staleness/multi_version_fraction"] > 0) <= (row.get("sampler/in_flight_loads", 0) > 0)
    print("in-flight loads per step:", [r.get("sampler/in_flight_loads", 0) for r in rows],
          "spanning:", [r["staleness/multi_version_fraction"] for r in rows])
