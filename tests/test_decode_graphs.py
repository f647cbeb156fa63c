"""The HF engine's decode steps at a fixed shape (sampling.compile_decode, grpo/sampler/rollout/decode_graphs.py).

The loop's exactness tests of tests/test_continuous.py again, each engine's cache in fixed buffers and each
one-token step run at the fixed shape (rows in powers of two, spare rows fed a pad, the columns reached in
blocks, under the mask), uncompiled: the code a graph is compiled from, checked to the bit in float64 against each
completion made alone. Then the compiled step itself (inductor on the CPU, as on a GPU but without the graphs):
the same tokens, and log-probs to float32 rounding, in a bounded number of compiled graphs."""

import logging

import pytest
import test_continuous as loop_tests
import torch
from conftest import tiny_model
from episode_helpers import CharTokenizer

from grpo.config import ConfigError, load_config
from grpo.sampler.rollout import decode_graphs, hf_engine
from grpo.sampler.rollout.decode_graphs import DecodeGraphs
from grpo.sampler.rollout.hf_engine import HFEngine


@pytest.fixture
def fixed(monkeypatch):
    """Every HF engine made in the test decodes in fixed buffers 16 columns a block (they grow mid-call), its
    one-token steps at the fixed shape, run eagerly; the graphs made, to check the fixed steps ran."""
    made = []

    def of(model, cfg):
        graphs = DecodeGraphs(model)
        graphs.step = model  # the fixed-shape step, uncompiled
        made.append(graphs)
        return graphs

    monkeypatch.setattr(hf_engine.DecodeGraphs, "of", of)
    monkeypatch.setattr(decode_graphs, "GRAPH_COLUMNS", 16)
    yield made
    assert sum(graphs.fixed_steps for graphs in made) > 0  # the fixed path ran, not only the eager one


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
def test_refilled_completions_in_fixed_buffers_draw_what_each_draws_alone(fixed, dtype):
    loop_tests.test_completions_refilled_into_a_small_batch_draw_what_each_draws_alone(dtype)


def test_a_carried_call_and_an_evaluation_between_keep_fixed_buffers_of_their_own(fixed):
    """generate(A, then=B), a greedy evaluation between, then B: the evaluation's loop takes a second kept cache
    (B's rows stay in the first) and every completion is that call's made alone, to the bit."""
    loop_tests.test_the_next_calls_completions_fill_the_rows_a_call_leaves_free_and_are_what_it_would_draw(
        torch.float64)
    assert len(fixed[0].kept) == 2


@pytest.mark.parametrize("kind, batch, lengths", [("llama", 64, (5, 8)), ("qwen2", 3, (5, 8, 6)),
                                                  ("llama", 3, (1, 4)), ("qwen2", 64, (1, 1))])
def test_episodes_in_fixed_buffers_draw_what_each_draws_alone(fixed, kind, batch, lengths):
    """Episodes: replies fed several tokens a step (eager steps into the fixed buffers), rows parked and joining,
    one-token prompts (the first forward fills an empty cache), float64 to the bit."""
    loop_tests.test_episodes_in_one_loop_draw_the_tokens_and_log_probs_of_each_alone_re_prefilled(
        kind, batch, lengths, "float64")


def test_squeezed_fixed_buffers_change_no_token(fixed, monkeypatch):
    loop_tests.test_masked_columns_are_squeezed_out_without_changing_a_token(monkeypatch, torch.float64)


def test_fixed_buffers_of_keys_and_values_of_different_sizes(fixed, monkeypatch):
    """Multi-head latent attention (keys 16, values 8 a position), squeezed at every masked column."""
    loop_tests.test_episodes_of_a_model_whose_keys_and_values_differ_in_size(monkeypatch, 64, (5, 8), torch.float64)


def test_in_flight_weights_recomputed_into_fixed_buffers_give_each_token_its_versions_log_prob(
        fixed, tmp_path, monkeypatch):
    loop_tests.test_in_flight_weights_mid_episode_give_each_model_token_its_versions_log_prob(
        tmp_path, monkeypatch, torch.float64, 3)


def test_a_row_rewound_to_its_prompt_in_fixed_buffers(fixed, monkeypatch):
    loop_tests.test_a_new_row_goes_on_from_the_prompt_alone_as_a_sequence_with_that_context(
        monkeypatch, (5, 8), 0.0, 1.0, torch.float64)


def test_a_step_runs_the_next_power_of_two_rows_and_the_spare_ones_attend_to_themselves(monkeypatch):
    """5 rows of a 64-row cache run as 8; the spare rows' mask holds only this step's column; the buffers grow a
    block at a time and keep their address between steps of one width block; a later, shorter call's steps
    attend to the columns it reached (one block), not to all the buffers grew to."""
    model = tiny_model(dtype=torch.float64)
    engine = HFEngine(model, CharTokenizer(), load_config(None, ["sampling.compile_decode=true"]).sampling)
    engine.graphs.step = model
    monkeypatch.setattr(decode_graphs, "GRAPH_COLUMNS", 16)
    seen = []

    def record(_, args, kwargs):
        layer = kwargs["past_key_values"].layers[0]
        if getattr(layer, "fixed", False):  # a step at the fixed shape
            seen.append((kwargs["input_ids"].shape[0], kwargs["attention_mask"].clone(), layer.step_keys.data_ptr()))

    handle = model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        engine.generate([[5, 6, 7, 8], [9, 10]], 1, seed=0, max_new_tokens=[20, 3])  # 2 rows, then 1
        engine.generate([[5, 6, 7, 8], [9, 10, 11], [12, 13]], 2, seed=0, max_new_tokens=[4, 4, 4])  # 6 rows
    finally:
        handle.remove()
    steps = seen
    assert {rows for rows, _, _ in steps} == {1, 2, 8}
    for rows, mask, _ in steps:
        width = int(mask.nonzero()[:, 1].max()) + 1  # this step's column: the last any row attends to
        real = [row for row in range(rows) if mask[row, : width - 1].any()]
        for row in set(range(rows)) - set(real):
            assert mask[row].nonzero().squeeze(-1).tolist() == [width - 1]
    assert {mask.shape[1] for _, mask, _ in steps} == {16, 32}  # 4 + 20 tokens: the first block, then a second
    assert {mask.shape[1] for rows, mask, _ in steps if rows == 8} == {16}  # the second call: buffers 32 wide
    first_block = [address for _, mask, address in steps[:8] if mask.shape[1] == 16]
    assert len(set(first_block)) == 1


@pytest.mark.slow
def test_the_compiled_step_draws_the_eager_steps_tokens_in_a_few_graphs(monkeypatch):
    """The fixed step compiled (inductor on the CPU), float64: completions refilled into 5 rows (buckets of 1 to
    5 rows, the buffers growing mid-call) draw the eager fixed step's tokens; log-probs within float32 rounding
    (inductor's own cos/sin for the rotary positions move the float64 logits by ~1e-8); torch compiles at most
    2 graphs (its first shape, then the shapes symbolic), not one a step nor one where a step's views would be
    the whole buffers."""
    import torch._dynamo

    monkeypatch.setattr(decode_graphs, "GRAPH_COLUMNS", 16)
    model = tiny_model(dtype=torch.float64)
    cfg = load_config(None, ["sampling.max_new_tokens=40", "sampling.temperature=1.0",
                             "sampling.generation_batch_size=5", "sampling.compile_decode=true"]).sampling
    eager, compiled = HFEngine(model, CharTokenizer(), cfg), HFEngine(model, CharTokenizer(), cfg)
    eager.graphs.step = model
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14] * 9]
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    want, got = eager.generate(prompts, 3, seed=3), compiled.generate(prompts, 3, seed=3)
    assert compiled.graphs.fixed_steps == eager.graphs.fixed_steps > 40
    assert [len(c) for c in got.completion_ids] != [40] * 9  # some end early: rows leave and join
    for a, b in zip(want.completion_ids, got.completion_ids, strict=True):
        assert torch.equal(a, b)
    gap = max(((a - b).abs() / a.abs().clamp(min=1)).max().item() for a, b in zip(want.logps, got.logps))
    assert gap <= loop_tests.LOGP_TOLERANCE, gap
    assert 1 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] - before <= 2


def test_compile_decode_is_the_hf_engines_and_says_where_its_steps_stay_eager(caplog):
    with pytest.raises(ConfigError, match="sampling.compile_decode is the HF engine's"):
        load_config(None, ["sampling.engine=vllm", "sampling.compile_decode=true"])
    assert DecodeGraphs.of(tiny_model(), load_config(None, []).sampling) is None  # off by default
    on = load_config(None, ["sampling.compile_decode=true"]).sampling
    model = tiny_model()
    model.config._attn_implementation = "flex_attention"
    with caplog.at_level(logging.WARNING):
        assert DecodeGraphs.of(model, on) is None
    assert "the model's attention is flex_attention" in caplog.text
