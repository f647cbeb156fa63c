"""Model FLOPs of a step, and the machine's matmul rate they are measured against (MFU).

Model FLOPs count the useful work, 2 per multiply-add: every decoder matmul on every token
fed, causal attention (a token at position p attends to p + 1 keys), and the LM head only
where a log-prob or a next token is needed. Recomputation (the trainer's checkpointed head
chunks) is counted apart, as work done but not model work. Like PaLM's appendix B and veRL's
flops counter, elementwise ops (norms, RoPE, softmax, SiLU) are left out: they are memory
bound and a few percent of the FLOPs at these shapes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from grpo.model.loading import unwrap_causal_lm
from grpo.model.shared_prefix import group_bounds

if TYPE_CHECKING:
    from grpo.settings import Config


def _full_numel(weight: torch.Tensor) -> int:
    return getattr(weight, "ds_numel", None) or weight.numel()  # ZeRO-3 leaves an empty local shard


def _full_shape(weight: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(weight, "ds_shape", None) or weight.shape)


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs of a decoder depend on."""

    matmul_params: int  # weights of the decoder layers' linear maps, all layers (LoRA excluded)
    adapter_params: int  # weights of the LoRA A and B maps, all layers (0 without LoRA)
    layers: int
    attention_width: int  # heads x head_dim: the width of Q.K^T and A.V in one layer
    hidden: int
    vocab: int
    mlp_width: int  # the MLP's inner width (the matmul ceiling is measured on its shapes)

    @classmethod
    def of(cls, model) -> "ModelShape":
        """Counted from the model's own linear maps (a PEFT model's LoRA maps apart)."""
        causal_lm = unwrap_causal_lm(model)
        config = causal_lm.config.get_text_config()  # a vision-language model's: its language model's
        base, adapters = 0, 0
        for name, module in causal_lm.get_decoder().named_modules():
            if isinstance(module, torch.nn.Linear):
                if ".lora_" in name:
                    adapters += _full_numel(module.weight)
                else:
                    base += _full_numel(module.weight)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        vocab, hidden = _full_shape(causal_lm.get_output_embeddings().weight)
        return cls(matmul_params=base, adapter_params=adapters, layers=config.num_hidden_layers,
                   attention_width=config.num_attention_heads * head_dim, hidden=hidden, vocab=vocab,
                   mlp_width=getattr(config, "intermediate_size", None) or 4 * hidden)

    def attention_flops(self, first_position: int, count: int) -> int:
        """Q.K^T and A.V of `count` tokens at positions first_position, first_position + 1, ..."""
        keys = count * first_position + count * (count + 1) // 2  # sum of (p + 1) over the tokens
        return 4 * self.layers * self.attention_width * keys

    def head_flops(self, tokens: int) -> int:
        return 2 * self.hidden * self.vocab * tokens


@dataclass(frozen=True)
class PassFlops:
    """One forward over a batch of groups, split by where the work is."""

    dense: int  # decoder matmuls of the base weights
    adapters: int  # LoRA A and B matmuls
    attention: int  # Q.K^T and A.V
    head: int  # LM head rows that predict a token

    @property
    def total(self) -> int:
        return self.dense + self.adapters + self.attention + self.head


def logprob_pass_flops(shape: ModelShape, prompt_lens: Sequence[int], completion_lens: Sequence[int],
                       group_sizes: Sequence[int], shared_prefix: bool = True, adapters: bool = True) -> PassFlops:
    """The forward the trainer (or the sampler's scoring pass) runs for per-token log-probs:
    every prompt once per group (shared prefix) or once per completion (plain), then each
    completion at positions P .. P + C - 1; the head on the C rows that predict its tokens."""
    tokens = attention = 0
    for P, (a, b) in zip(prompt_lens, group_bounds(group_sizes)):
        lens = completion_lens[a:b]
        prompt_copies = 1 if shared_prefix else b - a
        tokens += prompt_copies * P + sum(lens)
        attention += prompt_copies * shape.attention_flops(0, P) + sum(shape.attention_flops(P, C) for C in lens)
    return PassFlops(dense=2 * shape.matmul_params * tokens, adapters=2 * shape.adapter_params * tokens * adapters,
                     attention=attention, head=shape.head_flops(sum(completion_lens)))


def trainer_step_flops(shape: ModelShape, prompt_lens: Sequence[int], completion_lens: Sequence[int],
                       group_sizes: Sequence[int], *, lora: bool, reference: bool, shared_prefix: bool = True,
                       passes: int = 1) -> dict[str, int]:
    """Model FLOPs of one trainer step, and the recomputed FLOPs on top of them.

    Backward costs one forward for the activations' gradients (twice for attention: dV, dP,
    dQ and dK are four products the size of the forward's two, Q.K^T and A.V) and one
    more for the weights' gradients of whatever trains: only the adapters under LoRA, every
    matmul and the head without it. The head's chunks are checkpointed, so backward runs the
    head forward again (`recomputed`). Under LoRA autograd skips the input gradients of the
    first layer's q/k/v maps (nothing below them trains); the count keeps them, as the usual
    6N-per-token convention does: under 1/layers of the backward."""
    policy = logprob_pass_flops(shape, prompt_lens, completion_lens, group_sizes, shared_prefix, adapters=lora)
    ref = logprob_pass_flops(shape, prompt_lens, completion_lens, group_sizes, shared_prefix, adapters=False)
    activation_grads = policy.dense + policy.adapters + 2 * policy.attention + policy.head
    weight_grads = policy.adapters if lora else policy.dense + policy.head
    model = passes * (policy.total + activation_grads + weight_grads) + (ref.total if reference else 0)
    return {"model": model, "recomputed": passes * policy.head}


def batch_step_flops(shape: ModelShape, batch, cfg: Config) -> dict[str, int]:
    """`trainer_step_flops` of a received batch under the run's config: the reference pass is
    the trainer's when the sampler sent no reference log-probs and the KL term is on."""
    training = cfg.training
    reference = batch.ref_logps is None and training.beta > 0 and training.reference_on == "trainer"
    return trainer_step_flops(shape, [len(p) for p in batch.prompt_ids], [len(c) for c in batch.completion_ids],
                              list(batch.group_sizes), lora=cfg.lora.enabled, reference=reference,
                              shared_prefix=training.shared_prefix, passes=training.num_iterations)


def generation_flops(shape: ModelShape, prompt_lens: Sequence[int], completion_lens: Sequence[int],
                     group_sizes: Sequence[int], adapters: bool = True) -> PassFlops:
    """Model FLOPs of generating the completions with a KV cache: each prompt prefilled once
    (the head only on its last token, which samples the first token of every completion), then
    one decode step per later completion token, each with the head. Rows that finished early
    but are still in the batch, and padding, are work done but not model work."""
    tokens = attention = head_rows = 0
    for P, (a, b) in zip(prompt_lens, group_bounds(group_sizes)):
        lens = completion_lens[a:b]
        decoded = [max(C - 1, 0) for C in lens]  # each completion's last token is never fed back
        tokens += P + sum(decoded)
        attention += shape.attention_flops(0, P) + sum(shape.attention_flops(P, d) for d in decoded)
        head_rows += 1 + sum(decoded)
    return PassFlops(dense=2 * shape.matmul_params * tokens, adapters=2 * shape.adapter_params * tokens * adapters,
                     attention=attention, head=shape.head_flops(head_rows))


def matmul_probe(shape: ModelShape, rows: int = 1024, dtype: torch.dtype = torch.float32):
    """(a function running the model's own matmul shapes on [rows, hidden] inputs: the MLP's up
    and down projections and the square attention projection; its FLOPs)."""
    inner = shape.mlp_width
    x = torch.randn(rows, shape.hidden, dtype=dtype)
    up, down = torch.randn(shape.hidden, inner, dtype=dtype), torch.randn(inner, shape.hidden, dtype=dtype)
    square = torch.randn(shape.hidden, shape.hidden, dtype=dtype)

    def run():
        (x @ up) @ down
        x @ square

    return run, 2 * rows * (2 * shape.hidden * inner + shape.hidden * shape.hidden)


def measure_matmul_rate(shape: ModelShape, rows: int = 1024, seconds: float = 2.0,
                        dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of this process's torch threads on `matmul_probe`, as many rounds as fit in
    `seconds` after one warm-up round: the ceiling MFU is measured against."""
    run, flops = matmul_probe(shape, rows, dtype)
    run()
    rounds, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run()
        rounds += 1
    return rounds * flops / (time.perf_counter() - start)
