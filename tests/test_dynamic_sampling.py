"""Dynamic sampling (grpo/sampler/dynamic_sampling.py): rounds drawn until groups differ, the cap, and
the seeds and prompt positions of each round, through the engine interface (tests/engine_helpers.py)."""

import hashlib

import torch
from engine_helpers import config, dynamic_batch, numbered_prompts

from grpo.data.cursor import PromptCursor
from grpo.sampler.batches import step_seed
from grpo.sampler.dynamic_sampling import ROUND_SEED_STRIDE, round_seed
from grpo.sampler.rollout import SEED_BLOCK, prompt_seeds
from grpo.trainer.advantage_check import check_advantages


def test_dynamic_sampling_keeps_groups_with_differing_rewards_drawing_more_rounds():
    rounds = [numbered_prompts(10, 11), numbered_prompts(13, 15), numbered_prompts(17, 19)]
    cfg, engine, batch = dynamic_batch(rounds)
    # round 0: 10 is flat, 11 differs; round 1: 13 differs -> two informative groups (15, which
    # differs too, is not needed), no third round
    assert batch.meta["sample_ids"] == ["train-11", "train-13"] and [p[-1].item() for p in batch.prompt_ids] == [11, 13]
    base = cfg.seed * 1_000_003 + 4
    assert engine.seeds == [base, base + ROUND_SEED_STRIDE]
    assert batch.rewards[:, 0].tolist() == [1.0, -1.0, 1.0, -1.0]  # "7" right, "8" wrong, per group
    assert batch.advantages.abs().min() > 0
    check_advantages(batch, cfg)  # the trainer recomputes the kept groups' advantages from their rewards
    m = batch.meta["metrics"]
    assert (m["sampling/dynamic_rounds"], m["sampling/dynamic_dropped_fraction"], m["sampling/dynamic_cap_hit"]) == \
        (2.0, 0.5, 0.0)  # 4 groups generated, 2 trained
    assert m["sampling/zero_spread_fraction"] == 0.25  # only 10 was flat
    assert m["sampling/generated_tokens"] == 16.0  # 2 rounds x 2 prompts x G 2 x 2 tokens


def test_dynamic_sampling_at_its_cap_fills_with_dropped_groups_and_says_so():
    rounds = [numbered_prompts(10, 12), numbered_prompts(14, 15), numbered_prompts(16, 18)]
    cfg, engine, batch = dynamic_batch(rounds)
    check_advantages(batch, cfg)
    assert batch.meta["sample_ids"] == ["train-10", "train-15"]  # the one informative group, then the first dropped
    assert len(engine.seeds) == 3 and batch.advantages[:2].tolist() == [0.0, 0.0]
    m = batch.meta["metrics"]
    assert (m["sampling/dynamic_rounds"], m["sampling/dynamic_cap_hit"]) == (3.0, 1.0)
    assert m["sampling/dynamic_dropped_fraction"] == 4 / 6  # 6 groups generated, 2 trained
    assert m["sampling/zero_spread_fraction"] == 5 / 6  # all but 15


def test_without_dynamic_sampling_one_round_and_the_step_seed():
    rounds = [numbered_prompts(10, 12), numbered_prompts(14, 15)]
    cfg, engine, batch = dynamic_batch(rounds, "sampling.dynamic_sampling=false")
    assert batch.meta["sample_ids"] == ["train-10", "train-12"] and engine.seeds == [cfg.seed * 1_000_003 + 4]
    assert "sampling/dynamic_rounds" not in batch.meta["metrics"]


def test_round_positions_depend_on_the_global_step_alone_so_a_resume_draws_the_same_prompts():
    """Step g owns stream positions [g*B*R, (g+1)*B*R): a sampler that restarts at step 3 (a new
    cursor restored from the saved state) draws exactly what the uninterrupted one drew."""
    from grpo.sampler.sampling_step import round_prompts

    cfg = config("sampling.dynamic_sampling=true", "sampling.dynamic_sampling_max_rounds=3")
    prompts = numbered_prompts(*range(100, 125))  # 25: the stream crosses into epoch 1 at step 4
    cursor = PromptCursor(len(prompts), cfg.seed)
    drawn = {(g, r): round_prompts(cfg.sampling, cursor, prompts, g)(r) for g in range(6) for r in (0, 2, 1)}
    stream = [i for epoch in range(3) for i in torch.randperm(25, generator=torch.Generator().manual_seed(
        cfg.seed * 1_000_003 + epoch)).tolist()]
    for (g, r), chosen in drawn.items():
        assert [p.problem.id for p in chosen] == [prompts[i].problem.id for i in stream[(g * 3 + r) * 2:][:2]]
    restored = PromptCursor(len(prompts), cfg.seed)
    restored.load_state_dict(cursor.state_dict())
    assert all(round_prompts(cfg.sampling, restored, prompts, g)(r) == drawn[g, r] for g in (3, 5) for r in range(3))


def test_every_prompt_of_every_step_gets_its_own_block_of_seeds():
    """vLLM seeds sample j of a request with seed + j: each prompt's seed starts a block of
    SEED_BLOCK seeds that no other prompt of any step or round of a run reaches."""
    cfg = config()
    calls = [round_seed(step_seed(cfg, g), r) for g in range(500) for r in range(3)]
    seeds = [s for call in calls for s in prompt_seeds(call, 16)]
    assert len({s // SEED_BLOCK for s in seeds}) == len(seeds) == 500 * 3 * 16
    assert all(s % SEED_BLOCK == 0 and 0 <= s < 2**63 for s in seeds)
    assert prompt_seeds(calls[0], 16) == prompt_seeds(calls[0], 16)  # a re-run draws the same
    digest = hashlib.sha256(b"7/1").digest()  # worked value: the hash of "seed/index", 63 bits, rounded down
    assert prompt_seeds(7, 2)[1] == (int.from_bytes(digest[:8], "big") >> 1) // SEED_BLOCK * SEED_BLOCK


def test_kept_groups_of_rounds_with_and_without_new_rows_keep_every_samples_rows():
    """A round whose sessions all stayed in one row carries no segments: kept beside a round with new rows, its
    samples are all in row 0, never read as one row the other round's way (or theirs as one row)."""
    from types import SimpleNamespace

    from grpo.sampler.batches import kept_segments

    def round_of(segments, lengths):
        return SimpleNamespace(rollouts=SimpleNamespace(
            segments=segments, completion_ids=[torch.zeros(n, dtype=torch.long) for n in lengths]))

    split = round_of([torch.tensor([0, 1, 1], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32)], [3, 2])
    whole = round_of(None, [4, 1])
    kept = kept_segments([split, whole], [(whole, 0), (split, 0), (whole, 1), (split, 1)])
    assert [k.tolist() for k in kept] == [[0, 0, 0, 0], [0, 1, 1], [0], [0, 0]]
    assert all(k.dtype == torch.int32 for k in kept)
    assert kept_segments([whole, whole], [(whole, 0)]) is None
