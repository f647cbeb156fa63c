"""The LoRA settings practitioners know (lora.target_modules: all-linear, use_rslora, use_dora,
modules_to_save): passed to PEFT, published, hot-swapped into the sampler's copy, exported and
merged, and refused at start where the vLLM engine cannot serve them."""

import math

import pytest
import torch
from conftest import tiny_model

from grpo.commands.export import export
from grpo.config import ConfigError, LoraConfig, load_config, save_config
from grpo.model.loading import add_lora, load_model
from grpo.weights.folder import WeightWatcher, publish, stager_for_model

PROJECTIONS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
EVERYTHING = LoraConfig(r=4, alpha=8, target_modules="all-linear", use_rslora=True, use_dora=True,
                        modules_to_save=["lm_head"])


def trained(model, seed: int):
    """Every trainable tensor moved away from its start (lora_B starts at 0, DoRA's magnitude at the norms)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def logits(model, ids=torch.tensor([[3, 7, 11, 19, 23, 5]])):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_all_linear_adapts_every_linear_layer_but_the_output_head():
    model = add_lora(tiny_model(), LoraConfig(r=4, alpha=8, target_modules="all-linear"))
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == PROJECTIONS
    assert sum(hasattr(m, "lora_A") for m in model.modules()) == 2 * len(PROJECTIONS)  # both layers
    assert not [n for n, p in model.named_parameters() if p.requires_grad and "lm_head" in n]
    as_list = add_lora(tiny_model(), LoraConfig(r=4, alpha=8, target_modules=["all-linear"]))
    assert sum(hasattr(m, "lora_A") for m in as_list.modules()) == 2 * len(PROJECTIONS)


def test_rslora_scales_the_update_by_alpha_over_the_root_of_r():
    """r=4, alpha=8: the update is scaled by 8 / sqrt(4) = 4, twice plain LoRA's 8 / 4 = 2, so the
    same adapter weights move the output twice as far."""
    plain = trained(add_lora(tiny_model(), LoraConfig(r=4, alpha=8, target_modules=["q_proj"])), seed=1)
    rs = add_lora(tiny_model(), LoraConfig(r=4, alpha=8, target_modules=["q_proj"], use_rslora=True))
    rs.load_state_dict(plain.state_dict())
    q_plain = plain.base_model.model.model.layers[0].self_attn.q_proj
    q_rs = rs.base_model.model.model.layers[0].self_attn.q_proj
    assert (q_plain.scaling["default"], q_rs.scaling["default"]) == (2.0, 8 / math.sqrt(4))
    x = torch.randn(3, 32)
    with torch.no_grad():
        base = q_plain.base_layer(x)
        assert torch.allclose(q_rs(x) - base, 2 * (q_plain(x) - base), atol=1e-6)


def test_dora_and_whole_modules_publish_hot_swap_and_leave_the_reference_the_base():
    """An adapter with every setting on: the sampler's copy loads the published version and gives the
    trainer's logits exactly; with the adapter off (the reference) both give the base model's."""
    model = trained(add_lora(tiny_model(seed=0), EVERYTHING), seed=2)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any("lora_magnitude_vector" in n for n in names) and any("modules_to_save" in n for n in names)
    live = add_lora(tiny_model(seed=0), EVERYTHING)
    assert not torch.equal(logits(live), logits(model))
    return_to = logits(tiny_model(seed=0))
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        publish(model, root, version=1, step=1)
        watcher = WeightWatcher(root, [stager_for_model(live)])
        assert watcher.poll().loaded and watcher.version == 1
    assert torch.equal(logits(live), logits(model))
    for copy in (model, live):
        with copy.disable_adapter():
            assert torch.allclose(logits(copy), return_to, atol=1e-6)


def test_an_adapter_with_every_setting_exports_and_merges_to_the_trained_logits(tmp_path, tiny_model_dir):
    run = tmp_path / "runs" / "everything"
    lora = ["lora.r=4", "lora.alpha=8", "lora.target_modules=all-linear", "lora.use_rslora=true",
            "lora.use_dora=true", "lora.modules_to_save=[lm_head]"]
    cfg = load_config(None, [f"run.dir={run}", f"model.name_or_path={tiny_model_dir}", *lora,
                             "data.chat_template_kwargs={enable_thinking: false}"])
    save_config(cfg, run / "config.yaml")
    model = trained(add_lora(load_model(cfg.model), cfg.lora).eval(), seed=3)
    publish(model, run / "weights", version=1, step=1)
    summary = export(run, None, tmp_path / "merged", merge=True)
    assert summary["library"] == "transformers"
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in k or "modules_to_save" in k for k in merged.state_dict())
    assert torch.allclose(logits(merged), logits(model), atol=1e-4)
    card = (tmp_path / "merged" / "README.md").read_text()
    assert "r 4, alpha 8, on all-linear, rsLoRA, DoRA, lm_head trained whole" in card
    assert "add_generation_prompt=True, enable_thinking=False) + " in card  # rendered as in training


@pytest.mark.parametrize("setting", ["lora.use_dora=true", "lora.modules_to_save=[lm_head]"])
def test_what_vllm_cannot_serve_is_a_config_error_at_start(setting):
    with pytest.raises(ConfigError) as e:
        load_config(None, ["sampling.engine=vllm", setting])
    assert f"sampling.engine=vllm cannot serve an adapter with {setting.replace('[lm_head]', repr(['lm_head']))}" \
        in str(e.value)
    assert load_config(None, ["sampling.engine=vllm", "lora.use_rslora=true", "lora.target_modules=all-linear"])
