"""Chunked log-probabilities, EOS masks, truncation, chunk-major reordering, and a sample's rows each read after
the prompt alone (grpo/model/segments.py)."""

import pytest
import torch

from grpo.model.completions import chunk_major_to_prompt_major, cut_at_eos
from grpo.model.logprobs import HEAD_CHUNK_BYTES, head_chunk_tokens, head_logprobs, pad_right


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_full_log_softmax(temperature):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16)
    targets = torch.randint(0, 50, (37,))
    logps, entropy = head_logprobs(hidden, targets, head, temperature, chunk_tokens=8)
    full = torch.log_softmax(head(hidden) / temperature, dim=-1)
    torch.testing.assert_close(logps, full.gather(-1, targets[:, None]).squeeze(-1), rtol=0, atol=1e-6)
    torch.testing.assert_close(entropy, -(full.exp() * full).sum(-1), rtol=0, atol=1e-5)


def test_a_head_chunk_stays_under_the_largest_mmap_threshold():
    """glibc maps blocks over 32 MiB afresh each time (page faults); a chunk's logits fit under it."""
    assert head_chunk_tokens(49_152) == 128  # SmolLM2: 24 MiB of float32 logits
    for vocab in (32_000, 49_152, 65_536, 100_000):
        rows = head_chunk_tokens(vocab)
        assert rows % 32 == 0 and rows * vocab * 4 <= HEAD_CHUNK_BYTES < 32 * 2**20
    assert head_chunk_tokens(151_936) == 32  # floor for huge vocabularies


def test_chunked_head_gradients_equal_the_full_computation():
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16, requires_grad=True)
    targets = torch.randint(0, 50, (37,))
    weights = torch.randn(37)
    logps, _ = head_logprobs(hidden, targets, head, 0.8, chunk_tokens=5)  # checkpointed chunks
    g_hidden, g_head = torch.autograd.grad((logps * weights).sum(), (hidden, head.weight))
    full = torch.log_softmax(head(hidden) / 0.8, -1).gather(-1, targets[:, None]).squeeze(-1)
    f_hidden, f_head = torch.autograd.grad((full * weights).sum(), (hidden, head.weight))
    torch.testing.assert_close(g_hidden, f_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_head, f_head, rtol=1e-5, atol=1e-6)


def test_cut_at_first_eos_keeps_it_and_flags_truncation():
    eos = [2, 9]
    tokens, truncated = cut_at_eos(torch.tensor([5, 6, 2, 7, 2, 2]), eos)
    assert tokens.tolist() == [5, 6, 2] and truncated is False
    tokens, truncated = cut_at_eos(torch.tensor([9]), eos)  # immediate EOS: a 1-token completion
    assert tokens.tolist() == [9] and truncated is False
    tokens, truncated = cut_at_eos(torch.tensor([5, 6, 7]), eos)
    assert tokens.tolist() == [5, 6, 7] and truncated is True


def test_chunk_major_order_is_put_back_prompt_major():
    # 2 prompts, G=5 generated in chunks of 2, 2, 1 completions per prompt
    produced = ["a0", "a1", "b0", "b1",  # chunk 0: prompt a x2, prompt b x2
                "a2", "a3", "b2", "b3",  # chunk 1
                "a4", "b4"]  # chunk 2
    assert chunk_major_to_prompt_major(produced, 2, [2, 2, 1]) == \
        ["a0", "a1", "a2", "a3", "a4", "b0", "b1", "b2", "b3", "b4"]
    assert chunk_major_to_prompt_major(list("abc"), 3, [1]) == list("abc")
    with pytest.raises(ValueError, match="3 items do not match 2 prompts"):
        chunk_major_to_prompt_major(list("abc"), 2, [2])


def test_pad_right_builds_the_mask_from_lengths():
    padded, mask = pad_right([torch.tensor([1.0, 2.0]), torch.tensor([3.0]), torch.tensor([4.0, 5.0, 6.0])])
    assert padded.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
    assert mask.int().tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]


def tiny_config(kind: str, **extra):
    import transformers

    common = dict(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=0)
    return getattr(transformers, f"{kind}Config")(**common, **extra)


@pytest.mark.parametrize("kind, extra, shared_prefix, expected", [
    ("Llama", {}, True, []),
    ("Qwen2", {}, True, []),  # sliding window off (use_sliding_window false)
    ("Mistral", {"sliding_window": 4096}, True, []),  # a window longer than prompt + completion: exact
    ("Mistral", {"sliding_window": 64}, False, []),  # the plain path runs the model's own attention
    ("Mistral", {"sliding_window": 64}, True, ["sliding_window=64 is shorter than data.max_prompt_tokens + "
                                               "sampling.max_new_tokens = 600"]),
    ("Qwen2", {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, True,
     ["sliding_window=64 is shorter"]),
    ("Gemma2", {"sliding_window": 4096}, True, ["final_logit_softcapping=30.0: the logits are capped by tanh",
                                                 "attn_logit_softcapping=50.0: the shared-prefix attention does not "
                                                 "cap its scores; set training.shared_prefix=false"]),
    ("Gemma2", {"sliding_window": 4096}, False, ["final_logit_softcapping=30.0"]),
    ("Gemma3Text", {"sliding_window": 64}, True, ["sliding_window=64 is shorter"]),
    ("Cohere", {}, True, ["logit_scale=0.0625: the logits are scaled"]),
])
def test_model_features_the_log_probs_would_get_wrong_are_named(kind, extra, shared_prefix, expected):
    from grpo.model.logprobs import unsupported_features

    problems = unsupported_features(tiny_config(kind, **extra), shared_prefix, max_tokens=600)
    assert len(problems) == len(expected) and all(p.startswith(e) for p, e in zip(problems, expected)), problems


@pytest.mark.parametrize("window, exact", [(64, True), (4, False)])
def test_a_sliding_window_within_the_sequence_is_why_the_shared_prefix_path_refuses_it(window, exact):
    """Tiny Mistral, prompt 6 + completions of 5: a 64-token window changes nothing and the shared-prefix
    forward equals the model's own; a 4-token window makes them differ."""
    import transformers

    from grpo.model.logprobs import completion_logprobs

    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(tiny_config("Mistral", sliding_window=window)).eval()
    prompts = [torch.randint(3, 100, (6,))]
    completions = [torch.randint(3, 100, (5,)) for _ in range(2)]
    with torch.no_grad():
        shared, plain = (completion_logprobs(model, prompts, completions, [2], shared_prefix=s) for s in (True, False))
    gap = max((a - b).abs().max().item() for a, b in zip(shared, plain))
    assert (gap < 1e-5) == exact, gap


def test_check_supported_refuses_at_start_in_one_line_naming_the_field():
    import transformers

    from grpo.common.sources import ModelError
    from grpo.config import load_config
    from grpo.model.logprobs import check_supported

    cfg = load_config(None, ["model.name_or_path=tiny-gemma2"])
    model = transformers.Gemma2ForCausalLM(tiny_config("Gemma2"))
    with pytest.raises(ModelError, match=r"^tiny-gemma2 \(gemma2\) is not supported: final_logit_softcapping=30.0: "
                                         r"[^\n]*; attn_logit_softcapping=50.0: [^\n]*$"):
        check_supported(model, cfg)


# ----------------------------------------------------------------------------- samples of several rows

def test_a_samples_rows_split_into_completions_of_their_group_and_join_back():
    from grpo.model.segments import join_rows, split_rows

    completions = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12]), torch.tensor([13, 14])]
    segments = [torch.tensor([0, 0, 0]), torch.tensor([0, 0, 1, 1, 2]), torch.tensor([0, 0])]
    rows, sizes, counts = split_rows(completions, [2, 1], segments)
    assert [r.tolist() for r in rows] == [[5, 6, 7], [8, 9], [10, 11], [12], [13, 14]]
    assert sizes == [4, 1] and counts == [1, 3, 1]
    assert [j.tolist() for j in join_rows(rows, counts)] == [c.tolist() for c in completions]


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["shared-prefix", "plain"])
def test_each_row_of_a_sample_is_read_after_the_prompt_alone_values_and_gradients(shared_prefix):
    """Two groups; samples of one, two and three rows: each token's log-prob (and entropy) is the one-sequence
    forward's of [prompt | its row], not of [prompt | every row before it]; the gradients of a weighted sum are those
    of the same sum over the rows as completions of their own (float64)."""
    from conftest import tiny_model

    from grpo.model.logprobs import completion_logprobs

    model = tiny_model("qwen2", dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 101, (n,), generator=g) for n in (6, 4)]
    completions = [torch.randint(3, 101, (n,), generator=g) for n in (7, 9, 5, 10)]
    segments = [torch.tensor(s, dtype=torch.int32) for s in (
        [0] * 7, [0, 0, 0, 1, 1, 1, 1, 1, 1], [0] * 5, [0, 0, 1, 1, 1, 1, 2, 2, 2, 2])]
    weights = [torch.randn(len(c), generator=g, dtype=torch.float64) for c in completions]

    def one_at_a_time(prompt, row):
        ids = torch.cat([prompt, row])[None]
        logits = model(ids).logits[0, len(prompt) - 1:-1].log_softmax(-1)
        return logits.gather(1, row[:, None])[:, 0], -(logits.exp() * logits).sum(-1)

    read, entropy = completion_logprobs(model, prompts, completions, [2, 2], segments=segments,
                                        shared_prefix=shared_prefix, return_entropy="grad")
    got = torch.autograd.grad(sum((w * x).sum() for w, x in zip(weights, read)), list(model.parameters()))
    expected_sum = 0.0
    for j, (c, s) in enumerate(zip(completions, segments)):
        prompt = prompts[j // 2]
        pieces = [one_at_a_time(prompt, c[s == r]) for r in range(int(s[-1]) + 1)]
        torch.testing.assert_close(read[j], torch.cat([p[0] for p in pieces]), rtol=0, atol=1e-10)
        torch.testing.assert_close(entropy[j], torch.cat([p[1] for p in pieces]), rtol=0, atol=1e-10)
        expected_sum = expected_sum + (weights[j] * torch.cat([p[0] for p in pieces])).sum()
    expected = torch.autograd.grad(expected_sum, list(model.parameters()))
    for a, b in zip(got, expected):  # the CPU's shared-prefix attention kernel: ~2e-7 from the plain path's anyway
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    unsplit = completion_logprobs(model, prompts, completions, [2, 2], shared_prefix=shared_prefix)
    assert not torch.allclose(unsplit[1][3:], read[1][3:].detach())  # the rows before would have changed them
