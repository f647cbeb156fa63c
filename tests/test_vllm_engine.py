"""The optional vLLM engine: a clear error without vLLM here; real checks where vLLM and a GPU exist."""

import importlib.util

import pytest
import torch

from grpo.config import load_config
from grpo.logprobs import completion_logprobs
from grpo.sampler_step import make_engine

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_selecting_vllm_without_it_says_how_to_install():
    with pytest.raises(RuntimeError, match="sampling.engine=vllm needs vLLM: .venv/bin/pip install -r requirements-vllm.txt"):
        make_engine(load_config(None, ["sampling.engine=vllm"]), model=None, tokenizer=None)


@pytest.mark.skipif(not (HAVE_VLLM and torch.cuda.is_available()), reason="needs vLLM and a GPU")
def test_vllm_rollouts_are_prompt_major_and_match_recomputed_logps(tiny_model_dir):
    from transformers import AutoTokenizer

    from grpo.models import add_lora, load_model

    # temperature 1: vLLM may report raw (un-tempered) log-probs depending on its logprobs mode
    cfg = load_config(None, [f"model.name_or_path={tiny_model_dir}", "sampling.max_new_tokens=8", "lora.r=4",
                             "sampling.temperature=1.0"])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = make_engine(cfg, None, tokenizer)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    rollouts = engine.generate(prompts, 3, seed=0)
    assert len(rollouts.completion_ids) == 6 and len(rollouts.logps) == 6
    model = add_lora(load_model(cfg.model, "cuda"), cfg.lora).eval()
    with torch.no_grad():
        ours = completion_logprobs(model, [torch.tensor(p) for p in prompts], rollouts.completion_ids, [3, 3],
                                   temperature=cfg.sampling.temperature)
    for a, b in zip(rollouts.logps, ours):
        assert (a - b.cpu()).abs().max() < 0.05  # different kernels: close, not equal
