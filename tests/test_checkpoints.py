"""What a checkpoint records to be resumed safely: the base model a LoRA adapter was trained on, the
ranks a ZeRO checkpoint was split over; and that a LoRA checkpoint leaves the frozen base out."""

import pytest
import torch
from conftest import tiny_model

from grpo.config import LoraConfig, load_config
from grpo.model.loading import add_lora
from grpo.trainer.saving import (
    CheckpointMismatch,
    base_fingerprint,
    check_base,
    check_resumable,
    frozen_names,
    load_trainable,
)


def lora(seed: int = 0):
    return add_lora(tiny_model("qwen2", seed=seed), LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"]))


def test_the_base_fingerprint_tells_another_base_model_and_not_another_adapter():
    first, same_base, other_base = lora(0), lora(0), lora(1)
    with torch.no_grad():
        for name, p in same_base.named_parameters():
            if "lora_" in name:
                p.add_(1.0)  # trained further: the adapter moves, the base does not
    assert base_fingerprint(first) == base_fingerprint(same_base) != base_fingerprint(other_base)
    assert base_fingerprint(tiny_model("qwen2")) == ""  # a full fine-tune: nothing frozen to record
    cfg = load_config(None, ["model.name_or_path=/models/base"])
    check_base(base_fingerprint(first), base_fingerprint(same_base), cfg.model)
    check_base(None, base_fingerprint(other_base), cfg.model)  # a checkpoint that records none
    with pytest.raises(CheckpointMismatch, match=r"^the checkpoint's LoRA adapter was trained on another base model "
                                                 r"than model.name_or_path=/models/base loads now"):
        check_base(base_fingerprint(first), base_fingerprint(other_base), cfg.model)


def test_a_zero_checkpoint_of_other_ranks_is_refused_before_loading(tmp_path):
    (tmp_path / "latest").write_text("step000004")
    (tmp_path / "step000004").mkdir()
    for rank in (0, 1):
        (tmp_path / "step000004" / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
    cfg = load_config(None, ["deepspeed.zero_stage=2"])
    check_resumable(tmp_path, cfg.deepspeed, 2)
    with pytest.raises(CheckpointMismatch) as refused:
        check_resumable(tmp_path, cfg.deepspeed, 1)
    assert str(refused.value) == (f"the checkpoint {tmp_path / 'step000004'} was written by 2 trainer ranks "
                                  "(deepspeed.zero_stage=2 splits its optimizer state by rank) and this trainer has 1: "
                                  "start it with 2 ranks (launch.trainer_ranks=2), or start a new run")


def test_a_state_without_the_frozen_base_loads_and_one_of_another_adapter_is_refused():
    model, tied = lora(0), tiny_model("qwen2")
    tied.config.tie_word_embeddings = True
    tied.tie_weights()
    names = frozen_names(add_lora(tied, LoraConfig(r=4, alpha=8, target_modules=["q_proj"])))
    assert {"base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"} <= names  # both names
    trained = {k: v for k, v in lora(3).state_dict().items() if "lora_" in k}
    load_trainable(trained, model)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in trained.items())
    other = {k: v for k, v in add_lora(tiny_model("qwen2"), LoraConfig(r=4, alpha=8, target_modules=["k_proj"])
                                       ).state_dict().items() if "lora_" in k}
    with pytest.raises(CheckpointMismatch,
                       match=r"does not hold this model's trained weights: 8 missing .*, 4 unexpected"):
        load_trainable(other, lora(0))
