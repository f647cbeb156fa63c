"""Images in prompts (grpo/model/vision.py) on a tiny random Qwen2-VL (and Qwen2.5-VL) built from a config: the
shared-prefix log-probs with images equal the model's own forward of each [prompt | completion] alone with its images
(values in float64 and LoRA gradients), the vision encoder runs once per group there (G times per prompt on the plain
path), the completions' positions are the model's own M-RoPE positions of the whole sequence, the HF engine's recorded
log-probs are the recompute, and a step on a dataset's images reaches the trainer's loss as sampled."""

import dataclasses
import json
import sys

import numpy as np
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


@pytest.mark.parametrize("kind, shared_prefix", [("qwen2_vl", True), ("qwen2_vl", False), ("qwen2_5_vl", True)],
                         ids=["qwen2-vl-shared-prefix", "qwen2-vl-plain", "qwen2.5-vl-shared-prefix"])
def test_log_probs_with_images_equal_each_sequence_alone_and_the_encoder_runs_once_per_group(monkeypatch, kind,
                                                                                              shared_prefix):
    model = tiny_vlm(kind=kind)
    prompts, images, completions = batch()
    calls = encoder_patches(model, monkeypatch)
    with torch.no_grad():
        got = completion_logprobs(model, prompts, completions, [3, 3], images=images, shared_prefix=shared_prefix)
        patches = list(calls)
        for j, c in enumerate(completions):
            torch.testing.assert_close(got[j], one_at_a_time(model, prompts[j // 3], c, images[j // 3]),
                                       rtol=0, atol=1e-10)
    each = [i.patches for i in images]
    assert patches == (each if shared_prefix else [each[0]] * 3 + [each[1]] * 3)  # once per group, or per row
    without = completion_logprobs(model, prompts, completions, [3, 3])  # the image tokens' own embeddings instead
    assert max((a - b).abs().max().item() for a, b in zip(got, without)) > 1e-3


def test_an_image_token_the_model_drew_is_text_on_both_paths():
    """A completion may hold the image placeholder (a random model draws it): it is read as the token it is, the
    same on the shared-prefix and the plain path, and nothing of the image is put there."""
    model = tiny_vlm()
    prompts, images, completions = batch()
    completions[1] = torch.tensor([5, IMAGE, 7, IMAGE])
    with torch.no_grad():
        shared = completion_logprobs(model, prompts, completions, [3, 3], images=images)
        plain = completion_logprobs(model, prompts, completions, [3, 3], images=images, shared_prefix=False)
    for a, b in zip(shared, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("train_vision", [False, True], ids=["encoder-frozen", "model.train_vision"])
def test_lora_gradients_with_images_equal_those_of_each_sequence_alone(train_vision):
    """LoRA as a run adds it (add_lora): on the language model's named layers, and with model.train_vision on every
    linear layer of the vision encoder too, whose gradients then flow through its one pass per group."""
    from grpo.model.loading import add_lora
    from grpo.settings import LoraConfig

    model = add_lora(tiny_vlm(), LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]), train_vision)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # PEFT starts B at 0: every gradient but B's would be 0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)
    visual = vision_language_model(model.get_base_model()).visual
    linears = {name for name, m in vision_language_model(tiny_vlm()).visual.named_modules()
               if isinstance(m, torch.nn.Linear)}
    adapted = {name for name, m in visual.named_modules() if hasattr(m, "lora_A")}
    assert adapted == (linears if train_vision else set())
    assert len(adapted) == (0 if not train_vision else 2 * 4 + 2)  # qkv, proj, fc1, fc2 a block; the merger's two
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
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    vision_grads = [grad for name, grad in zip(names, shared) if ".visual." in name]
    assert len(vision_grads) == (0 if not train_vision else 2 * 10) and all(bool(grad.abs().sum() > 0)
                                                                             for grad in vision_grads)


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


def test_the_hf_engine_generates_with_images_and_records_the_log_probs_the_trainer_recomputes():
    """Sampled: each completion's recorded log-probs equal the shared-prefix recompute with the images (float64);
    greedy: the same tokens as transformers' own `generate` with the pixel values (its M-RoPE decode positions)."""
    from episode_helpers import CharTokenizer

    from grpo.config import load_config
    from grpo.sampler.rollout.hf_engine import HFEngine

    model = tiny_vlm()
    prompts, images, _ = batch()
    cfg = load_config(None, ["sampling.temperature=1.0", "sampling.max_new_tokens=12",
                             "sampling.generation_batch_size=4"]).sampling
    engine = HFEngine(model, CharTokenizer(), cfg)
    out = engine.generate([p.tolist() for p in prompts], 3, seed=5, images=images)
    recomputed = completion_logprobs(model, prompts, out.completion_ids, [3, 3], images=images)
    for recorded, again in zip(out.logps, recomputed):
        torch.testing.assert_close(recorded.double(), again.double(), rtol=0, atol=1e-6)
    assert len({tuple(c.tolist()) for c in out.completion_ids}) > 1
    greedy = engine.generate([p.tolist() for p in prompts], 1, greedy=True, images=images)
    for prompt, own, got in zip(prompts, images, greedy.completion_ids):
        ids = prompt[None]
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=own.pixel_values,
                                image_grid_thw=own.grid_thw, mm_token_type_ids=(ids == IMAGE).int(),
                                max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=0)[0, len(prompt):]
        assert got.tolist() == theirs[:len(got)].tolist()


def picture_rows(folder):
    """A dataset folder: PNG images beside train.jsonl, and rows whose image is missing, damaged or a URL."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for k, (h, w) in enumerate(((56, 56), (84, 56), (112, 112))):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"img{k}.png")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not a picture")
    rows = [{"question": f"How many squares in picture {k}?", "answer": str(k + 1), "image": f"img{k}.png"}
            for k in range(3)]
    rows += [{"question": "Two pictures?", "answer": "2", "image": ["img0.png", "img1.png"]},
             {"question": "q", "answer": "1", "image": "gone.png"},
             {"question": "q", "answer": "1", "image": "broken.png"},
             {"question": "q", "answer": "1", "image": "https://example.com/a.png"}]
    (folder / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_a_step_on_images_from_the_dataset_to_the_trainers_loss_reads_each_token_as_sampled(tiny_vlm_dir,
                                                                                             tmp_path):
    """The dataset's images (a row of two; a missing, a damaged and a URL row skipped and counted) become prompts
    with their image tokens; a sampler step (make_batch, LoRA, the vision encoder frozen) sends them with the batch;
    the sampler's recompute and the trainer's forward of the decoded batch read each sampled token as the engine
    drew it (within float32 rounding), and without the images far from it."""
    from helpers import assert_batches_equal

    from grpo.config import load_config
    from grpo.data.problems import load_split
    from grpo.data.prompts import build_prompts
    from grpo.model.loading import load_policy, load_processor, load_tokenizer
    from grpo.sampler.batches import SamplerModels, make_batch
    from grpo.sampler.rollout.hf_engine import HFEngine
    from grpo.trainer.training_step import micro_batch_loss
    from grpo.wire.codec import decode_batch, encode_batch

    picture_rows(tmp_path)
    cfg = load_config(None, [f"model.name_or_path={tiny_vlm_dir}", f"data.path={tmp_path}", "data.image_column=image",
                             "data.answer_format=text", "data.few_shot=0", "sampling.group_size=3",
                             "sampling.max_new_tokens=8", "sampling.temperature=1.0", "training.beta=0",
                             "lora.r=4", "lora.target_modules=[q_proj,v_proj]", "model.dtype=float32"])
    problems, stats = load_split(cfg.data, "train")
    assert len(problems) == 4 and stats.skipped == {"missing image": 1, "unreadable image": 1,
                                                    "image is a URL (store the file and give its path)": 1}
    assert problems[3].row["image_sizes"] == [[56, 56], [56, 84]]  # what the rewards get of the images: [w, h]
    tokenizer = load_tokenizer(cfg.model)
    reader = load_processor(cfg.model, cfg.data, tokenizer)
    prompts, dropped = build_prompts(tokenizer, cfg.data, problems, processor=reader)
    model = load_policy(cfg)
    vlm = vision_language_model(model.get_base_model())
    assert dropped == 0 and not any(p.requires_grad for p in vlm.visual.parameters())
    for prompt in prompts:  # each image's placeholder widened to its tokens
        made = prompt.images.load()
        assert prompt.token_ids.count(vlm.config.image_token_id) == int(made.grid_thw.prod(-1).sum()) // 4
    assert len(prompts[3].images.load().grid_thw) == 2
    policy = SamplerModels.of(cfg, HFEngine(model, tokenizer, cfg.sampling), model, None, tokenizer, {})
    batch = make_batch(cfg, policy, [prompts[0], prompts[3]], step=0, metrics_so_far={}, measure_logp_gap=True)
    assert batch.patch_values == 1176 and [len(g) for g in batch.image_grids] == [3, 6]
    assert batch.meta["metrics"]["sampler/engine_logp_gap_max"] < 1e-4
    decoded = decode_batch(encode_batch(batch))
    assert_batches_equal(batch, decoded)
    _, trained, _ = micro_batch_loss(model, decoded, cfg)
    assert trained["sampling/sampling_logp_difference/max"] < 1e-4
    blind = dataclasses.replace(decoded, image_pixels=None, image_grids=None, patch_values=0)
    assert micro_batch_loss(model, blind, cfg)[1]["sampling/sampling_logp_difference/max"] > 1e-2


def test_image_fields_on_the_wire_are_checked_whole():
    from helpers import make_batch

    from grpo.wire.codec import MessageError, decode_batch, encode_batch

    def with_images(pixels, grids, patch_values=6):
        batch = make_batch()  # two prompts
        batch.image_pixels, batch.image_grids, batch.patch_values = pixels, grids, patch_values
        return batch

    good = with_images([torch.rand(2 * 2 * 6), torch.zeros(0)], [torch.tensor([1, 2, 2]), torch.zeros(0).long()])
    assert decode_batch(encode_batch(good)).image_grids[0].tolist() == [1, 2, 2]
    for batch, message in (
            (with_images([torch.rand(23), torch.zeros(0)], [torch.tensor([1, 2, 2]), torch.zeros(0).long()]),
             "prompt 0 holds 23 values; its grids make 4 patches of 6"),
            (with_images([torch.rand(0), torch.zeros(0)], [torch.tensor([1, 0, 2]), torch.zeros(0).long()]),
             r"prompt 0's grid is not \(time, height, width\) in 1..65536 an image"),
            (with_images([torch.rand(24)], [torch.tensor([1, 2, 2])]), "images for 1 and 1 prompts"),
            (with_images([torch.rand(24), torch.zeros(0)], [torch.tensor([1, 2, 2]), torch.zeros(0).long()], 0),
             "patch_values must be >= 1"),
            (with_images([torch.zeros(0), torch.zeros(0)], [torch.tensor([1, 512, 512]), torch.zeros(0).long()], 1),
             "prompt 0's images hold 262144 patches, over 65536"),
            (with_images([torch.zeros(0), torch.zeros(0)], [torch.tensor([1, 2**32, 2**32]), torch.zeros(0).long()],
                         1), r"prompt 0's grid is not \(time, height, width\) in 1..65536")):  # product: 0 in int64
        with pytest.raises(MessageError, match=message):
            decode_batch(encode_batch(batch))
    half = with_images([torch.rand(24), torch.zeros(0)], [torch.tensor([1, 2, 2]), torch.zeros(0).long()])
    half.image_grids = None
    with pytest.raises(MessageError, match="image_pixels and image_grids travel together"):
        decode_batch(encode_batch(half))


def test_images_of_any_mode_are_given_as_rgb_a_transparent_one_on_white():
    """A line drawing on a transparent background stays a drawing (not a black square); CMYK JPEGs, palette and
    float images are read; bytes that are no image are skipped as unreadable."""
    import io

    from PIL import Image

    from grpo.data.images import UNREADABLE, pil_images, read_images

    drawing = Image.new("RGBA", (8, 8), (0, 0, 0, 0))
    drawing.putpixel((3, 3), (0, 0, 0, 255))
    encoded = []
    for image, kind in ((drawing, "PNG"), (Image.new("CMYK", (8, 8), (0, 0, 0, 255)), "JPEG"),
                        (Image.new("P", (8, 8)), "PNG")):
        out = io.BytesIO()
        image.save(out, format=kind)
        encoded.append(out.getvalue())
    images, problem = read_images([{"bytes": data} for data in encoded] + [Image.new("F", (8, 8))], None)
    assert problem is None and len(images) == 4
    rgb = pil_images(images)
    assert all(image.mode == "RGB" for image in rgb)
    assert rgb[0].getpixel((0, 0)) == (255, 255, 255) and rgb[0].getpixel((3, 3)) == (0, 0, 0)
    assert read_images({"bytes": b"\x89PNG\r\n\x1a\n not a picture"}, None) == ((), UNREADABLE)


def test_the_trainer_refuses_images_its_model_cannot_read_before_any_forward():
    from conftest import tiny_model
    from helpers import make_batch

    from grpo.model.vision import check_batch_images, wire_images

    model = tiny_vlm()
    prompts, images, _ = batch()

    def with_images(prompt_ids, own):
        out = make_batch()  # two prompts
        pixels, grids, values = wire_images(own)
        out.prompt_ids, out.image_pixels, out.image_grids, out.patch_values = prompt_ids, pixels, grids, values
        return out

    assert check_batch_images(with_images(prompts, images), model) is None
    assert check_batch_images(with_images(prompts, [images[0], None]), model) == \
        "prompt 1 holds 12 image tokens, and its images make 0"
    assert check_batch_images(with_images([prompts[0][:-6], prompts[1]], images), model) == \
        "prompt 0 holds 2 image tokens, and its images make 4"
    odd = dataclasses.replace(images[0], grid_thw=torch.tensor([[1, 4, 3]]), pixel_values=images[0].pixel_values[:12])
    assert "prompt 0's image grid is not a whole number of 2-patch tokens a side" in \
        check_batch_images(with_images([prompts[0], prompts[1]], [odd, images[1]]), model)
    narrow = with_images(prompts, images)
    narrow.patch_values = 588
    assert check_batch_images(narrow, model) == "the batch's patches hold 588 values, and this model's 1176"
    assert check_batch_images(with_images(prompts, images), tiny_model("qwen2")) == \
        "the batch holds images, and the model is not a vision-language model"


@pytest.mark.parametrize("case", ["text-eager-plain-path", "images-encoder-trained"])
def test_a_padding_forward_gives_zero_loss_and_every_trained_parameter_a_gradient(case):
    """A rank with fewer micro-batches than the others pads with a zero-loss forward: it takes the run's own path (the
    plain one with training.shared_prefix=false, which eager attention needs), and every trained parameter gets a
    gradient from it, the vision encoder's LoRA too, as ZeRO-1/2's reduction across ranks needs."""
    from ds_equivalence import make_batch

    from grpo.config import load_config
    from grpo.model.loading import add_lora
    from grpo.settings import LoraConfig
    from grpo.trainer.training_step import PolicyObjective

    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    if case == "images-encoder-trained":
        cfg = load_config(None, ["model.train_vision=true", "data.path=shapes"])
        model = add_lora(tiny_vlm(torch.float32), lora, train_vision=True)
    else:
        from conftest import tiny_model

        cfg = load_config(None, ["training.shared_prefix=false", "model.attn_implementation=eager"])
        model = add_lora(tiny_model(), lora)
    batch = make_batch(model, vision=cfg.model.train_vision)  # its log-probs made on sdpa
    if not cfg.model.train_vision:
        model.config._attn_implementation = "eager"
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}
    assert any(".visual." in name for name in trained) == cfg.model.train_vision
    loss, metrics, tokens = PolicyObjective(model, cfg)(None, batch)
    assert (loss.item(), metrics, tokens) == (0.0, {}, 0)
    loss.backward()
    assert [name for name, p in trained.items() if p.grad is None] == []
    assert all(not p.grad.any() for p in trained.values())
