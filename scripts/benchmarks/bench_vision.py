"""Log-prob passes with images: the shared-prefix path (each group's prompt, its image through the vision encoder
included, computed once) against the plain one (each [prompt | completion] row with its image, the model's own
forward: the encoder G times), side by side on a tiny random Qwen2-VL built from a config.

    .venv/bin/python scripts/benchmarks/bench_vision.py                      # 4 prompts x G=8, 448x448, 64 tokens
    .venv/bin/python scripts/benchmarks/bench_vision.py --size 224 --group 4 --repeats 5

Both variants run in this process, alternating, no grad; it prints each one's median seconds, the share of it spent
in the vision encoder, and the plain/shared ratio. The models here are also the tests' (tests/test_vision.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

IMAGE, START, END = 100, 98, 97  # the image placeholder token, and the tokens around an image


def tiny_vlm(dtype=torch.float64, seed: int = 0, hidden: int = 64, vision_dim: int = 32, depth: int = 2,
             kind: str = "qwen2_vl"):
    """A random Qwen2-VL (or Qwen2.5-VL, `kind`): a 2-layer language model (GQA) and a `depth`-block vision encoder
    (Qwen2.5-VL's: windowed attention but in its last block), vocabulary 101."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig, Qwen2VLConfig

    vision = dict(depth=depth, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if kind == "qwen2_vl":
        config_class, vision = Qwen2VLConfig, {**vision, "embed_dim": vision_dim, "hidden_size": hidden, "mlp_ratio": 2}
    else:
        config_class, vision = Qwen2_5_VLConfig, {**vision, "hidden_size": vision_dim, "out_hidden_size": hidden,
                                                   "intermediate_size": 2 * vision_dim, "window_size": 56,
                                                   "fullatt_block_indexes": [depth - 1]}
    config = config_class(
        text_config=dict(vocab_size=101, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                         bos_token_id=None, eos_token_id=1, pad_token_id=0),
        vision_config=vision, image_token_id=IMAGE, video_token_id=99, vision_start_token_id=START,
        vision_end_token_id=END, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForImageTextToText.from_config(config).to(dtype).eval()


def images_of(*sizes, seed: int = 0):
    """Random RGB images of these (height, width), through Qwen2-VL's image processor (PIL: no torchvision)."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from grpo.model.vision import PromptImages

    rng = np.random.default_rng(seed)
    pictures = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    out = Qwen2VLImageProcessorPil()(images=pictures, return_tensors="pt")
    return PromptImages(out["pixel_values"], out["image_grid_thw"])


def prompt_with(images, text=(5, 6)) -> torch.Tensor:
    """Text, then each image as <start> its tokens <end>, then more text."""
    ids = list(text)
    for t, h, w in images.grid_thw.tolist():
        ids += [START] + [IMAGE] * (t * h * w // 4) + [END]
    return torch.tensor(ids + [7, 8, 9])


# ChatML, each image content part written as Qwen2-VL writes it (its placeholder widened to the image's tokens)
VLM_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.content is string %}{{- m.content }}{%- else %}{%- for part in m.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def save_tiny_vlm(folder: Path, hidden: int = 64, max_pixels: int = 112 * 112) -> None:
    """A tiny random Qwen2-VL saved with the embedded model's tokenizer (and Qwen2-VL's vision tokens added), a chat
    template that writes image parts, and Qwen2-VL's image processor (images scaled to at most `max_pixels`)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from grpo.config import ModelConfig
    from grpo.model.loading import load_tokenizer

    tokenizer = load_tokenizer(ModelConfig())
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_tokens(vision, special_tokens=True)
    start, end, image, video = tokenizer.convert_tokens_to_ids(vision)
    tokenizer.chat_template = VLM_TEMPLATE
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=hidden, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def save_smollm2_vlm(folder: Path, max_pixels: int = 112 * 112) -> None:
    """A Qwen2-VL whose language model is the embedded SmolLM2-135M-Instruct, weights copied (q/k/v biases zero; with
    the three M-RoPE positions of a text token equal, its rotary is SmolLM2's), and a random tiny vision encoder: a
    model that reads and writes the task's format from the start, for a learning run on this machine."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from grpo.config import ModelConfig
    from grpo.model.loading import load_model, load_tokenizer

    tokenizer, base = load_tokenizer(ModelConfig()), load_model(ModelConfig())
    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tokenizer.add_tokens(vision, special_tokens=True)
    start, end, image, video = tokenizer.convert_tokens_to_ids(vision)
    tokenizer.chat_template = VLM_TEMPLATE
    c = base.config
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                         num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                         num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                         rms_norm_eps=c.rms_norm_eps, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [8, 12, 12],
                                          "rope_theta": c.rope_parameters["rope_theta"]}),
        vision_config=dict(depth=2, embed_dim=64, hidden_size=c.hidden_size, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    text, source = model.model.language_model, base.model
    with torch.no_grad():
        text.embed_tokens.weight[:c.vocab_size] = source.embed_tokens.weight
        for name, param in text.named_parameters():
            if name.startswith("embed_tokens"):
                continue
            if name.endswith(".bias"):  # Qwen2's q/k/v biases: SmolLM2 has none
                param.zero_()
            else:
                param.copy_(source.get_parameter(name))
    model.lm_head.weight = text.embed_tokens.weight
    model.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=max_pixels).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--size", type=int, default=448, help="each prompt's one square image, in pixels")
    parser.add_argument("--completion", type=int, default=64, help="tokens a completion")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from grpo.model.logprobs import completion_logprobs
    from grpo.model.vision import vision_language_model

    model = tiny_vlm(torch.float32)
    images = [images_of((args.size, args.size), seed=i) for i in range(args.prompts)]
    prompts = [prompt_with(i) for i in images]
    g = torch.Generator().manual_seed(0)
    completions = [torch.randint(2, 90, (args.completion,), generator=g) for _ in range(args.prompts * args.group)]
    visual = vision_language_model(model).visual
    forward, encoder_s = visual.forward, [0.0]

    def timed(*a, **k):
        t = time.perf_counter()
        out = forward(*a, **k)
        encoder_s[0] += time.perf_counter() - t
        return out

    visual.forward = timed
    times = {"shared": [], "plain": []}
    encoder = {"shared": [], "plain": []}
    torch.set_grad_enabled(False)
    for repeat in range(args.repeats + 1):  # the first round warms up, and is not counted
        for variant in ("shared", "plain") if repeat % 2 else ("plain", "shared"):
            encoder_s[0] = 0.0
            t = time.perf_counter()
            completion_logprobs(model, prompts, completions, [args.group] * args.prompts, images=images,
                                shared_prefix=variant == "shared", max_tokens_per_forward=10**6)
            if repeat:
                times[variant].append(time.perf_counter() - t)
                encoder[variant].append(encoder_s[0])
    print(f"{args.prompts} prompts x G={args.group}, one {args.size}x{args.size} image each "
          f"({len(prompts[0])} prompt tokens, {images[0].patches} patches), {args.completion}-token completions, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    for variant in ("shared", "plain"):
        median = statistics.median(times[variant])
        print(f"  {variant:6s} {median:7.3f} s   vision encoder {statistics.median(encoder[variant]) / median:5.1%}")
    print(f"  plain / shared: {statistics.median(times['plain']) / statistics.median(times['shared']):.2f}x")


if __name__ == "__main__":
    main()
