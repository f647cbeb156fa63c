"""Shared fixtures: offline Hugging Face, tiny random models, the real GSM8K and SmolLM2."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may load from the Hub in tests
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"


def tiny_model(kind: str = "llama", seed: int = 0, dtype=torch.float32, vocab_size: int = 101):
    """A random 2-layer decoder (GQA: 4 query heads, 2 key/value heads) built from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    config_cls, model_cls = classes[kind]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        eos_token_id=1, pad_token_id=0, bos_token_id=2, tie_word_embeddings=False,
                        attn_implementation="sdpa")
    return model_cls(config).to(dtype).eval()


@pytest.fixture
def shared_gsm8k() -> Path:
    if not (SHARED_GSM8K / "train.jsonl").is_file():
        pytest.skip("../shared/data/gsm8k is not present")
    return SHARED_GSM8K


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, float32, eval mode."""
    from grpo.config import ModelConfig
    from grpo.models import load_model, load_tokenizer

    cfg = ModelConfig()
    return load_model(cfg).eval(), load_tokenizer(cfg)
