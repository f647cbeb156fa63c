"""The arguments vLLM's engine starts with (grpo/sampler/rollout/vllm_engine.py): `engine_arguments`, the
keyword arguments of `vllm.LLM` for a run (a pure function, tested without vLLM), and the CPU build's
thread settings (`cpu_threads_environment`); `VllmUnavailable` when vLLM is not installed or cannot serve
the configuration. Importable without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo.common.model_files import resolve_model_path

if TYPE_CHECKING:
    from grpo.settings import Config

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM accepts
CPU_BATCHED_TOKENS = 4096  # the CPU build's own default budget of tokens per engine step
INSTALL_HINT = ("make install-vllm (it builds .venv-vllm, where grpo train runs a vllm sampler; by hand: "
                ".venv-vllm/bin/python sampling_worker.py sampling.engine=vllm)")


class VllmUnavailable(RuntimeError):
    """vLLM is not installed, or cannot serve this configuration."""


def engine_arguments(cfg: Config, cuda: bool, available_bytes: int) -> dict:
    """The keyword arguments of `vllm.LLM` for this run (a pure function, tested without vLLM)."""
    sampling = cfg.sampling
    processed = [name for name, on in (("top_p", sampling.top_p < 1), ("top_k", sampling.top_k > 0),
                                       ("min_p", sampling.min_p > 0), ("repetition_penalty",
                                                                       sampling.repetition_penalty != 1)) if on]
    if sampling.old_logps == "generation" and processed:
        raise VllmUnavailable(f"sampling.engine=vllm records the log-probs of the distribution {', '.join(processed)} "
                              "made, the trainer computes them over the full softmax(logits / T): use "
                              f"sampling.old_logps=recompute with sampling.{processed[0]}")
    args = dict(model=resolve_model_path(cfg.model.name_or_path, cfg.model.cache_dir), dtype=cfg.sampler_dtype,
                seed=cfg.seed, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                generation_config="vllm", max_model_len=cfg.data.max_prompt_tokens + sampling.max_new_tokens,
                trust_remote_code=cfg.model.trust_remote_code,
                worker_extension_cls="grpo.sampler.rollout.vllm_worker.PolicyReload", disable_log_stats=True)
    if cfg.lora.enabled:
        rank = next((r for r in LORA_RANKS if r >= cfg.lora.r), None)
        if rank is None:
            raise VllmUnavailable(f"lora.r={cfg.lora.r} is above vLLM's largest LoRA rank {LORA_RANKS[-1]}")
        args.update(enable_lora=True, max_lora_rank=rank, max_loras=2)  # the serving version and the next
    if cuda:
        args["gpu_memory_utilization"] = sampling.vllm.gpu_memory_utilization
    else:
        kv_bytes = int(sampling.vllm.kv_cache_gb * 2**30)
        if kv_bytes > available_bytes // 2:
            raise VllmUnavailable(f"sampling.vllm.kv_cache_gb={sampling.vllm.kv_cache_gb:g} is more than half the "
                                  f"memory available ({available_bytes / 2**30:.1f} GiB): lower it")
        args["kv_cache_memory_bytes"] = kv_bytes
        # whole prompts only: a seeded request whose prompt is split across steps makes the CPU build rewind
        # its generator, which CPU generators cannot do (the engine dies: "CPU Generator does not use offset")
        args.update(enable_chunked_prefill=False,
                    max_num_batched_tokens=max(args["max_model_len"], CPU_BATCHED_TOKENS))
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
