"""The FLOP accounting behind MFU, against the matmul FLOPs torch itself counts on the real passes."""

import torch
from conftest import tiny_model
from torch.utils.flop_counter import FlopCounterMode

from grpo.config import LoraConfig, SamplingConfig
from grpo.model.flops import ModelShape, generation_flops, logprob_pass_flops, matmul_probe, trainer_step_flops
from grpo.model.loading import add_lora
from grpo.model.logprobs import completion_logprobs
from grpo.sampler.rollout.hf_engine import HFEngine

PROMPT_LENS, COMPLETION_LENS, GROUPS = [7, 5], [3, 4, 2, 6], [2, 2]


def counted_matmul_flops(run) -> int:
    """FLOPs of every aten.mm / bmm torch runs in `run` (its CPU attention kernels count none)."""
    with FlopCounterMode(display=False) as counter:
        run()
    return sum(counter.get_flop_counts()["Global"].values())


def lora_tiny_model():
    return add_lora(tiny_model("llama"), LoraConfig())  # r 16 on q, k, v, o


def batch():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 101, (n,), generator=g) for n in PROMPT_LENS]
    completions = [torch.randint(3, 101, (n,), generator=g) for n in COMPLETION_LENS]
    return prompts, completions


def test_model_shape_counts_the_decoder_linear_maps_and_the_adapters_apart():
    shape = ModelShape.of(lora_tiny_model())
    # per layer: q 32x32 + k, v 32x16 + o 32x32 + gate, up, down 3 x 32x64 = 9,216; two layers
    assert shape.matmul_params == 2 * (1024 + 512 + 512 + 1024 + 3 * 2048) == 18432
    # A: 32x16 on each of q, k, v, o; B: 16x32 (q, o) and 16x16 (k, v)
    assert shape.adapter_params == 2 * (4 * 512 + 2 * 512 + 2 * 256) == 7168
    assert (shape.layers, shape.attention_width, shape.hidden, shape.vocab, shape.mlp_width) == (2, 32, 32, 101, 64)


def test_causal_attention_counts_each_token_against_its_keys():
    shape = ModelShape.of(tiny_model("llama"))
    slow = sum(4 * shape.layers * shape.attention_width * (p + 1) for p in range(5, 5 + 7))
    assert shape.attention_flops(5, 7) == slow == 4 * 2 * 32 * (6 + 7 + 8 + 9 + 10 + 11 + 12)


def test_eager_attention_computes_the_full_square_that_the_causal_count_halves():
    model = tiny_model("llama")
    model.config._attn_implementation = "eager"
    shape, T = ModelShape.of(model), 9
    ids = torch.arange(3, 3 + T)[None]
    with torch.no_grad():
        done = counted_matmul_flops(lambda: model(ids))
    dense_and_head = 2 * shape.matmul_params * T + shape.head_flops(T)
    assert done - dense_and_head == 4 * shape.layers * shape.attention_width * T * T
    assert shape.attention_flops(0, T) * 2 * T == (done - dense_and_head) * (T + 1)


def test_logprob_pass_flops_equal_the_matmuls_of_the_shared_prefix_forward():
    model = lora_tiny_model()
    shape, (prompts, completions) = ModelShape.of(model), batch()
    with torch.no_grad():
        done = counted_matmul_flops(lambda: completion_logprobs(model, prompts, completions, GROUPS))
    flops = logprob_pass_flops(shape, PROMPT_LENS, COMPLETION_LENS, GROUPS)
    assert done == flops.dense + flops.adapters + flops.head  # prompts once per group, head on completions
    tokens = sum(PROMPT_LENS) + sum(COMPLETION_LENS)
    assert flops.dense == 2 * 18432 * tokens and flops.head == 2 * 32 * 101 * sum(COMPLETION_LENS)
    plain = logprob_pass_flops(shape, PROMPT_LENS, COMPLETION_LENS, GROUPS, shared_prefix=False)
    assert plain.dense == 2 * 18432 * (2 * 7 + 2 * 5 + sum(COMPLETION_LENS))  # each prompt G = 2 times


def test_trainer_step_flops_equal_forward_and_backward_matmuls_under_lora():
    model = lora_tiny_model()
    shape, (prompts, completions) = ModelShape.of(model), batch()

    def step():
        torch.cat(completion_logprobs(model, prompts, completions, GROUPS)).sum().backward()

    done = counted_matmul_flops(step)
    flops = trainer_step_flops(shape, PROMPT_LENS, COMPLETION_LENS, GROUPS, lora=True, reference=False)
    attention = logprob_pass_flops(shape, PROMPT_LENS, COMPLETION_LENS, GROUPS).attention
    # autograd skips layer 0's q/k/v input gradients (base and lora_A): 27 tokens x 2 x (2,048 + 3 x 512)
    skipped = 2 * (sum(PROMPT_LENS) + sum(COMPLETION_LENS)) * (1024 + 512 + 512 + 3 * 512)
    assert skipped == 193536
    assert done == flops["model"] - 3 * attention - skipped + flops["recomputed"]
    with_reference = trainer_step_flops(shape, PROMPT_LENS, COMPLETION_LENS, GROUPS, lora=True, reference=True)
    reference = logprob_pass_flops(shape, PROMPT_LENS, COMPLETION_LENS, GROUPS, adapters=False)
    assert with_reference["model"] - flops["model"] == reference.total


def test_full_finetuning_is_three_forwards_of_every_matmul_and_the_head():
    model = tiny_model("llama").train()
    shape, (prompts, completions) = ModelShape.of(model), batch()

    def step():
        torch.cat(completion_logprobs(model, prompts, completions, GROUPS)).sum().backward()

    done = counted_matmul_flops(step)
    full = trainer_step_flops(shape, PROMPT_LENS, COMPLETION_LENS, GROUPS, lora=False, reference=False)
    forward = logprob_pass_flops(shape, PROMPT_LENS, COMPLETION_LENS, GROUPS, adapters=False)
    assert full["model"] == 3 * forward.total  # forward, activation and weight gradients; attention 1 + 2
    assert done == full["model"] - 3 * forward.attention + full["recomputed"]  # the embedding trains: nothing skipped


def test_generation_flops_equal_the_engine_matmuls_with_one_logits_row_from_the_prefill():
    model = lora_tiny_model().eval()

    class Tokenizer:
        pad_token_id, eos_token_id = 0, 1

    engine = HFEngine(model, Tokenizer(), SamplingConfig(max_new_tokens=6))
    prompt = list(range(5, 12))  # P = 7, one sequence: no padding, no finished rows kept in the batch
    engine.generate([prompt], 1, greedy=True)  # the first call also runs the loop's masked-gap probe, once per model
    out = {}
    done = counted_matmul_flops(lambda: out.update(r=engine.generate([prompt], 1, greedy=True)))
    C = len(out["r"].completion_ids[0])
    flops = generation_flops(ModelShape.of(model), [7], [C], [1])
    # the prefill keeps the last prompt row's logits (logits_to_keep=1), which generate() recomputes
    assert done == flops.dense + flops.adapters + flops.head + ModelShape.of(model).head_flops(1)
    assert flops.head == 2 * 32 * 101 * C  # one head row per completion token, none per prompt token


def test_the_ceiling_probe_runs_the_flops_it_claims_on_the_models_mlp_width():
    shape = ModelShape.of(tiny_model("llama"))
    run, flops = matmul_probe(shape, rows=8)
    assert counted_matmul_flops(run) == flops == 2 * 8 * (2 * 32 * 64 + 32 * 32)  # inner width 64: the MLP's
