"""vLLM rollouts (GPU, optional: `pip install -r requirements-vllm.txt`).

Prefix caching serves the G samples of a prompt from one prefill. Each published LoRA version
is loaded as a LoRARequest under a new name and id, so the prefix cache (keyed by adapter)
can never serve an older adapter's KV. vLLM's own sampled log-probs are kept so the sampler
can report their gap to the recomputed old log-probs.

Full fine-tuning is not served by this engine (vLLM's in-place weight reload API differs
between releases); use sampling.engine=hf for full fine-tuning.
"""

from __future__ import annotations

import torch

from grpo.models import resolve_model_path
from grpo.rollout import Rollouts


class VllmEngine:
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
                            enable_prefix_caching=True, seed=cfg.seed)
        self.lora_request = None  # None: the base model (version 0)

    def load_adapter(self, folder, version: int) -> None:
        from vllm.lora.request import LoRARequest

        self.lora_request = LoRARequest(f"policy-v{version}", version + 1, str(folder))

    def generate(self, prompts: list[list[int]], group_size: int, *, greedy: bool = False,
                 seed: int | None = None) -> Rollouts:
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
        return Rollouts(completions, truncated, engine_logps=logps)
