"""Loading the policy: any Hub id or local folder, or the embedded SmolLM2 from PyPI (where the
files come from, the embedded model's conversion: grpo/common/model_files.py)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo.common.model_files import DTYPES, resolve_model_path
from grpo.common.sources import EMBEDDED_MODELS, ModelError
from grpo.data.images import ImageReader, has_images
from grpo.model.vision import SUPPORTED_MODEL_TYPES
from grpo.settings import ALL_LINEAR

if TYPE_CHECKING:
    from grpo.settings import Config, ModelConfig

log = logging.getLogger(__name__)

TEMPLATES = {"chatml-tools": Path(__file__).parent / "templates" / "chatml_tools.jinja"}  # model.chat_template


def read_chat_template(name: str) -> str:
    """model.chat_template: a shipped template's name or a Jinja file; ModelError when neither."""
    path = TEMPLATES.get(name, Path(name))
    if not path.is_file():
        raise ModelError(f"model.chat_template: {name!r} is neither a template file nor a shipped template "
                         f"({', '.join(TEMPLATES)})")
    return path.read_text()


def load_tokenizer(model_cfg, chat_template_kwargs: dict | None = None):
    """The model's tokenizer; its chat template (model.chat_template, else the checkpoint's) renders every
    chat with `chat_template_kwargs` too (data.chat_template_kwargs: e.g. Qwen3's enable_thinking), the
    prompts and an episode's turns alike."""
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
    if chat_template_kwargs:
        tokenizer.apply_chat_template = functools.partial(tokenizer.apply_chat_template, **chat_template_kwargs)
    return tokenizer


def serves_images(config) -> bool:
    """Whether a checkpoint's config is a vision-language model of a family the log-prob passes serve with images
    (grpo/model/vision.py)."""
    return getattr(config, "vision_config", None) is not None and config.model_type in SUPPORTED_MODEL_TYPES


def model_class(path, model_cfg):
    """AutoModelForCausalLM, or for a vision-language model of a family the log-prob passes serve with images
    (grpo/model/vision.py) the image-text class."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError):  # the load below says what is wrong with the folder
        return AutoModelForCausalLM
    # another multimodal checkpoint trains on text as before (with images, load_processor refuses it)
    return AutoModelForImageTextToText if serves_images(config) else AutoModelForCausalLM


def load_processor(model_cfg, data_cfg, tokenizer):
    """How the model reads images (data/images.py ImageReader: its image processor, its placeholder token and merge
    size) where the data has images (data.image_column, data.path=shapes), else None; ModelError for a model that
    cannot."""
    if not has_images(data_cfg):
        return None
    from transformers import AutoConfig, AutoImageProcessor

    path = resolve_model_path(model_cfg.name_or_path, model_cfg.cache_dir)
    config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    if not serves_images(config):
        raise ModelError(f"the data has images, and '{model_cfg.name_or_path}' ({config.model_type}) is not a "
                         f"vision-language model the log-prob passes serve ({', '.join(SUPPORTED_MODEL_TYPES)})")
    try:
        image_processor = AutoImageProcessor.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(f"'{model_cfg.name_or_path}' has no image processor (preprocessor_config.json): {e}") from None
    return ImageReader(image_processor, tokenizer.convert_ids_to_tokens(config.image_token_id),
                       config.vision_config.spatial_merge_size)


def load_model(model_cfg, device: str | torch.device = "cpu"):
    """The base causal LM (or vision-language model) in the configured dtype, attention kernel and checkpointing
    mode."""
    path = resolve_model_path(model_cfg.name_or_path, model_cfg.cache_dir)
    auto = model_class(path, model_cfg)
    try:
        model = auto.from_pretrained(
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


def load_teacher(cfg: Config, tokenizer, device: str | torch.device = "cpu", vocab_size: int | None = None):
    """distill.teacher's model (eval mode, in the sampler's dtype), refused unless its tokenizer is the
    model's (the teacher scores the model's token ids, which must mean the same text to both) and its head
    covers every id the model can sample (`vocab_size`, the model's; default the tokenizer's)."""

    teacher_cfg = check_teacher_tokenizer(cfg, tokenizer)
    teacher = load_model(teacher_cfg, device).eval()
    needed = vocab_size or len(tokenizer)
    if teacher.config.vocab_size < needed:
        raise ModelError(f"distill.teacher={cfg.distill.teacher} has {teacher.config.vocab_size} output tokens, "
                         f"fewer than the {needed} the model can sample")
    return teacher


def check_teacher_tokenizer(cfg: Config, tokenizer) -> ModelConfig:
    """distill.teacher's model settings, once its tokenizer is found to be the model's: ModelError naming the
    first difference otherwise (the teacher scores the model's token ids, in the sampler or on its server)."""
    teacher_cfg = dataclasses.replace(cfg.model, name_or_path=cfg.distill.teacher, gradient_checkpointing=False,
                                      dtype=cfg.sampler_dtype, chat_template=None)
    problem = tokenizer_difference(tokenizer, load_tokenizer(teacher_cfg))
    if problem:
        raise ModelError(f"distill.teacher={cfg.distill.teacher} does not share the tokenizer of "
                         f"model.name_or_path={cfg.model.name_or_path}: {problem}. The teacher scores the model's "
                         "tokens, so both need one tokenizer (a teacher of the same family, e.g. Qwen3-8B for "
                         "Qwen3-0.6B).")
    return teacher_cfg


def tokenizer_difference(student, teacher) -> str:
    """Where two tokenizers differ on what the ids mean ("" nowhere): the vocabulary and EOS."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        if len(a) != len(b):
            return f"its vocabulary has {len(b)} tokens, the model's {len(a)}"
        token = min((t for t in a.keys() ^ b.keys() | {t for t in a.keys() & b.keys() if a[t] != b[t]}),
                    key=lambda t: a.get(t, b.get(t)))
        return f"token {token!r} is id {b.get(token)} in it, {a.get(token)} in the model's"
    if student.eos_token_id != teacher.eos_token_id:
        return f"its end-of-sequence id is {teacher.eos_token_id}, the model's {student.eos_token_id}"
    return ""


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


def add_lora(model, lora_cfg, train_vision: bool = False):
    """Wrap `model` in a PEFT LoRA adapter; only the adapter's parameters are trainable. A vision-language model's
    vision encoder stays as it is, or with `train_vision` (model.train_vision) gets LoRA on each of its linear
    layers, whatever lora.target_modules names."""
    import peft

    vision = getattr(model.config, "vision_config", None) is not None
    targets = target_modules_of(lora_cfg)
    if vision and train_vision and targets != ALL_LINEAR:  # all-linear takes the encoder's layers already
        targets = [*targets, *vision_linear_names(model)]
    config = peft.LoraConfig(  # no dropout: a token's log-prob is one function of the weights in both processes
        r=lora_cfg.r, lora_alpha=lora_cfg.alpha, lora_dropout=0.0, target_modules=targets,
        use_rslora=lora_cfg.use_rslora, use_dora=lora_cfg.use_dora,
        modules_to_save=list(lora_cfg.modules_to_save) or None, task_type="CAUSAL_LM",
        exclude_modules=r".*visual.*" if vision and not train_vision else None,
    )
    try:
        return peft.get_peft_model(model, config)
    except ValueError as e:
        raise ModelError(f"lora.target_modules {lora_cfg.target_modules} do not fit this model: {e}") from None


def vision_linear_names(model) -> list[str]:
    """The full names of the linear layers of a vision-language model's vision encoder (its `visual` module)."""
    return [name for name, module in model.named_modules()
            if ".visual." in f".{name}" and isinstance(module, torch.nn.Linear)]


def target_modules_of(lora_cfg) -> list[str] | str:
    """lora.target_modules as PEFT takes it: the names, or "all-linear" (also given as [all-linear])."""
    targets = lora_cfg.target_modules
    return ALL_LINEAR if targets in (ALL_LINEAR, [ALL_LINEAR]) else list(targets)


def load_policy(cfg: Config, device: str | torch.device = "cpu"):
    """The trainable policy: the base model, wrapped in LoRA when `lora.enabled`."""
    model = load_model(cfg.model, device)
    if cfg.lora.enabled:
        return add_lora(model, cfg.lora, cfg.model.train_vision)
    for name, p in model.named_parameters():  # a full fine-tune of a vision-language model: its vision encoder
        if ".visual." in f".{name}" and not cfg.model.train_vision:  # frozen unless model.train_vision
            p.requires_grad_(False)
    return model


def unwrap_causal_lm(model):
    """The transformers *ForCausalLM inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


