"""Rollout engines behind one interface: `hf` (a transformers model, any device) and `vllm` (optional).

`RolloutEngine` is the sampler's only view of an engine: it generates with the weights it serves
(the HF engine with the sampler's own model, vLLM with its own copy) and says which published
version that is.
"""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

import torch

if TYPE_CHECKING:
    from grpo.weights.folder import Staged

# sampling.engine: each name's RolloutEngine class, imported only when chosen. An engine is one module
# with a class that has `build(cfg, model, tokenizer)` and the RolloutEngine interface, and one line
# here; its settings, if any, are the section sampling.<name> (a `python` key there runs the sampler
# with that Python: an engine in an environment of its own).
ENGINES = {"hf": "grpo.sampler.rollout.hf_engine:HFEngine", "vllm": "grpo.sampler.rollout.vllm_engine:VllmEngine"}
SEED_BLOCK = 1 << 20  # seeds a prompt's samples may take: vLLM seeds sample j of a request with seed + j


def prompt_seeds(seed: int, num_prompts: int) -> list[int]:
    """A seed per prompt of one generate call, hashed from the call's seed and the prompt's index,
    each the first of its own block of SEED_BLOCK seeds (below 2**63).

    One seed for a whole call would give sample j of every prompt the same noise (vLLM seeds the
    j-th sample with seed + j), and calls whose seeds differ by one would share G - 1 streams.
    Hashed blocks of 2**20 in 2**63 make two prompts' blocks meet with chance ~ n**2 / 2**44 for n
    prompts in a whole run."""
    seeds = []
    for i in range(num_prompts):
        digest = hashlib.sha256(f"{seed}/{i}".encode()).digest()
        seeds.append((int.from_bytes(digest[:8], "big") >> 1) // SEED_BLOCK * SEED_BLOCK)
    return seeds


@dataclass
class Rollouts:
    """G completions per prompt, prompt-major, cut after the first EOS."""

    completion_ids: list[torch.Tensor]  # N x int64 [C_j]
    truncated: list[bool]  # [N]: hit max_new_tokens without EOS
    # N x float32 [C_j]: each sampled token's log-prob under the distribution it was drawn from
    logps: list[torch.Tensor]
    # N x bool [C_j]: the model's tokens, in episodes (grpo/sampler/episodes.py)
    model_masks: list[torch.Tensor] | None = None
    # N x int32 [C_j]: the weights version that drew each token, where it may differ within a completion
    # (sampling.in_flight_updates); None: all drawn by the version served when the call started
    token_versions: list[torch.Tensor] | None = None
    # N x int32 [C_j]: which of its rows each token is in (an agent's session: grpo/model/segments.py); None: one row
    segments: list[torch.Tensor] | None = None


@runtime_checkable
class RolloutEngine(Protocol):
    version: int  # the published weights version it serves (0: the initial weights)
    weights_digest: str  # that version's manifest sha256 (grpo.weights.folder.INITIAL_DIGEST for version 0)
    # True: it generates with the sampler's scoring model itself, so a new version is loaded once;
    # False: it holds its own copy, and the scoring model takes each version with it
    generates_with_scoring_model: bool

    @classmethod
    def build(cls, cfg, model, tokenizer) -> RolloutEngine:
        """The engine for the run's config, on the sampler's scoring `model` and `tokenizer`."""

    def generate(self, prompts: list[list[int]], group_size: int, *, seed: int | None = None,
                 greedy: bool = False, max_new_tokens: Sequence[int] | None = None) -> Rollouts:
        """`group_size` completions of each prompt (token ids), prompt-major, with their log-probs;
        prompt i's at most `max_new_tokens[i]` long (default: sampling.max_new_tokens each)."""

    def stage_weights(self, folder: Path, manifest: dict, version: int) -> Staged:
        """Read and check a published version whose checksums were verified (`grpo.weights.folder.verify`,
        which adds the manifest's "digest"), raising if it cannot be served; serve it from the
        returned `grpo.weights.folder.Staged`'s commit on (the watcher commits once every copy staged it)."""

    def load_weights(self, folder: Path, manifest: dict, version: int) -> None:
        """Stage and commit at once (one copy of the weights: tests, scripts)."""

    def close(self) -> None:
        """Release the engine's processes and memory."""


def make_engine(cfg, model, tokenizer) -> RolloutEngine:
    """The configured rollout engine (sampling.engine), its module imported only now."""
    module, _, name = ENGINES[cfg.sampling.engine].partition(":")
    return getattr(importlib.import_module(module), name).build(cfg, model, tokenizer)
