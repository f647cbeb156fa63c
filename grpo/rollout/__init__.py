"""Rollout engines: `hf` (transformers generate, any device) and `vllm` (GPU, optional)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Rollouts:
    """G completions per prompt, prompt-major, cut after the first EOS."""

    completion_ids: list[torch.Tensor]  # N x int64 [C_j]
    truncated: list[bool]  # [N]: hit max_new_tokens without EOS
    engine_logps: list[torch.Tensor] | None = None  # the engine's own sampled log-probs (vLLM), if any


def make_engine(cfg, model, tokenizer):
    """The configured rollout engine; vLLM is imported only when selected."""
    if cfg.sampling.engine == "vllm":
        from grpo.rollout.vllm_engine import VllmEngine

        return VllmEngine(cfg, tokenizer)
    from grpo.rollout.hf_engine import HFEngine

    return HFEngine(model, tokenizer, cfg.sampling)
