"""vLLM rollouts (optional: `pip install -r requirements-vllm.txt`).

Prefix caching serves the G samples of a prompt from one prefill. Each published LoRA version
is served as its own LoRARequest (integer id = version + 1), so the prefix cache (keyed by
adapter) can never serve an older adapter's KV. Log-probs are vLLM's "processed" ones: those of
the distribution the token was drawn from (after temperature), the trainer's definition.

Full fine-tuning is not served by this engine yet; use sampling.engine=hf for full fine-tuning.
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpo.models import resolve_model_path
from grpo.rollout import Rollouts
from grpo.weights import INITIAL_DIGEST


class VllmEngine:
    """The `RolloutEngine` on vLLM, with its own copy of the base weights and the adapter per version."""

    def __init__(self, cfg, tokenizer):
        try:
            import vllm
        except ImportError:
            raise RuntimeError("sampling.engine=vllm needs vLLM: .venv/bin/pip install -r requirements-vllm.txt "
                               "(GPU only)") from None
        if not cfg.lora.enabled:
            raise RuntimeError("sampling.engine=vllm serves LoRA runs; use sampling.engine=hf for full fine-tuning")
        self._vllm, self.cfg, self.tokenizer = vllm, cfg, tokenizer
        self.llm = vllm.LLM(model=resolve_model_path(cfg.model.name_or_path, cfg.model.cache_dir),
                            dtype=cfg.model.dtype, enable_lora=True, max_lora_rank=cfg.lora.r,
                            enable_prefix_caching=True, seed=cfg.seed, logprobs_mode="processed_logprobs")
        self.lora_request = None  # None: the base model (version 0)
        self.version, self.weights_digest = 0, INITIAL_DIGEST

    def load_weights(self, folder: Path, manifest: dict, version: int) -> None:
        from vllm.lora.request import LoRARequest

        if manifest.get("kind") != "lora":
            raise RuntimeError(f"{folder} holds a full model; sampling.engine=vllm serves LoRA adapters only")
        self.lora_request = LoRARequest(f"policy-v{version}", version + 1, str(folder))
        self.version, self.weights_digest = version, manifest["digest"]

    def close(self) -> None:
        del self.llm

    def generate(self, prompts: list[list[int]], group_size: int, *, seed: int | None = None,
                 greedy: bool = False) -> Rollouts:
        from vllm.inputs import TokensPrompt

        s = self.cfg.sampling
        params = self._vllm.SamplingParams(
            n=group_size, temperature=0.0 if greedy else s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
            max_tokens=s.max_new_tokens, logprobs=0, seed=seed)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    lora_request=self.lora_request, use_tqdm=False)
        completions, truncated, logps = [], [], []
        for request in outputs:  # vLLM returns requests in prompt order: already prompt-major
            for sample in request.outputs:
                ids = list(sample.token_ids)
                completions.append(torch.tensor(ids, dtype=torch.long))
                truncated.append(sample.finish_reason == "length")
                logps.append(torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, ids)]))
        return Rollouts(completions, truncated, logps)
