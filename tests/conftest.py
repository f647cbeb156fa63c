"""Shared fixtures: offline Hugging Face, tiny random models, the real GSM8K (embedded) and SmolLM2."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may load from the Hub in tests
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

try:  # matplotlib (reasoning-gym imports it) lists the system's fonts with a subprocess the first time it is
    import matplotlib.font_manager  # noqa: E402,F401  imported on a machine: here, not inside a fast test
except ImportError:
    pass

REPO = Path(__file__).resolve().parents[1]
SHARED_GSM8K = REPO.parent / "shared" / "data" / "gsm8k"
PROCESS_CONFIG = REPO / "tests" / "process_config.yaml"  # what process tests run: not the shipped default run

# the files whose tests start no process or rank (but those marked slow in them): every other file's
# tests are slow; `pytest -m "not slow"` runs the rest in about a minute (tests/README.md)
FAST_FILES = {
    "test_advantages.py", "test_agent_bridge.py", "test_agent_history.py", "test_agent_messages.py",
    "test_agent_tokens.py", "test_architecture.py",
    "test_calculator.py", "test_codec.py", "test_config.py", "test_config_history.py", "test_data.py",
    "test_delivery.py", "test_distillation.py", "test_dynamic_sampling.py", "test_export.py", "test_flops.py",
    "test_generation_settings.py", "test_gpu_configs.py", "test_in_flight.py", "test_jail_relay.py",
    "test_kl_reward.py", "test_logprobs.py", "test_lora_settings.py", "test_losses.py", "test_mismatch.py",
    "test_mixture.py", "test_models.py",
    "test_procedural.py", "test_remote_teacher.py", "test_rollout.py", "test_run_integrity.py",
    "test_sampler_step.py", "test_schedule.py", "test_shared_prefix.py", "test_shown_completions.py",
    "test_skipping_adamw.py", "test_transport.py", "test_vision.py",
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name not in FAST_FILES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_process_unless_slow(request, monkeypatch):
    """A test not marked slow that starts a process (subprocess, fork, a multiprocessing Process) fails
    naming it: the fast subset stays fast and starts nothing."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    started = []

    def refuse(what):
        def wrapped(*args, **kwargs):
            started.append(what)
            raise AssertionError(f"{request.node.nodeid} started a process ({what}): mark it @pytest.mark.slow")
        return wrapped

    import multiprocessing.process
    import subprocess

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("subprocess"))
    monkeypatch.setattr(os, "fork", refuse("os.fork"))
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse("multiprocessing"))
    yield
    assert not started, f"{request.node.nodeid} started a process ({started[0]}): mark it @pytest.mark.slow"


def wait_until_healthy(process, url: str, timeout_s: float, poll_s: float, output) -> None:
    """Until the server `process` started answers 200 at `url` (its /health): AssertionError with the
    server's `output()` when it exits first, or when `timeout_s` passes."""
    import time
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}:\n{output()[-5000:]}"
        try:
            with urllib.request.urlopen(url, timeout=5.0) as response:  # a healthy server answers in milliseconds
                if response.status == 200:
                    return
        except OSError:
            time.sleep(poll_s)
    raise AssertionError(f"the server did not answer {url} within {timeout_s:g} s")


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


@pytest.fixture
def gsm8k_data() -> str:
    """The real GSM8K, as the default run reads it: the copy embedded in the project."""
    from grpo.data.embedded import EMBEDDED_GSM8K

    return EMBEDDED_GSM8K


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, float32, eval mode."""
    from grpo.config import ModelConfig
    from grpo.model.loading import load_model, load_tokenizer

    cfg = ModelConfig()
    return load_model(cfg).eval(), load_tokenizer(cfg)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory):
    """A tiny random Qwen2-VL with the embedded model's tokenizer (and Qwen2-VL's vision tokens), a chat template that
    writes image parts and Qwen2-VL's image processor (images scaled to at most 112 x 112), as a model folder."""
    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    from bench_vision import save_tiny_vlm

    folder = tmp_path_factory.mktemp("tiny-qwen2-vl")
    save_tiny_vlm(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random Llama saved with the real SmolLM2 tokenizer and chat template, for processes."""
    sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
    from simulate_scaling import tiny_model

    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model(folder, hidden_size=32)
    return folder


@pytest.fixture
def tiny_gsm8k(tmp_path):
    """A local GSM8K folder with 12 short problems (answers 0..11)."""
    import json

    folder = tmp_path / "gsm8k"
    folder.mkdir()
    for split in ("train", "test"):
        rows = [{"question": f"What is {i} plus 0?", "answer": f"{i} + 0 = {i}\n#### {i}"} for i in range(12)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


@pytest.fixture(scope="session")
def digit_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a head that only ever samples digit tokens: on the one-digit answers
    of `tiny_gsm8k` the lenient answer reward then varies inside groups, so GRPO has a gradient."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("digit-llama")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, tie_word_embeddings=False)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    torch.manual_seed(1)
    with torch.no_grad():
        # dimension 0 of every embedding dominates the residual stream, so the normed hidden
        # state always has h_0 ~ 5.6; digit rows point along it: logits ~ 56 for each digit
        # (nearly uniform among them) and 0 for every other token
        model.model.embed_tokens.weight[:, 0] = 30.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[digits] = torch.randn(10, model.config.hidden_size) * 0.5
        model.lm_head.weight[digits, 0] = 10.0
    model.config.tie_word_embeddings = False
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def penalised_digit_model_dir(digit_model_dir, tmp_path_factory):
    """The digit model with a generation_config.json that sets a repetition penalty, no-repeat
    n-grams and top-k, as some checkpoints ship them (Qwen2.5 has a repetition penalty)."""
    import shutil

    from transformers import GenerationConfig

    folder = tmp_path_factory.mktemp("penalised-digit-llama")
    shutil.copytree(digit_model_dir, folder, dirs_exist_ok=True)
    shipped = GenerationConfig.from_pretrained(folder)
    for key, value in {"repetition_penalty": 2.0, "no_repeat_ngram_size": 2, "top_k": 5, "do_sample": True}.items():
        setattr(shipped, key, value)
    shipped.save_pretrained(folder)
    return folder


def service_settings(**changes):
    """The service rewards' settings of the default config, with `changes` (rewards/services.py)."""
    import dataclasses

    from grpo.rewards.services import ServiceSettings
    from grpo.settings import Config

    return dataclasses.replace(ServiceSettings.of(Config()), **changes)


def checked_config(*args, **kwargs):
    """A config as a run's processes take it: loaded (grpo.config.load_config) and what it names
    imported (grpo/run/preflight.py: named_code_problems), every problem reported at once."""
    from grpo.config import load_config
    from grpo.run.preflight import named_code_problems

    return load_config(*args, checks=[named_code_problems], **kwargs)


@pytest.fixture(scope="module")
def chatty():
    """A tiny model that ends its messages often, and a character tokenizer (tests/episode_helpers.py)."""
    from episode_helpers import CharTokenizer, chatty_model

    return chatty_model(), CharTokenizer()


@pytest.fixture(scope="module")
def chatty_model_dir(digit_model_dir, tmp_path_factory):
    """The digit model (tests/conftest.py) that also ends its message about one token in eleven."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(digit_model_dir)
    model = AutoModelForCausalLM.from_pretrained(digit_model_dir)
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] = model.lm_head.weight[digits].mean(0)
    folder = tmp_path_factory.mktemp("chatty-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
