"""vLLM rollouts (optional: `make install-vllm` builds .venv-vllm; the CPU build without a GPU).

Prefix caching serves the G samples of a prompt from one prefill (n = G per request). Log-probs
are vLLM's "processed" ones: those of the distribution the token was drawn from, after
temperature, as the trainer computes them. The checkpoint's generation_config is ignored
(`generation_config="vllm"`): its repetition penalty or top-k would change the distribution
the tokens come from, as with the HF engine (grpo/sampler/rollout/hf_engine.py).

Weights are swapped without restarting the engine. LoRA: each load adds its own adapter, loaded
at once so that a bad adapter fails here and the previous one keeps serving, then the previous
one is removed. Its name and integer id count the engine's loads, not the version: the prefix
cache is keyed by them, and a trainer that resumes from an older checkpoint republishes a
version number with other weights, whose prompt KV must not be served from the cache. Full
fine-tuning: the version's safetensors are reloaded in place by the engine's workers (with the
tied output head's CPU kernel made again: grpo/sampler/rollout/vllm_worker.py), and the prefix cache is reset.

On the CPU, vLLM reserves `gpu_memory_utilization` of the *host's* memory at start; the engine
asks instead for a KV cache of `sampling.vllm_kv_cache_gb`, and says plainly when that does not
fit in the memory available.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from grpo.model.loading import resolve_model_path
from grpo.sampler.rollout import SEED_BLOCK, Rollouts, prompt_seeds
from grpo.wire.weights import INITIAL_DIGEST, Staged

if TYPE_CHECKING:
    from grpo.settings import Config

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
INSTALL_HINT = ("make install-vllm (it builds .venv-vllm, where scripts/launch.py runs a vllm sampler; by hand: "
                ".venv-vllm/bin/python sampling_worker.py sampling.engine=vllm)")


class VllmUnavailable(RuntimeError):
    """vLLM is not installed, or cannot serve this configuration."""


def engine_arguments(cfg: Config, cuda: bool, available_bytes: int) -> dict:
    """The keyword arguments of `vllm.LLM` for this run (a pure function, tested without vLLM)."""
    s = cfg.sampling
    if s.old_logps == "generation" and (s.top_p < 1 or s.top_k > 0):
        raise VllmUnavailable("sampling.engine=vllm records the log-probs of the top-p/top-k truncated distribution, "
                              "the trainer computes them over the full one: use sampling.old_logps=recompute with "
                              "top-p/top-k")
    args = dict(model=resolve_model_path(cfg.model.name_or_path, cfg.model.cache_dir), dtype=cfg.sampler_dtype,
                seed=cfg.seed, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                generation_config="vllm", max_model_len=cfg.data.max_prompt_tokens + s.max_new_tokens,
                trust_remote_code=cfg.model.trust_remote_code,
                worker_extension_cls="grpo.sampler.rollout.vllm_worker.PolicyReload")
    if cfg.lora.enabled:
        rank = next((r for r in LORA_RANKS if r >= cfg.lora.r), None)
        if rank is None:
            raise VllmUnavailable(f"lora.r={cfg.lora.r} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}")
        args.update(enable_lora=True, max_lora_rank=rank, max_loras=2)  # the serving version and the next
    if cuda:
        args["gpu_memory_utilization"] = s.vllm_gpu_memory_utilization
    else:
        kv_bytes = int(s.vllm_kv_cache_gb * 2**30)
        if kv_bytes > available_bytes // 2:
            raise VllmUnavailable(f"sampling.vllm_kv_cache_gb={s.vllm_kv_cache_gb:g} is more than half the memory "
                                  f"available ({available_bytes / 2**30:.1f} GiB): lower it")
        args["kv_cache_memory_bytes"] = kv_bytes
    return args


def cpu_threads_environment(allowed_cpus: list[int], threads: int, environ) -> dict[str, str]:
    """vLLM's CPU settings for as many threads as the sampler's torch has (the launcher's share of
    the cores). Left alone, vLLM binds one thread per physical core and keeps one core for its
    scheduler: on 2 vCPUs that is 1 thread, half of what the HF engine uses. A user's own
    VLLM_CPU_OMP_THREADS_BIND wins."""
    if "VLLM_CPU_OMP_THREADS_BIND" in environ:
        return {}
    cpus = allowed_cpus[:max(1, threads)]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


class VllmEngine:
    """The `RolloutEngine` on vLLM, with its own copy of the weights."""

    def __init__(self, cfg: Config, eos_ids: list[int]):
        try:
            import vllm
        except ImportError:
            raise VllmUnavailable(f"sampling.engine=vllm needs vLLM: {INSTALL_HINT}") from None
        import psutil

        self._vllm, self.cfg, self.eos_ids = vllm, cfg, list(eos_ids)
        if not torch.cuda.is_available():
            os.environ.update(cpu_threads_environment(sorted(os.sched_getaffinity(0)), torch.get_num_threads(),
                                                      os.environ))
        self.llm = vllm.LLM(**engine_arguments(cfg, torch.cuda.is_available(), psutil.virtual_memory().available))
        self.lora_request = None  # None: the base model (version 0, or a full fine-tune)
        self.adapter_loads = 0  # names and numbers each adapter load (see the module's docstring)
        self.version, self.weights_digest = 0, INITIAL_DIGEST

    def stage_weights(self, folder: Path, manifest: dict, version: int) -> Staged:
        """LoRA: the adapter is loaded now (a bad one fails here) and served from the commit on.
        Full weights are reloaded in place at the commit: nothing can hold them beside the served ones."""
        if manifest["kind"] == "lora":
            return self._stage_adapter(folder, manifest, version)

        def reload():
            self.llm.collective_rpc("reload_policy", kwargs={"weights_path": str(folder)})  # grpo/sampler/rollout/vllm_worker.py
            self.llm.reset_prefix_cache()  # its KV was computed with the old weights
            self.version, self.weights_digest = version, manifest["digest"]
        return Staged(reload)

    def load_weights(self, folder: Path, manifest: dict, version: int) -> None:
        self.stage_weights(folder, manifest, version).commit()

    def _stage_adapter(self, folder: Path, manifest: dict, version: int) -> Staged:
        from vllm.lora.request import LoRARequest

        if not self.cfg.lora.enabled:
            raise RuntimeError(f"{folder} is a LoRA adapter but lora.enabled is false")
        self.adapter_loads += 1
        request = LoRARequest(f"policy-v{version}-load{self.adapter_loads}", self.adapter_loads, str(folder))
        engine = self.llm.llm_engine
        if not engine.add_lora(request):  # loads it now: a bad adapter fails here, the old one still serves
            raise RuntimeError(f"vLLM could not load the adapter in {folder}")

        def serve():
            previous, self.lora_request = self.lora_request, request
            self.version, self.weights_digest = version, manifest["digest"]
            if previous is not None:
                engine.remove_lora(previous.lora_int_id)
        return Staged(serve, discard=lambda: engine.remove_lora(request.lora_int_id))

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm

    def generate(self, prompts: list[list[int]], group_size: int, *, seed: int | None = None,
                 greedy: bool = False, max_new_tokens: Sequence[int] | None = None) -> Rollouts:
        from vllm.inputs import TokensPrompt

        s = self.cfg.sampling
        if group_size > SEED_BLOCK:
            raise ValueError(f"group_size {group_size} is above {SEED_BLOCK}, the seeds one prompt's samples may take")
        seeds = [None] * len(prompts) if seed is None else prompt_seeds(seed, len(prompts))
        limits = list(max_new_tokens) if max_new_tokens is not None else [s.max_new_tokens] * len(prompts)
        params = [self._vllm.SamplingParams(
            n=group_size, temperature=0.0 if greedy else s.temperature, top_p=s.top_p, top_k=s.top_k or -1,
            max_tokens=limit, logprobs=0, seed=prompt_seed, stop_token_ids=self.eos_ids)
            for prompt_seed, limit in zip(seeds, limits)]  # one seed per prompt: grpo.sampler.rollout.prompt_seeds says why
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    lora_request=self.lora_request, use_tqdm=False)
        completions, truncated, logps = [], [], []
        for request in outputs:  # vLLM returns requests in prompt order: already prompt-major
            for sample in request.outputs:
                ids = list(sample.token_ids)
                completions.append(torch.tensor(ids, dtype=torch.long))
                truncated.append(sample.finish_reason == "length")
                logps.append(torch.tensor([step[t].logprob for step, t in zip(sample.logprobs, ids)],
                                          dtype=torch.float32))
        return Rollouts(completions, truncated, logps)
