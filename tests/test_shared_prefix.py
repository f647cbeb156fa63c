"""The shared-prefix forward equals the plain repeated-prompt forward (values and gradients)."""

import copy
import zlib

import pytest
import torch
from conftest import tiny_model

from grpo.config import LoraConfig
from grpo.model.loading import add_lora, enable_gradient_checkpointing
from grpo.model.logprobs import completion_logprobs
from grpo.model.shared_prefix import pack_groups


def random_groups(seed, prompt_lens, group_sizes, max_completion=9, vocab=101):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g) for n in prompt_lens]
    lengths = torch.randint(1, max_completion + 1, (sum(group_sizes),), generator=g).tolist()
    completions = [torch.randint(3, vocab, (n,), generator=g) for n in lengths]
    return prompts, completions


def max_abs_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


CASES = {
    "uneven prompts and group sizes, G=1 included": ([5, 17, 3, 11], [2, 4, 1, 3], None),
    "single group": ([8], [4], None),
    "many groups per forward": ([4] * 12, [3] * 12, None),
    "left-over budget splits rows": ([6, 9, 4, 12, 7], [3, 2, 4, 1, 2], 40),
    "budget smaller than one group": ([10, 10], [4, 4], 12),
}


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("case", list(CASES))
def test_shared_prefix_equals_plain_in_float32(kind, case):
    prompt_lens, sizes, budget = CASES[case]
    model = tiny_model(kind)
    prompts, completions = random_groups(zlib.crc32(case.encode()) % 100, prompt_lens, sizes)  # hash() is salted
    kwargs = {"max_tokens_per_forward": budget} if budget else {}
    with torch.no_grad():
        shared = completion_logprobs(model, prompts, completions, sizes, shared_prefix=True, temperature=0.8, **kwargs)
        plain = completion_logprobs(model, prompts, completions, sizes, shared_prefix=False, temperature=0.8)
    assert [len(x) for x in shared] == [len(c) for c in completions]
    assert max_abs_diff(shared, plain) <= 1e-5


def test_completion_of_length_one_and_budget_rows():
    model = tiny_model()
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    completions = [torch.tensor([1]), torch.tensor([4, 1]), torch.tensor([1]), torch.tensor([3, 3, 3, 1])]
    rows = pack_groups(prompts, completions, [2, 2], max_tokens=8)
    assert [len(r.groups) for r in rows] == [1, 1]  # 3+1+2 = 6 fits, adding 2+1+4 = 7 does not
    assert rows[0].position_ids.tolist() == [0, 1, 2, 3, 3, 4]  # completions continue from the prompt
    assert rows[0].hidden_index.tolist() == [2, 2, 4]  # both completions read the prompt's last token
    with torch.no_grad():
        a = completion_logprobs(model, prompts, completions, [2, 2], max_tokens_per_forward=8)
        b = completion_logprobs(model, prompts, completions, [2, 2], shared_prefix=False)
    assert max_abs_diff(a, b) <= 1e-5


def weighted_sum_grads(model, prompts, completions, sizes, shared, weights):
    logps = completion_logprobs(model, prompts, completions, sizes, shared_prefix=shared, temperature=0.9)
    loss = sum((w * lp).sum() for w, lp in zip(weights, logps))
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params)


def relative_error(a, b):
    return max(((x - y).norm() / y.norm().clamp(min=1e-12)).item() for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_gradients_equal_the_plain_path(kind, checkpointing):
    model = add_lora(tiny_model(kind),
                     LoraConfig(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)  # non-zero B so every LoRA matrix gets a gradient
    if checkpointing:
        enable_gradient_checkpointing(model)
    model.train()
    sizes = [3, 1, 4]
    prompts, completions = random_groups(3, [6, 13, 4], sizes)
    weights = [torch.randn(len(c), generator=torch.Generator().manual_seed(j)) for j, c in enumerate(completions)]
    shared = weighted_sum_grads(model, prompts, completions, sizes, True, weights)
    plain = weighted_sum_grads(model, prompts, completions, sizes, False, weights)
    assert len(shared) == 2 * 4 * 2  # A and B, 4 projections, 2 layers
    assert relative_error(shared, plain) <= 1e-5


def test_full_model_gradients_equal_the_plain_path():
    model = tiny_model("qwen2").train()
    sizes = [2, 3]
    prompts, completions = random_groups(5, [7, 3], sizes)
    weights = [torch.ones(len(c)) for c in completions]
    assert relative_error(weighted_sum_grads(model, prompts, completions, sizes, True, weights),
                          weighted_sum_grads(model, prompts, completions, sizes, False, weights)) <= 1e-5


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bfloat16_matches_the_plain_path_to_bfloat16_precision(kind):
    model = tiny_model(kind, dtype=torch.bfloat16)
    sizes = [2, 3]
    prompts, completions = random_groups(9, [7, 12], sizes)
    with torch.no_grad():
        shared = completion_logprobs(model, prompts, completions, sizes)
        plain = completion_logprobs(model, prompts, completions, sizes, shared_prefix=False)
    assert all(x.dtype == torch.float32 for x in shared)  # the head's softmax runs in float32
    assert max_abs_diff(shared, plain) <= 0.05  # bf16 has 8 bits of mantissa


def test_bad_inputs_are_rejected_with_the_reason():
    model = tiny_model()
    p, c = [torch.tensor([3, 4])], [torch.tensor([5]), torch.tensor([6])]
    with pytest.raises(ValueError, match="group sizes sum to 3 but there are 2 completions"):
        completion_logprobs(model, p, c, [3])
    with pytest.raises(ValueError, match="1 prompts but 2 group sizes"):
        completion_logprobs(model, p, c, [1, 1])
    with pytest.raises(ValueError, match="at least one token"):
        completion_logprobs(model, p, [torch.tensor([5]), torch.tensor([], dtype=torch.long)], [2])


def test_embedded_smollm2_on_a_real_gsm8k_prompt_with_sampled_completions(smollm2, gsm8k_data):
    """Over 30 layers float32 rounding alone moves log-probs by ~2e-5 (the plain path against a
    float64 forward), more than the 1e-5 used on tiny models. So exactness is checked in
    float64, and in float32 the two paths must differ by less than that rounding noise."""
    from grpo.data.problems import load_problems
    from grpo.data.prompts import prompt_text

    model, tokenizer = smollm2
    problem = load_problems(str(gsm8k_data), "test")[0][0]
    prompt = tokenizer(prompt_text(tokenizer, problem.question, "Think step by step."), add_special_tokens=False,
                       return_tensors="pt").input_ids
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(prompt.repeat(4, 1), attention_mask=torch.ones(4, prompt.shape[1], dtype=torch.long),
                             do_sample=True, temperature=0.9, max_new_tokens=24, pad_token_id=tokenizer.pad_token_id)
    completions = [row[prompt.shape[1]:] for row in out]
    args = ([prompt[0]], completions, [4])
    with torch.no_grad():
        shared = completion_logprobs(model, *args, temperature=0.9)
        plain = completion_logprobs(model, *args, shared_prefix=False, temperature=0.9)
        model64 = copy.deepcopy(model).double()
        shared64 = completion_logprobs(model64, *args, temperature=0.9)
        plain64 = completion_logprobs(model64, *args, shared_prefix=False, temperature=0.9)
    assert max_abs_diff(shared64, plain64) <= 1e-10
    truth = [x.double() for x in plain64]
    float32_noise = max_abs_diff(plain, truth)  # ~1e-5 to 2e-5: the plain path against exact arithmetic
    # Each float32 path is within a small multiple of the rounding noise of the truth, and the two are
    # within about twice it of each other. The ratio between the paths' own errors depends on the
    # CPU's kernels: on one AVX-512 MKL build shared-truth 9.1e-6 against plain-truth 1.02e-5, on
    # another 2.08e-5 against 1.22e-5; so neither path is always the closer one.
    assert max_abs_diff(shared, truth) <= 2 * float32_noise
    assert max_abs_diff(shared, plain) <= 2 * float32_noise
    assert mean_abs_diff(shared, truth) <= 1.1 * mean_abs_diff(plain, truth)


def mean_abs_diff(a, b):
    return torch.cat([(x - y).abs() for x, y in zip(a, b, strict=True)]).mean().item()


@pytest.mark.parametrize("lens", [[4, 4, 4], [5, 1, 3, 7]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_block_sparse_kernel_equals_masked_attention_values_and_gradients(lens, dtype):
    """The CPU kernel (two flash blocks merged by log-sum-exp, hand-written backward) against
    one masked SDPA over the group's keys, with grouped-query heads (4 query, 2 key/value)."""
    from grpo.model.prefix_attention import prefix_merged_attention
    from grpo.model.shared_prefix import GroupSpan

    g = torch.Generator().manual_seed(len(lens))
    P, Lc = 6, sum(lens)
    q = torch.randn(1, 4, P + Lc, 8, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(1, 2, P + Lc, 8, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(1, 2, P + Lc, 8, generator=g, dtype=dtype, requires_grad=True)
    weights = torch.randn(1, 4, Lc, 8, generator=g, dtype=dtype)
    fast = prefix_merged_attention(q[:, :, P:], k[:, :, :P], v[:, :, :P], k[:, :, P:], v[:, :, P:], lens, None)
    mask = GroupSpan(0, P, lens).completion_mask(q.device)
    slow = torch.nn.functional.scaled_dot_product_attention(q[:, :, P:], k, v, attn_mask=mask, enable_gqa=True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fast, slow, **tol)
    fast_grads = torch.autograd.grad((fast * weights).sum(), (q, k, v))
    slow_grads = torch.autograd.grad((slow * weights).sum(), (q, k, v))
    for a, b in zip(fast_grads, slow_grads):
        torch.testing.assert_close(a, b, **tol)


def test_entropies_agree_between_paths_and_are_skipped_when_not_asked():
    model = tiny_model("qwen2")
    prompts, completions = random_groups(11, [5, 8], [2, 3])
    with torch.no_grad():
        lp_s, ent_s = completion_logprobs(model, prompts, completions, [2, 3], return_entropy=True)
        lp_p, ent_p = completion_logprobs(model, prompts, completions, [2, 3], shared_prefix=False,
                                          return_entropy=True)
    assert max_abs_diff(ent_s, ent_p) <= 1e-5 and max_abs_diff(lp_s, lp_p) <= 1e-5
    vocab = model.config.vocab_size
    assert all(((e >= 0) & (e <= torch.log(torch.tensor(float(vocab))) + 1e-5)).all() for e in ent_s)


def test_verify_shared_prefix_passes_on_a_supported_model_and_stops_a_broken_one(monkeypatch):
    from grpo.model import prefix_attention, shared_prefix
    from grpo.model.logprobs import SharedPrefixMismatch, verify_shared_prefix

    model = tiny_model()
    prompts, completions = random_groups(2, [5, 8, 3], [2, 3, 2])
    assert verify_shared_prefix(model, prompts, completions, [2, 3, 2]) <= 1e-5
    # a broken attention (completions cannot see their prompt) must be caught
    real_mask = shared_prefix.GroupSpan.completion_mask

    def prompt_hidden(self, device):
        mask = real_mask(self, device).clone()
        mask[:, : self.prompt_len] = False
        return mask

    monkeypatch.setattr(prefix_attention, "available", lambda device: False)  # the masked kernel
    monkeypatch.setattr(shared_prefix.GroupSpan, "completion_mask", prompt_hidden)
    with pytest.raises(SharedPrefixMismatch,
                       match="differ from the plain forward by .* Set training.shared_prefix=false"):
        verify_shared_prefix(model, prompts, completions, [2, 3, 2])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_masked_kernel_used_off_the_cpu_is_exact_too(kind, monkeypatch):
    """Other devices use SDPA with the group's completion mask; check that path here too."""
    from grpo.model import prefix_attention

    monkeypatch.setattr(prefix_attention, "available", lambda device: False)
    model = add_lora(tiny_model(kind), LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    sizes = [3, 1, 2]
    prompts, completions = random_groups(4, [6, 9, 4], sizes)
    weights = [torch.ones(len(c)) for c in completions]
    with torch.no_grad():
        assert max_abs_diff(completion_logprobs(model, prompts, completions, sizes),
                            completion_logprobs(model, prompts, completions, sizes, shared_prefix=False)) <= 1e-5
    assert relative_error(weighted_sum_grads(model, prompts, completions, sizes, True, weights),
                          weighted_sum_grads(model, prompts, completions, sizes, False, weights)) <= 1e-5


def test_flex_block_mask_labels_and_layout_worked_example():
    """Two groups in a row: prompt 2 + completions [1, 2], then prompt 1 + completion [2]."""
    from grpo.model.flex_prefix import row_block_mask, token_labels
    from grpo.model.shared_prefix import GroupSpan

    groups = [GroupSpan(0, 2, [1, 2]), GroupSpan(5, 1, [2])]
    group, segment = token_labels(groups, torch.device("cpu"))
    assert group.tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert segment.tolist() == [0, 0, 1, 2, 2, 0, 1, 1]
    mask_mod = row_block_mask(groups, torch.device("cpu")).mask_mod
    seen = [[int(mask_mod(0, 0, torch.tensor(q), torch.tensor(k))) for k in range(8)] for q in range(8)]
    assert seen == [[1, 0, 0, 0, 0, 0, 0, 0],
                    [1, 1, 0, 0, 0, 0, 0, 0],
                    [1, 1, 1, 0, 0, 0, 0, 0],   # completion 1 of group 0: the prompt, itself
                    [1, 1, 0, 1, 0, 0, 0, 0],   # completion 2: the prompt, not completion 1
                    [1, 1, 0, 1, 1, 0, 0, 0],
                    [0, 0, 0, 0, 0, 1, 0, 0],   # group 1's prompt sees nothing of group 0
                    [0, 0, 0, 0, 0, 1, 1, 0],
                    [0, 0, 0, 0, 0, 1, 1, 1]]


def eager_flex(monkeypatch):
    """transformers' FlexAttention through torch's eager reference (no compiler; the CPU guard on its backward
    lifted): the same block mask, the math written out."""
    import torch.nn.attention.flex_attention as flex_module
    from transformers.integrations import flex_attention as transformers_flex

    monkeypatch.setattr(transformers_flex, "compile_friendly_flex_attention",
                        lambda query, key, value, training=False, **kwargs: flex_module.flex_attention(
                            query, key, value, **kwargs))
    monkeypatch.setattr(flex_module, "_validate_device", lambda query, key, value: None)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_flex_rows_of_several_blocks_equal_the_block_sparse_path_and_build_one_mask_a_row(kind, monkeypatch):
    """Rows of up to 600 tokens, several of FlexAttention's 128-token blocks (some skipped whole, some full, some
    partial): the log-probs equal the block-sparse path's, and each row's mask is built once for both layers."""
    from grpo.model import flex_prefix

    eager_flex(monkeypatch)
    built, build = [], flex_prefix.row_block_mask
    monkeypatch.setattr(flex_prefix, "row_block_mask", lambda groups, device: built.append(len(groups)) or
                        build(groups, device))
    model = tiny_model(kind)
    flex = copy.deepcopy(model)
    flex.set_attn_implementation("flex_attention")
    sizes = [3, 4, 2, 2, 1]
    prompts, completions = random_groups(7, [150, 40, 90, 200, 33], sizes, max_completion=60)
    rows = pack_groups(prompts, completions, sizes, max_tokens=600)
    assert len(rows) >= 2 and max(len(r.input_ids) for r in rows) > 3 * 128
    with torch.no_grad():
        ours = completion_logprobs(flex, prompts, completions, sizes, max_tokens_per_forward=600)
        today = completion_logprobs(model, prompts, completions, sizes, max_tokens_per_forward=600)
    assert built == [len(r.groups) for r in rows]
    assert max_abs_diff(ours, today) <= 1e-5


@pytest.mark.slow  # transformers compiles FlexAttention: inductor runs the C++ compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flex_attention_shared_prefix_equals_todays_path_values_and_lora_gradients(dtype, monkeypatch):
    """model.attn_implementation=flex_attention: each packed row in one FlexAttention call under its block mask,
    against the same weights through today's kernel (block-sparse on the CPU) and the plain path."""
    model = add_lora(tiny_model("qwen2", dtype=dtype),
                     LoraConfig(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    flex = copy.deepcopy(model)
    flex.base_model.model.set_attn_implementation("flex_attention")
    sizes = [3, 1, 2]
    prompts, completions = random_groups(4, [6, 9, 4], sizes)  # three groups in one row
    weights = [torch.randn(len(c), generator=torch.Generator().manual_seed(j), dtype=dtype)
               for j, c in enumerate(completions)]
    tol = 1e-5 if dtype == torch.float32 else 1e-11

    def values_agree():
        with torch.no_grad():
            ours = completion_logprobs(flex, prompts, completions, sizes, temperature=0.9)
            today = completion_logprobs(model, prompts, completions, sizes, temperature=0.9)
            plain = completion_logprobs(model, prompts, completions, sizes, shared_prefix=False, temperature=0.9)
        return max_abs_diff(ours, today) <= tol and max_abs_diff(ours, plain) <= tol

    if dtype == torch.float32:  # the compiled kernel, as a sampler on the CPU runs it (compiled in float32 at most)
        assert values_agree()
    # torch has no FlexAttention backward on the CPU (a GPU compiles one) and compiles none in float64: the same
    # block mask through its eager reference
    eager_flex(monkeypatch)
    assert values_agree()
    assert flex.base_model.model.config._attn_implementation == "grpo_shared_prefix:flex_attention"
    for checkpointing in (False, True):
        if checkpointing:  # the recomputation reuses the row's mask
            enable_gradient_checkpointing(model), enable_gradient_checkpointing(flex)
        model.train(), flex.train()
        grads = weighted_sum_grads(flex, prompts, completions, sizes, True, weights)
        assert len(grads) == 2 * 4 * 2
        assert relative_error(grads, weighted_sum_grads(model, prompts, completions, sizes, True, weights)) <= tol


def test_flex_attention_trainer_on_the_cpu_is_refused_at_start():
    from grpo.common.sources import ModelError
    from grpo.config import load_config
    from grpo.model.logprobs import check_supported

    cfg = load_config(None, ["model.attn_implementation=flex_attention"])
    model = tiny_model()
    check_supported(model, cfg)  # a sampler's passes need no backward
    with pytest.raises(ModelError, match="FlexAttention has no backward on the CPU.*model.attn_implementation=sdpa"):
        check_supported(model, cfg, trains=True)
