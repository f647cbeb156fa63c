"""Images in prompts (grpo/model/vision.py) on a tiny random Qwen2-VL built from a config: the shared-prefix
log-probs with images equal the model's own forward of each [prompt | completion] alone with its images (values in
float64 and LoRA gradients), the vision encoder runs once per group there (G times per prompt on the plain path),
and the completions' positions are the model's own M-RoPE positions of the whole sequence."""

import sys

import pytest
import torch
from conftest import REPO

from grpo.model.logprobs import completion_logprobs
from grpo.model.vision import packed_inputs, prompt_inputs, vision_language_model

sys.path.insert(0, str(REPO / "scripts" / "benchmarks"))
from bench_vision import END, IMAGE, START, images_of, prompt_with, tiny_vlm  # noqa: E402


def batch(G=3, seed=1):
    """Two prompts, one image in the first and two in the second; G completions each."""
    images = [images_of((56, 56), seed=seed), images_of((56, 84), (28, 56), seed=seed + 1)]
    prompts = [prompt_with(images[0]), prompt_with(images[1], text=(11,))]
    g = torch.Generator().manual_seed(seed)
    completions = [torch.randint(2, 90, (n,), generator=g) for n in torch.randint(3, 9, (2 * G,), generator=g)]
    return prompts, images, completions


def one_at_a_time(model, prompt, completion, images):
    """The model's own forward of [prompt | completion] with the prompt's images: log-probs of the completion."""
    ids = torch.cat([prompt, completion])[None]
    logits = model(input_ids=ids, pixel_values=images.pixel_values, image_grid_thw=images.grid_thw,
                   mm_token_type_ids=(ids == IMAGE).int()).logits[0, len(prompt) - 1:-1]
    return logits.log_softmax(-1).gather(1, completion[:, None])[:, 0]


def encoder_patches(model, monkeypatch) -> list[int]:
    """The patches of each call of the vision encoder, as they happen."""
    calls, visual = [], vision_language_model(model).visual
    forward = visual.forward

    def counted(pixels, **kwargs):
        calls.append(pixels.shape[0])
        return forward(pixels, **kwargs)

    monkeypatch.setattr(visual, "forward", counted)
    return calls


@pytest.mark.parametrize("shared_prefix", [True, False], ids=["shared-prefix", "plain"])
def test_log_probs_with_images_equal_each_sequence_alone_and_the_encoder_runs_once_per_group(monkeypatch,
                                                                                              shared_prefix):
    model = tiny_vlm()
    prompts, images, completions = batch()
    calls = encoder_patches(model, monkeypatch)
    with torch.no_grad():
        got = completion_logprobs(model, prompts, completions, [3, 3], images=images, shared_prefix=shared_prefix)
        patches = list(calls)
        for j, c in enumerate(completions):
            torch.testing.assert_close(got[j], one_at_a_time(model, prompts[j // 3], c, images[j // 3]),
                                       rtol=0, atol=1e-10)
    each = [i.patches for i in images]  # 16, and 24 + 8
    assert patches == (each if shared_prefix else [3 * each[0] + 3 * each[1]])
    without = completion_logprobs(model, prompts, completions, [3, 3])  # the image tokens' own embeddings instead
    assert max((a - b).abs().max().item() for a, b in zip(got, without)) > 1e-3


def test_lora_gradients_with_images_equal_those_of_each_sequence_alone():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_vlm(), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"],
                                                  exclude_modules=r".*visual.*", init_lora_weights=False))
    assert not any("visual" in name for name, p in model.named_parameters() if p.requires_grad)
    prompts, images, completions = batch(G=2, seed=4)
    weights = [torch.randn(len(c), generator=torch.Generator().manual_seed(j), dtype=torch.float64)
               for j, c in enumerate(completions)]
    trained = [p for p in model.parameters() if p.requires_grad]
    got = completion_logprobs(model, prompts, completions, [2, 2], images=images)
    shared = torch.autograd.grad(sum((w * x).sum() for w, x in zip(weights, got)), trained)
    alone = sum((w * one_at_a_time(model, prompts[j // 2], c, images[j // 2])).sum()
                for j, (w, c) in enumerate(zip(weights, completions)))
    for a, b in zip(shared, torch.autograd.grad(alone, trained)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_packed_positions_are_the_models_own_m_rope_positions_of_each_whole_sequence():
    from grpo.model.shared_prefix import pack_groups

    model = tiny_vlm()
    vlm = vision_language_model(model)
    prompts, images, completions = batch()
    for row in pack_groups(prompts, completions, [3, 3], 10_000):
        _, positions = packed_inputs(vlm, row.input_ids, row.position_ids, row.groups, prompts, images)
        for span in row.groups:
            prompt, at = prompts[span.prompt], span.start + span.prompt_len
            for length in span.completion_lens:
                ids = torch.cat([prompt, row.input_ids[at:at + length]])[None]
                expected, _ = vlm.get_rope_index(ids, mm_token_type_ids=(ids == IMAGE).int(),
                                                 image_grid_thw=images[span.prompt].grid_thw)
                packed = torch.cat([positions[:, span.start:span.start + span.prompt_len],
                                    positions[:, at:at + length]], dim=1)
                assert torch.equal(packed, expected[:, 0])
                at += length


def test_a_prompt_whose_image_tokens_do_not_match_its_images_is_refused():
    model = tiny_vlm()
    images = images_of((56, 56))
    with pytest.raises(ValueError, match="the prompt holds 3 image tokens and its images make 4"):
        prompt_inputs(vision_language_model(model), torch.tensor([5, START, IMAGE, IMAGE, IMAGE, END]), images)
