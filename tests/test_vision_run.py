"""The shipped visual recipe (configs/shapes_vlm.yaml: pictures of shapes drawn offline, data/shapes.py) as a user runs
it, with a tiny random Qwen2-VL in place of the Hub's and its vision encoder trained too (model.train_vision): two
steps of both processes, then `grpo evaluate` and `grpo export --merge` (the image processor saved beside the merged
model)."""

import json
import os
import subprocess
import sys

from conftest import REPO
from helpers import free_tcp_address


def grpo(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "grpo", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_the_visual_recipe_trains_two_steps_evaluates_and_exports(tmp_path, tiny_vlm_dir):
    run = tmp_path / "run"
    small = ["sampling.prompts_per_step=2", "sampling.group_size=4", "sampling.max_new_tokens=4", "lora.r=4",
             "data.task_args={size: 16, test_size: 8, image_size: 56}", "model.dtype=float32",
             "launch.cpu_threads=1"]
    out = grpo("train", "--config", "configs/shapes_vlm.yaml", f"run.dir={run}", f"model.name_or_path={tiny_vlm_dir}",
               f"transport.address={free_tcp_address()}", "training.steps=2", "model.train_vision=true", *small)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "16 prompts from shapes/train" in out.stdout and "done: 2 steps" in out.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["staleness"] == 0 and rows[0]["sampling/sampling_logp_difference/max"] < 1e-4  # images read alike
    from safetensors.torch import load_file

    adapter = load_file(run / "weights" / "v000002" / "adapter_model.safetensors")  # the sampler loaded v1's exactly
    qkv = "base_model.model.model.visual.blocks.0.attn.qkv"
    assert {f"{qkv}.lora_A.weight", f"{qkv}.lora_B.weight"} <= set(adapter)
    evaluated = grpo("evaluate", "--run", str(run), "--limit", "4")
    assert evaluated.returncode == 0, evaluated.stdout + evaluated.stderr
    assert json.loads(evaluated.stdout[evaluated.stdout.index("{"):])["problems"] == 4
    exported = grpo("export", str(run), "--out", str(tmp_path / "export"), "--merge")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    assert type(AutoModelForImageTextToText.from_pretrained(tmp_path / "export")).__name__ == \
        "Qwen2VLForConditionalGeneration"
    assert AutoImageProcessor.from_pretrained(tmp_path / "export").size["longest_edge"] == 112 * 112  # as trained
    assert "AutoModelForImageTextToText" in (tmp_path / "export" / "README.md").read_text()
