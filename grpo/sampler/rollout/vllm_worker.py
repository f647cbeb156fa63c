"""Code that runs inside vLLM's workers (`worker_extension_cls`): its methods are called by name
through `LLM.collective_rpc`, as TRL's weight-sync extension is, so nothing is pickled across.

Importable without vLLM: vLLM mixes the class into its worker, which supplies `reload_weights`
and `model_runner`.
"""

from __future__ import annotations


class PolicyReload:
    """Full fine-tuning: a published version's weights reloaded in place."""

    def reload_policy(self, weights_path: str) -> None:
        """vLLM's in-place reload, then the tied output head's CPU kernel made again. On the CPU,
        vLLM prepares each linear layer's oneDNN kernel from its weight once; the in-place reload
        prepares it again for the layers it loads, but an output head tied to the input
        embeddings (SmolLM2, Qwen2.5-0.5B) is not in the checkpoint, so its kernel kept computing
        with the old embeddings (log-probs off by up to 0.15 after one step, measured)."""
        self.reload_weights(weights_path=weights_path)
        head = getattr(self.model_runner.get_model(), "lm_head", None)
        if head is not None and hasattr(head, "cpu_linear"):  # the CPU build's kernel, from the weight as it is now
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(head, remove_weight=False)
