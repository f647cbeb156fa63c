"""Rollout engines behind one interface: `hf` (transformers generate, any device) and `vllm` (optional).

`RolloutEngine` is the sampler's only view of an engine: it generates with the weights it serves
(the HF engine with the sampler's own model, vLLM with its own copy) and says which published
version that is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

ENGINES = ("hf", "vllm")  # sampling.engine: grpo/rollout/hf_engine.py, grpo/rollout/vllm_engine.py


@dataclass
class Rollouts:
    """G completions per prompt, prompt-major, cut after the first EOS."""

    completion_ids: list[torch.Tensor]  # N x int64 [C_j]
    truncated: list[bool]  # [N]: hit max_new_tokens without EOS
    logps: list[torch.Tensor]  # N x float32 [C_j]: each sampled token's log-prob under the distribution it was drawn from


@runtime_checkable
class RolloutEngine(Protocol):
    version: int  # the published weights version it serves (0: the initial weights)
    weights_digest: str  # that version's manifest sha256 (grpo.weights.INITIAL_DIGEST for version 0)

    def generate(self, prompts: list[list[int]], group_size: int, *, seed: int | None = None,
                 greedy: bool = False) -> Rollouts:
        """`group_size` completions of each prompt (token ids), prompt-major, with their log-probs."""

    def load_weights(self, folder: Path, manifest: dict, version: int) -> None:
        """Serve a published version whose checksums were verified (`grpo.weights.verify`, which
        adds the manifest's "digest"); raise on failure and keep serving the old one."""

    def close(self) -> None:
        """Release the engine's processes and memory."""
