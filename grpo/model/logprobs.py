"""Per-token log-probabilities of completions, with the prompt computed once per group.

The decoder runs on packed rows (`grpo.model.shared_prefix`) or, on the plain path, on one padded
row per completion with its prompt repeated. Only the hidden states that predict completion
tokens go through the LM head, in chunks, so an [N, T, vocab] float32 tensor is never built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch
import torch.utils.checkpoint

from grpo.model.loading import unwrap_causal_lm
from grpo.model.segments import has_rows, join_rows, split_rows
from grpo.model.shared_prefix import NO_MASK, install_shared_prefix_attention, pack_groups
from grpo.model.vision import PromptImages, packed_inputs, plain_inputs, vision_language_model

if TYPE_CHECKING:
    from grpo.settings import Config


# A [chunk, vocab] float32 logits block under glibc's largest mmap threshold (32 MiB): freed, it
# goes back to the heap and the next chunk reuses it. 1,024-row blocks (200 MB at a 49k vocab)
# were mapped and unmapped each time; the page faults cost the trainer ~10% of its step in the
# kernel (scripts/benchmarks/bench_trainer.py: 128 rows, 0.92x the step time, 0.61 s kernel time, not 5.1).
HEAD_CHUNK_BYTES = 24 * 2**20
MIN_HEAD_CHUNK_TOKENS = 32  # huge vocabularies: keep the head's matmul a matrix, not a vector


def head_chunk_tokens(vocab_size: int) -> int:
    """Rows of logits computed at once: 128 at SmolLM2's 49,152-token vocabulary."""
    return max(MIN_HEAD_CHUNK_TOKENS, HEAD_CHUNK_BYTES // (4 * vocab_size) // 32 * 32)


DEFAULT_MAX_TOKENS_PER_FORWARD = 8192


def _head_chunk(hidden, targets, head, temperature, with_entropy):
    linear = getattr(head, "bias", None) is None  # Llama / Qwen heads: head(h / T) == head(h) / T
    if temperature != 1.0 and linear:
        hidden = hidden / temperature  # scale [M, H] rather than the [M, V] logits: one pass fewer over V
    logits = head(hidden)  # [M, V]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # softmax in >= float32
    if temperature != 1.0 and not linear:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # [M]
    logps = logits.gather(-1, targets[:, None]).squeeze(-1) - lse  # [M]; no [M, V] log_softmax kept
    if not with_entropy:
        return logps, None
    with torch.set_grad_enabled(with_entropy == "grad" and torch.is_grad_enabled()):  # else a metric: no graph
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [M]
    return logps, entropy


def head_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float = 1.0,
                  chunk_tokens: int | None = None, with_entropy: bool = True):
    """log softmax(head(hidden) / temperature)[target] and the entropy; hidden [M, H], targets [M].

    Under grad each chunk is checkpointed: backward recomputes that chunk's logits instead of
    keeping every chunk's [chunk, V] softmax alive. Entropy is a metric (no grad); None when
    not asked for; with_entropy="grad" makes it differentiable (an entropy bonus in the loss).
    """
    logps, entropies = [], []
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    chunk_tokens = chunk_tokens or head_chunk_tokens(head.out_features)  # not weight.shape: empty under ZeRO-3
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens]
        if recompute:
            lp, ent = torch.utils.checkpoint.checkpoint(_head_chunk, h, t, head, temperature, with_entropy,
                                                        use_reentrant=False)
        else:
            lp, ent = _head_chunk(h, t, head, temperature, with_entropy)
        logps.append(lp)
        entropies.append(ent)
    return torch.cat(logps), (torch.cat(entropies) if with_entropy else None)  # [M], [M]


def _split(values: torch.Tensor | None, lens: list[int]):
    return values.split(lens) if values is not None else [None] * len(lens)


def _check_inputs(prompt_ids, completion_ids, group_sizes) -> list[int]:
    sizes = [int(g) for g in group_sizes]
    if len(sizes) != len(prompt_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(sizes)} group sizes")
    if sum(sizes) != len(completion_ids):
        raise ValueError(f"group sizes sum to {sum(sizes)} but there are {len(completion_ids)} completions")
    if any(len(c) == 0 for c in completion_ids) or any(len(p) == 0 for p in prompt_ids):
        raise ValueError("prompts and completions must hold at least one token")
    return sizes


def _model_parts(model):
    """(the *ForCausalLM, its decoder stack, its LM head) inside an optional PEFT wrapper."""
    causal_lm = unwrap_causal_lm(model)
    return causal_lm, causal_lm.get_decoder(), causal_lm.get_output_embeddings()


def _store(logps: list, entropies: list, indices: list[int], lp, ent, completion_ids) -> None:
    """Scatter one forward's flat per-token results back to their completions."""
    lens = [len(completion_ids[j]) for j in indices]
    for j, a, b in zip(indices, lp.split(lens), _split(ent, lens)):
        logps[j], entropies[j] = a, b


def _shared_prefix_logprobs(model, prompt_ids, completion_ids, sizes, temperature, max_tokens, with_entropy,
                            images=None):
    causal_lm, decoder, head = _model_parts(model)
    device = head.weight.device
    logps, entropies = [None] * len(completion_ids), [None] * len(completion_ids)
    install_shared_prefix_attention(causal_lm)
    vlm = vision_language_model(causal_lm) if images is not None else None
    for row in pack_groups(prompt_ids, completion_ids, sizes, max_tokens):
        inputs = dict(input_ids=row.input_ids[None].to(device), position_ids=row.position_ids[None].to(device))
        if vlm is not None:  # each group's prompt with its images' features, computed once, and M-RoPE positions
            embeddings, positions = packed_inputs(vlm, row.input_ids.to(device), row.position_ids.to(device),
                                                  row.groups, prompt_ids, images)
            inputs = dict(inputs_embeds=embeddings[None], position_ids=positions[:, None])
        hidden = decoder(**inputs, attention_mask=NO_MASK.to(device), use_cache=False,
                         shared_prefix_row=row).last_hidden_state[0]  # [L, H]
        lp, ent = head_logprobs(hidden[row.hidden_index.to(device)], row.targets.to(device), head, temperature,
                                with_entropy=with_entropy)
        _store(logps, entropies, row.completion_index, lp, ent, completion_ids)
    return logps, entropies


def _plain_rows(prompt_ids, completion_ids, sizes, max_tokens):
    """Batches of completion indices whose padded `[prompt | c_j]` rows fit `max_tokens`."""
    prompt_of = [i for i, g in enumerate(sizes) for _ in range(g)]
    batches, longest = [[]], 0
    for j, c in enumerate(completion_ids):
        length = len(prompt_ids[prompt_of[j]]) + len(c)
        if batches[-1] and max(longest, length) * (len(batches[-1]) + 1) > max_tokens:
            batches.append([])
            longest = 0
        batches[-1].append(j)
        longest = max(longest, length)
    return prompt_of, batches


def _plain_logprobs(model, prompt_ids, completion_ids, sizes, temperature, max_tokens, with_entropy, images=None):
    """The baseline: each completion in its own right-padded row with its prompt repeated (and its images, through
    the vision encoder for every row)."""
    causal_lm, decoder, head = _model_parts(model)
    vlm = vision_language_model(causal_lm) if images is not None else None
    device = head.weight.device
    logps, entropies = [None] * len(completion_ids), [None] * len(completion_ids)
    prompt_of, batches = _plain_rows(prompt_ids, completion_ids, sizes, max_tokens)
    for batch in batches:
        rows = [torch.cat([prompt_ids[prompt_of[j]], completion_ids[j]]) for j in batch]
        width = max(len(r) for r in rows)
        input_ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention_mask = torch.zeros(len(rows), width, dtype=torch.long)  # from lengths, never from pad ids
        for k, r in enumerate(rows):
            input_ids[k, :len(r)] = r
            attention_mask[k, :len(r)] = 1
        inputs = dict(input_ids=input_ids.to(device))
        if vlm is not None:  # each row's prompt with its images, its encoder run for every row
            embeddings, positions = plain_inputs(vlm, [prompt_ids[prompt_of[j]] for j in batch],
                                                 [completion_ids[j] for j in batch],
                                                 [images[prompt_of[j]] for j in batch], width)
            inputs = dict(inputs_embeds=embeddings, position_ids=positions)
        hidden = decoder(**inputs, attention_mask=attention_mask.to(device),
                         use_cache=False).last_hidden_state  # [n, width, H]
        select_row, select_pos, targets = [], [], []
        for k, j in enumerate(batch):
            P, C = len(prompt_ids[prompt_of[j]]), len(completion_ids[j])
            select_row.append(torch.full((C,), k))
            select_pos.append(torch.arange(P - 1, P + C - 1))
            targets.append(completion_ids[j])
        index = (torch.cat(select_row).to(device), torch.cat(select_pos).to(device))
        lp, ent = head_logprobs(hidden[index], torch.cat(targets).long().to(device), head, temperature,
                                with_entropy=with_entropy)
        _store(logps, entropies, batch, lp, ent, completion_ids)
    return logps, entropies


def unsupported_features(hf_config, shared_prefix: bool, max_tokens: int) -> list[str]:
    """What in a model's config the log-probs here would silently get wrong, one line each naming
    the field (empty: exact). The LM head is read directly (no final softcap, no logit scale),
    and the shared-prefix attention neither caps scores nor limits them to a window; a window at
    least `max_tokens` long (prompt + completion) changes nothing, so it is exact."""
    c = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    problems = []
    if getattr(c, "final_logit_softcapping", None) is not None:
        problems.append(f"final_logit_softcapping={c.final_logit_softcapping}: the logits are capped by tanh, "
                        "and the log-probs here read the LM head directly")
    if getattr(c, "logit_scale", None) not in (None, 1.0):
        problems.append(f"logit_scale={c.logit_scale}: the logits are scaled, and the log-probs here read the "
                        "LM head directly")
    if shared_prefix and getattr(c, "attn_logit_softcapping", None) is not None:
        problems.append(f"attn_logit_softcapping={c.attn_logit_softcapping}: the shared-prefix attention does not "
                        "cap its scores; set training.shared_prefix=false")
    window = getattr(c, "sliding_window", None)
    layer_types = getattr(c, "layer_types", None) or ["sliding_attention"]
    if shared_prefix and window is not None and window < max_tokens and "sliding_attention" in layer_types:
        problems.append(f"sliding_window={window} is shorter than data.max_prompt_tokens + sampling.max_new_tokens "
                        f"= {max_tokens}, and the shared-prefix attention sees every earlier token; set "
                        "training.shared_prefix=false or keep prompt + completion within the window")
    return problems


def check_supported(model, cfg: Config, name: str | None = None, trains: bool = False) -> None:
    """Refuse at start, in one line, a model whose log-probs `unsupported_features` would get wrong, or that
    `trains` where its attention has no backward; `name`: what the message calls it (default model.name_or_path)."""
    from grpo.common.sources import ModelError

    causal_lm = unwrap_causal_lm(model)
    problems = unsupported_features(causal_lm.config, cfg.training.shared_prefix,
                                    cfg.data.max_prompt_tokens + cfg.sampling.max_new_tokens)
    if trains and cfg.model.attn_implementation == "flex_attention" and causal_lm.device.type == "cpu":
        problems.append("torch's FlexAttention has no backward on the CPU (model.attn_implementation=flex_attention "
                        "is for GPUs); set model.attn_implementation=sdpa")
    if vision_language_model(causal_lm) is not None and cfg.deepspeed.zero_stage == 3:
        problems.append("deepspeed.zero_stage=3 partitions the vision encoder, and each rank runs it as often as its "
                        "share of prompts has images: the ranks would wait on each other; use zero_stage 0-2")
    if problems:
        raise ModelError(f"{name or cfg.model.name_or_path} ({causal_lm.config.model_type}) is not supported: "
                         + "; ".join(problems))


def completion_logprobs(model, prompt_ids: Sequence[torch.Tensor], completion_ids: Sequence[torch.Tensor],
                        group_sizes: Sequence[int], *, shared_prefix: bool = True, temperature: float = 1.0,
                        max_tokens_per_forward: int = DEFAULT_MAX_TOKENS_PER_FORWARD,
                        return_entropy: bool | str = False, segments: Sequence[torch.Tensor] | None = None,
                        images: Sequence[PromptImages | None] | None = None):
    """log p(c_j[t] | prompt_i, c_j[:t]) at `temperature`, one float32 tensor [C_j] per completion.

    prompt_ids: B unpadded int64 tensors; completion_ids: sum(group_sizes) tensors, prompt-major.
    Differentiable when grad is enabled. With `return_entropy`, also the per-token entropies (a metric,
    without grad; return_entropy="grad": differentiable too). `segments`: per completion, which of its rows each
    token is in (grpo/model/segments.py): each row is then read after the prompt alone. `images`: per prompt, its
    images (grpo/model/vision.py) or None, for a vision-language model.
    """
    sizes = _check_inputs(prompt_ids, completion_ids, group_sizes)
    counts = None
    if has_rows(segments):
        completion_ids, sizes, counts = split_rows(completion_ids, sizes, segments)
    compute = _shared_prefix_logprobs if shared_prefix else _plain_logprobs
    if images is not None and len(images) != len(prompt_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(images)} prompts' images")
    if images is not None and any(i is not None for i in images) and \
            vision_language_model(unwrap_causal_lm(model)) is None:
        raise ValueError("prompts with images, and a model without a vision encoder: its log-probs would ignore them")
    logps, entropies = compute(model, list(prompt_ids), list(completion_ids), sizes, temperature,
                               max_tokens_per_forward, return_entropy, images=images)
    if counts is not None:
        logps, entropies = join_rows(logps, counts), join_rows(entropies, counts) if return_entropy else entropies
    return (logps, entropies) if return_entropy else logps


def pad_right(tensors: Sequence[torch.Tensor], value: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged [C_j] tensors -> (padded [N, T], bool mask [N, T]); differentiable."""
    width = max((len(t) for t in tensors), default=0)
    padded = torch.nn.utils.rnn.pad_sequence(list(tensors), batch_first=True, padding_value=value) \
        if tensors else torch.zeros(0, 0)
    lengths = torch.tensor([len(t) for t in tensors])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return padded, mask.to(padded.device)


class SharedPrefixMismatch(RuntimeError):
    """The shared-prefix forward disagrees with the plain forward on this model."""


# Rounding noise of the plain path itself is ~2e-5 (float32, 30 layers) and ~5e-2 (bfloat16);
# a wrong mask or position moves log-probs by whole units.
VERIFY_TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-8, torch.bfloat16: 0.25, torch.float16: 0.25}


def verify_shared_prefix(model, prompt_ids, completion_ids, group_sizes, *, temperature: float = 1.0,
                         max_groups: int = 2, segments: Sequence[torch.Tensor] | None = None,
                         images: Sequence[PromptImages | None] | None = None) -> float:
    """Compare the shared and the plain path on the first `max_groups` groups; raise on a mismatch.

    Behind `training.verify_shared_prefix`: a model whose attention the hook cannot serve
    (a custom attention, sliding windows shorter than the row, ...) stops the run here
    instead of training on wrong numbers. Returns the max |difference|.
    """
    sizes = [int(g) for g in group_sizes][:max_groups]
    prompts, completions = list(prompt_ids)[:len(sizes)], list(completion_ids)[:sum(sizes)]
    with torch.no_grad():
        kwargs = dict(temperature=temperature, segments=None if segments is None else list(segments)[:sum(sizes)],
                      images=None if images is None else list(images)[:len(sizes)])
        shared = completion_logprobs(model, prompts, completions, sizes, **kwargs)
        plain = completion_logprobs(model, prompts, completions, sizes, shared_prefix=False, **kwargs)
    diff = max((a - b).abs().max().item() for a, b in zip(shared, plain))
    dtype = _model_parts(model)[2].weight.dtype
    tolerance = VERIFY_TOLERANCE.get(dtype, 1e-3)
    if not diff <= tolerance:
        raise SharedPrefixMismatch(
            f"shared-prefix log-probs differ from the plain forward by {diff:.3g} (tolerance {tolerance:g} for "
            f"{dtype}) on {len(sizes)} groups: this model's attention is not served correctly by the shared-prefix "
            "hook. Set training.shared_prefix=false to use the plain forward")
    return diff
