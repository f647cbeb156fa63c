"""The sampler's model work on a tiny random model: generation, old and reference log-probs."""

import pytest
import torch
from conftest import tiny_model

from grpo.config import Config, LoraConfig, SamplingConfig
from grpo.model.completions import cut_at_eos
from grpo.model.loading import add_lora, unwrap_causal_lm
from grpo.model.logprobs import completion_logprobs
from grpo.sampler.rollout.hf_engine import HFEngine, chunk_plan, prompt_blocks


class FakeTokenizer:
    pad_token_id, eos_token_id = 0, 1


PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


def test_chunk_plan_covers_the_group():
    assert chunk_plan(2, 8, 6) == [3, 3, 2]
    assert chunk_plan(2, 8, 64) == [8]
    assert chunk_plan(8, 4, 8) == [1, 1, 1, 1]


@pytest.mark.parametrize("prompts, group_size, limit", [(128, 1, 64), (100, 4, 8), (2, 8, 6), (16, 8, 64), (5, 3, 1)])
def test_no_decode_chunk_has_more_rows_than_generation_batch_size(prompts, group_size, limit):
    """Every block and chunk together: each prompt gets its G completions, no chunk more than the
    limit's rows (a later turn of 16 prompts x G 8 episodes is 128 prompts of one completion)."""
    rows = [len(block) * k for block in prompt_blocks(prompts, limit)
            for k in chunk_plan(len(block), group_size, limit)]
    assert max(rows) <= limit and sum(rows) == prompts * group_size
    assert [i for block in prompt_blocks(prompts, limit) for i in block] == list(range(prompts))


def plain_greedy(model, prompts, group_size, max_new_tokens):
    """Plain generate on each prompt repeated G times, no cache reuse."""
    out = []
    for p in prompts:
        ids = torch.tensor([p] * group_size)
        with torch.no_grad():
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=1, pad_token_id=0)
        out += [row[len(p):] for row in gen]
    return out


def test_prefill_once_greedy_equals_plain_generate_on_repeated_prompts():
    model = tiny_model("llama", vocab_size=101)
    for max_sequences in (64, 4):  # one chunk, and chunked generation reordered to prompt-major
        engine = HFEngine(model, FakeTokenizer(),
                          SamplingConfig(max_new_tokens=12, generation_batch_size=max_sequences))
        rollouts = engine.generate(PROMPTS, 3, greedy=True)
        expected = plain_greedy(model, PROMPTS, 3, 12)
        assert len(rollouts.completion_ids) == 9
        for got, want in zip(rollouts.completion_ids, expected):
            eos = (want == 1).nonzero()
            want = want[: int(eos[0]) + 1] if len(eos) else want
            assert torch.equal(got, want)


def test_sampled_completions_are_prompt_major_and_cut_at_eos():
    model = tiny_model("qwen2", vocab_size=101)
    engine = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=10, generation_batch_size=4,
                                                             temperature=1.5))
    rollouts = engine.generate(PROMPTS, 4, seed=3)
    assert len(rollouts.completion_ids) == 12
    for tokens, truncated in zip(rollouts.completion_ids, rollouts.truncated):
        eos_positions = (tokens == 1).nonzero().flatten().tolist()
        assert eos_positions in ([], [len(tokens) - 1])  # at most one EOS, and last
        assert truncated == (not eos_positions) and (len(tokens) == 10 or not truncated)
    again = engine.generate(PROMPTS, 4, seed=3)  # seeded: reproducible
    assert all(torch.equal(a, b) for a, b in zip(rollouts.completion_ids, again.completion_ids))


def test_the_decode_steps_count_the_rows_still_generating():
    """One batch of 3 prompts x 2 with limits 3, 10 and 6: a row generates at a step until it has drawn
    EOS or reached its limit, so the live rows summed over the steps are the completions' lengths; the
    steps are the longest completion's, and the steps at a full batch (all 6 generating) the shortest's.
    In blocks every step runs all 6 rows; the continuous loop drops ended rows from its steps."""
    model = tiny_model("qwen2", vocab_size=101)
    engine = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=10, generation_batch_size=8,
                                                             temperature=1.5))
    for generate in (engine.generate_in_blocks, engine.generate):
        rollouts = generate(PROMPTS, 2, seed=3, max_new_tokens=[3, 10, 6])
        lengths = [len(tokens) for tokens in rollouts.completion_ids]
        assert max(lengths[:2]) <= 3 and max(lengths[4:]) <= 6
        steps, live = max(lengths), sum(lengths)
        metrics = engine.decode_rows.take()
        assert {key: metrics.pop(key) for key in ("sampler/decode_steps", "sampler/live_rows_per_decode_step",
                                                  "sampler/full_decode_step_fraction")} == {
            "sampler/decode_steps": float(steps), "sampler/live_rows_per_decode_step": live / steps,
            "sampler/full_decode_step_fraction": min(lengths) / steps}
        fraction = metrics.pop("sampler/live_row_fraction")
        if generate == engine.generate_in_blocks:
            assert fraction == live / (6 * steps)
        else:
            assert live / (6 * steps) < fraction <= 1.0
        assert metrics == {"env/waiting_per_decode_step": 0.0, "timing/env_idle_s": 0.0}  # no environment
        assert engine.decode_rows.take() == {}  # taken: a fresh count


def test_old_logps_equal_a_fresh_plain_forward_and_reference_equals_the_base_model():
    base = tiny_model("llama", vocab_size=101)
    base_copy = tiny_model("llama", vocab_size=101)  # same seed, same weights
    model = add_lora(base, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    engine = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=8, temperature=0.9))
    rollouts = engine.generate(PROMPTS, 2, seed=0)
    args = ([torch.tensor(p) for p in PROMPTS], rollouts.completion_ids, [2, 2, 2])
    with torch.no_grad():
        old = completion_logprobs(model, *args, temperature=0.9)  # what the sampler ships
        fresh = completion_logprobs(model, *args, shared_prefix=False, temperature=0.9)
        with model.disable_adapter():
            ref = completion_logprobs(model, *args, temperature=0.9)
        base_plain = completion_logprobs(base_copy, *args, shared_prefix=False, temperature=0.9)
    for a, b in zip(old, fresh):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for a, b in zip(ref, base_plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert max((a - r).abs().max().item() for a, r in zip(old, ref)) > 1e-2  # the adapter matters


def test_log_probs_recorded_while_sampling_equal_the_recomputed_old_log_probs():
    """The behaviour policy's log-probs read off `generate` (sampling.old_logps=generation) match
    the shared-prefix recompute, with chunking, uneven prompts (left padding) and EOS cuts."""
    model = add_lora(tiny_model("qwen2", vocab_size=101), LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.3)
    for max_sequences in (64, 4):
        engine = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=10, temperature=1.5,
                                                                 generation_batch_size=max_sequences))
        rollouts = engine.generate(PROMPTS, 4, seed=3)
        again = engine.generate(PROMPTS, 4, seed=3)
        assert all(torch.equal(a, b) for a, b in zip(rollouts.completion_ids, again.completion_ids))  # same draw
        assert all(torch.equal(a, b) for a, b in zip(rollouts.logps, again.logps))
        assert any(not cut for cut in rollouts.truncated) and any(rollouts.truncated)  # both kinds are covered
        with torch.no_grad():
            old = completion_logprobs(model, [torch.tensor(p) for p in PROMPTS], rollouts.completion_ids,
                                      [4, 4, 4], temperature=1.5)
        for recorded, recomputed, tokens in zip(rollouts.logps, old, rollouts.completion_ids):
            assert recorded.shape == tokens.shape
            torch.testing.assert_close(recorded, recomputed, rtol=0, atol=1e-5)


def test_token_sampler_draws_from_the_tempered_softmax_and_respects_top_k():
    """One step for 20000 sequences of one prompt: each token's frequency is within 5 standard
    errors of softmax(logits / T) (the seed makes the draw fixed); with top_k 3 only the 3
    likeliest tokens appear."""
    model = tiny_model("llama", vocab_size=101)
    prompt = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    n, temperature = 20000, 1.5
    engine = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=1, temperature=temperature,
                                                             generation_batch_size=n))
    drawn = torch.cat(engine.generate([PROMPTS[0]], n, seed=0).completion_ids)
    frequency = torch.bincount(drawn, minlength=101).double() / n
    p = torch.softmax(logits.double() / temperature, -1)
    assert p.max() < 0.5 and (p > 0.01).sum() > 20  # a spread-out distribution, not a near-argmax one
    assert ((frequency - p).abs() <= 5 * (p * (1 - p) / n).sqrt() + 1e-4).all()

    engine = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=1, temperature=temperature, top_k=3,
                                                             generation_batch_size=2000))
    drawn = torch.cat(engine.generate([PROMPTS[0]], 2000, seed=0).completion_ids)
    assert set(drawn.tolist()) == set(logits.topk(3).indices.tolist())


def test_the_draw_reaches_every_token_with_positive_probability_and_matches_softmax():
    """On a 49152-token distribution spread like a small model's, a float32 cumulative sum leaves
    hundreds of tail tokens an interval of width 0 (never drawn); the float64 one gives each its
    own: the midpoint of every token's interval draws that token. Then frequencies of 200000 draws
    from a 50-token distribution are within 5 standard errors of it, with no slack."""
    from grpo.sampler.rollout.decoding import inverse_cdf

    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(49152, generator=g, dtype=torch.float64) * 2, -1)
    assert (probs.float().cumsum(-1).diff() <= 0).sum() > 100  # the fault float32 had: tail tokens of width 0
    cdf = probs.cumsum(-1)
    midpoints = (torch.cat([torch.zeros(1, dtype=torch.float64), cdf[:-1]]) + cdf) / 2 / cdf[-1]
    tokens = torch.cat([inverse_cdf(probs[None].expand(len(chunk), -1), chunk[:, None])
                        for chunk in midpoints.split(4096)])
    assert torch.equal(tokens, torch.arange(49152))

    p = torch.softmax(torch.randn(50, generator=g, dtype=torch.float64) * 2, -1)
    n = 200_000
    drawn = inverse_cdf(p[None].expand(n, -1), torch.rand(n, 1, generator=g, dtype=torch.float64))
    frequency = torch.bincount(drawn, minlength=50).double() / n
    assert ((frequency - p).abs() <= 5 * (p * (1 - p) / n).sqrt()).all()


def test_default_config_builds_the_hf_engine():
    from grpo.sampler.rollout import make_engine

    assert type(make_engine(Config(), tiny_model(), FakeTokenizer())).__name__ == "HFEngine"


@pytest.mark.parametrize("lora", [False, True])
def test_a_checkpoints_own_generation_config_does_not_change_what_is_sampled_or_recorded(lora):
    """A tiny Llama whose generation_config carries a repetition penalty, no-repeat n-grams, top-k
    and a temperature (as Qwen2.5 ships some of them): the engine samples from softmax(logits / T)
    of our sampling keys only, so the recorded log-probs equal the shared-prefix recompute to fp32
    precision, and the model's own config is left as it was."""
    from transformers import GenerationConfig

    model = tiny_model("llama", vocab_size=101)
    model.generation_config = GenerationConfig(repetition_penalty=2.0, no_repeat_ngram_size=2, top_k=5,
                                               temperature=0.3, do_sample=True, eos_token_id=1, pad_token_id=0)
    shipped = model.generation_config.to_dict()
    if lora:  # under PEFT the checkpoint's config sits on the wrapped base model
        model = add_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])).eval()
    engine = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=24, temperature=1.0))
    rollouts = engine.generate(PROMPTS, 4, seed=0)
    with torch.no_grad():
        recomputed = completion_logprobs(model, [torch.tensor(p) for p in PROMPTS], rollouts.completion_ids,
                                         [4, 4, 4], temperature=1.0)
    gap = max((a - b).abs().max().item() for a, b in zip(rollouts.logps, recomputed))
    assert gap < 1e-5
    # the processors would have acted: some completion repeats a token (penalised) or a bigram
    assert any(len(set(c.tolist())) < len(c) for c in rollouts.completion_ids)
    assert unwrap_causal_lm(model).generation_config.to_dict() == shipped


def generate_reference(engine, prompts, group_size, seed, max_new_tokens):
    """The engine's former decode: transformers' greedy `generate` over a logits processor that
    draws with TokenSampler, from the prefill cache repeated G ways (one chunk)."""
    from grpo.sampler.rollout.decoding import TokenSampler, left_pad

    ids, mask = left_pad(prompts, 0)
    cache = engine._prefill(ids, mask)
    cache.batch_repeat_interleave(group_size)
    sampler = TokenSampler(engine.cfg.temperature, engine.cfg.top_k, engine.cfg.top_p)

    def processor(input_ids, scores):
        return torch.full_like(scores, float("-inf")).scatter_(-1, sampler.draw(scores)[:, None], 0.0)

    torch.manual_seed(seed)
    with torch.no_grad():
        out = engine.model.generate(input_ids=ids.repeat_interleave(group_size, 0),
                                    attention_mask=mask.repeat_interleave(group_size, 0), past_key_values=cache,
                                    max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=1, pad_token_id=0,
                                    logits_processor=[processor])
    recorded = sampler.recorded()
    rows = [cut_at_eos(row, [1])[0] for row in out[:, ids.shape[1]:]]
    return rows, [recorded[i, :len(r)] for i, r in enumerate(rows)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_decode_loop_draws_what_generate_drew_under_a_seed(arch):
    """Our decode loop in blocks over the in-place KV cache against transformers' generate over the
    concatenating DynamicCache: the same tokens and the same recorded log-probs bit for bit,
    with left padding, rows ending at different steps and top-k / top-p on. (The continuous loop
    seeds each completion on its own: tests/test_continuous.py compares it with each one alone.)"""
    model = tiny_model(arch, vocab_size=101)
    engine = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=14, temperature=1.3, top_k=40,
                                                             top_p=0.95))
    rollouts = engine.generate_in_blocks(PROMPTS, 4, seed=5)
    tokens, logps = generate_reference(engine, PROMPTS, 4, seed=5, max_new_tokens=14)
    assert any(not cut for cut in rollouts.truncated) and any(rollouts.truncated)  # rows end at different steps
    for got, want in zip(rollouts.completion_ids, tokens):
        assert torch.equal(got, want)
    for got, want in zip(rollouts.logps, logps):
        assert torch.equal(got, want)


def test_the_in_place_cache_holds_what_the_concatenating_cache_holds(monkeypatch):
    """A prefill repeated 3 ways, then 9 decoded tokens through buffers that grow by 4 positions:
    the logits and each layer's keys and values (views of the buffers) equal DynamicCache's."""
    from grpo.sampler.rollout.decoding import InPlaceLayer, left_pad
    from grpo.sampler.rollout.hf_engine import repeat_in_place

    monkeypatch.setattr(InPlaceLayer, "GROWTH", 4)
    model = tiny_model("llama", vocab_size=101)
    engine = HFEngine(model, FakeTokenizer(), SamplingConfig())
    ids, mask = left_pad(PROMPTS, 0)
    prefill = engine._prefill(ids, mask)
    in_place = repeat_in_place(prefill, 3)  # copies: the prefill itself becomes the concatenating reference
    plain = prefill
    plain.batch_repeat_interleave(3)
    rows = ids.repeat_interleave(3, 0)
    full = torch.cat([mask.repeat_interleave(3, 0), torch.ones(len(rows), 9, dtype=torch.long)], 1)
    position = full[:, :ids.shape[1]].sum(-1, keepdim=True) - 1
    token, capacities = rows[:, -1:], []
    with torch.no_grad():
        for t in range(9):
            outs = [model(input_ids=token, attention_mask=full[:, :ids.shape[1] + t], position_ids=position + t,
                          past_key_values=cache, use_cache=True).logits for cache in (in_place, plain)]
            assert torch.equal(outs[0], outs[1])
            token = outs[0][:, -1].argmax(-1, keepdim=True)
            capacities.append(in_place.layers[0].key_buffer.shape[2])
    assert capacities == [10] * 4 + [14] * 4 + [18]  # 6 prompt positions + 4, grown at the 5th and 9th token
    assert all(isinstance(layer, InPlaceLayer) for layer in in_place.layers)
    for a, b in zip(in_place.layers, plain.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) and a.keys.shape[2] == 6 + 9


def test_columns_appended_in_place_equal_the_concatenation_and_copy_once_a_block():
    """The continuous loop's attention mask grown a decode step at a time: equal to torch.cat of every step's
    columns, its buffer copied only when its free columns run out (every InPlaceLayer.GROWTH columns, or at
    once for a wider step), never into a tensor it was not made from."""
    from grpo.sampler.rollout.decoding import InPlaceLayer, append_columns

    generator = torch.Generator().manual_seed(0)
    mask, expected, copies = torch.ones(3, 5, dtype=torch.long), torch.ones(3, 5, dtype=torch.long), 0
    for step in range(150):
        new = torch.randint(0, 2, (3, 70 if step == 100 else 1 + step % 2), generator=generator)
        before = mask.untyped_storage().data_ptr()
        mask, expected = append_columns(mask, new), torch.cat([expected, new], dim=1)
        copies += mask.untyped_storage().data_ptr() != before
        assert torch.equal(mask, expected)
    added = expected.shape[1] - 5
    assert copies <= 2 + added // InPlaceLayer.GROWTH and copies < 10
    row = torch.ones(2, 4, dtype=torch.long)
    assert torch.equal(append_columns(row[:1], torch.zeros(1, 2, dtype=torch.long)), torch.tensor([[1, 1, 1, 1, 0, 0]]))
    assert torch.equal(row, torch.ones(2, 4, dtype=torch.long))  # the view's own tensor is left as it was


def test_many_one_completion_prompts_decode_within_generation_batch_size(monkeypatch):
    """A later turn of episodes: 7 prompts of one completion with generation_batch_size 3 decode
    3 + 3 + 1 rows in blocks, and greedy gives what one 7-row chunk gives, in blocks and continuously
    (3 rows at most, refilled)."""
    model = tiny_model("llama", vocab_size=101)
    prompts = [PROMPTS[i % len(PROMPTS)] + [5 + i] for i in range(7)]
    whole = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=5, generation_batch_size=64))
    engine = HFEngine(model, FakeTokenizer(), SamplingConfig(max_new_tokens=5, generation_batch_size=3))
    rows, decode = [], engine._decode
    monkeypatch.setattr(engine, "_decode", lambda ids, *a, **k: rows.append(len(ids)) or decode(ids, *a, **k))
    got = engine.generate_in_blocks(prompts, 1, greedy=True)
    assert rows == [3, 3, 1]
    want = whole.generate_in_blocks(prompts, 1, greedy=True)
    assert [c.tolist() for c in got.completion_ids] == [c.tolist() for c in want.completion_ids]
    continued = engine.generate(prompts, 1, greedy=True)
    assert [c.tolist() for c in continued.completion_ids] == [c.tolist() for c in want.completion_ids]
