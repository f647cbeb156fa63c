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


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous-loop", "blocks"])
def test_the_hf_engine_generates_with_images_and_records_the_log_probs_the_trainer_recomputes(continuous):
    """Sampled: each completion's recorded log-probs equal the shared-prefix recompute with the images (float64);
    greedy: the same tokens as transformers' own `generate` with the pixel values (its M-RoPE decode positions).
    The continuous loop holds 4 rows for the 6 completions (refilled as rows end), beside a prompt without images."""
    from episode_helpers import CharTokenizer

    from grpo.config import load_config
    from grpo.sampler.rollout.hf_engine import HFEngine

    model = tiny_vlm()
    prompts, images, _ = batch()
    prompts, images = [*prompts, torch.tensor([5, 6, 7, 8])], [*images, None]
    cfg = load_config(None, ["sampling.temperature=1.0", "sampling.max_new_tokens=12",
                             "sampling.generation_batch_size=4", f"sampling.continuous_batching={continuous}"]).sampling
    engine = HFEngine(model, CharTokenizer(), cfg)
    out = engine.generate([p.tolist() for p in prompts], 3, seed=5, images=images)
    assert (out.token_versions is not None) == continuous  # the loop records each token's version
    recomputed = completion_logprobs(model, prompts, out.completion_ids, [3, 3, 3], images=images)
    for recorded, again in zip(out.logps, recomputed):
        torch.testing.assert_close(recorded.double(), again.double(), rtol=0, atol=1e-6)
    assert len({tuple(c.tolist()) for c in out.completion_ids}) > 1
    greedy = engine.generate([p.tolist() for p in prompts], 1, greedy=True, images=images)
    for prompt, own, got in zip(prompts, images, greedy.completion_ids):
        ids = prompt[None]
        pixels = {} if own is None else dict(pixel_values=own.pixel_values, image_grid_thw=own.grid_thw)
        theirs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **pixels,
                                mm_token_type_ids=(ids == IMAGE).int(),
                                max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=0)[0, len(prompt):]
        assert got.tolist() == theirs[:len(got)].tolist()


@pytest.mark.parametrize("continuous", [True, False], ids=["continuous-loop", "blocks"])
def test_one_token_prompts_beside_a_prompt_with_images_decode_as_text(continuous):
    """A call whose image prompt finishes first leaves one-token text prompts to prefill alone (nothing to prefill):
    each completion's recorded log-probs still equal the recompute (float64)."""
    from episode_helpers import CharTokenizer

    from grpo.config import load_config
    from grpo.sampler.rollout.hf_engine import HFEngine

    model = tiny_vlm()
    prompts, images, _ = batch()
    prompts, images = [prompts[0], torch.tensor([5]), torch.tensor([6])], [images[0], None, None]
    cfg = load_config(None, ["sampling.temperature=1.0", "sampling.max_new_tokens=6",
                             "sampling.generation_batch_size=2", f"sampling.continuous_batching={continuous}"]).sampling
    out = HFEngine(model, CharTokenizer(), cfg).generate([p.tolist() for p in prompts], 2, seed=3, images=images)
    again = completion_logprobs(model, prompts, out.completion_ids, [2, 2, 2], images=images)
    for recorded, recomputed in zip(out.logps, again):
        torch.testing.assert_close(recorded.double(), recomputed.double(), rtol=0, atol=1e-6)


def test_in_flight_weights_with_images_give_each_token_its_versions_log_prob(tmp_path):
    """A version that changes the language model and the vision encoder, loaded between two decode steps while
    prompts with images decode (sampling.in_flight_updates, in_flight_kv=recompute): the recompute runs each prompt's
    images through the new encoder, so each token records the version that drew it and that version's log-prob given
    its whole prefix with the images (float64 model: within two float32 ulps, as for text)."""
    from episode_helpers import CharTokenizer
    from helpers import new_version_loader

    from grpo.config import load_config
    from grpo.sampler.rollout.hf_engine import HFEngine

    model = tiny_vlm()
    old, newer, polling = new_version_loader(tmp_path, model, at_poll=6,
                                             change=lambda m: m.model.visual.merger.mlp[0].weight.mul_(1.5))
    prompts, images, _ = batch()
    prompts, images = [*prompts, torch.tensor([5, 6, 7, 8])], [*images, None]
    cfg = load_config(None, ["sampling.temperature=1.0", "sampling.max_new_tokens=16",
                             "sampling.generation_batch_size=4"]).sampling
    engine = polling(HFEngine(model, CharTokenizer(), cfg))
    with torch.no_grad():
        out = engine.generate([p.tolist() for p in prompts], 3, seed=5, images=images)
        again = {v: completion_logprobs(m, prompts, out.completion_ids, [3, 3, 3], temperature=1.0, images=images)
                 for v, m in ((0, old), (1, newer))}
    versions = out.token_versions
    assert engine.version == 1 and any((v == 0).any() and (v == 1).any() for v in versions)
    gaps = torch.cat([((logps - again[v][j]).abs() / again[v][j].abs().clamp(min=1))[versions[j] == v]
                      for j, logps in enumerate(out.logps) for v in (0, 1)])
    assert len(gaps) == sum(len(c) for c in out.completion_ids)
    assert gaps.max().item() <= 2.5e-7, gaps.max().item()


def test_a_full_fine_tunes_published_weights_load_into_the_samplers_model_and_from_pretrained(tmp_path):
    """A vision-language model's full weights are published under its own names (transformers' Hub format renames
    model.language_model.X to model.X): the sampler's copy takes them by name, and from_pretrained reads them."""
    from transformers import AutoModelForImageTextToText

    from grpo.weights.folder import load_into, publish, verify

    trained, served = tiny_vlm(seed=1), tiny_vlm(seed=2)
    folder = publish(trained, tmp_path, 1, 1)
    load_into(served, folder, verify(folder))
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), served.state_dict().values()))
    again, info = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float64, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert all(torch.equal(a, b) for a, b in zip(trained.state_dict().values(), again.state_dict().values()))


def test_the_next_calls_completions_with_images_start_in_the_rows_left_free_and_are_what_it_would_draw():
    """generate(A, then=B), both with images: B's completions start, with their images, in the rows A's leave free,
    and generate(B) finishes them: the tokens and log-probs of B made alone (float64 model). A B of other pictures of
    the same sizes (prompts of the same tokens) is not taken for the carried one: it is made from scratch."""
    from episode_helpers import CharTokenizer

    from grpo.config import load_config
    from grpo.model.vision import PromptImages
    from grpo.sampler.rollout.hf_engine import HFEngine
    from grpo.sampler.rollout.sequences import NextCall

    cfg = load_config(None, ["sampling.temperature=1.0", "sampling.max_new_tokens=12",
                             "sampling.generation_batch_size=4"]).sampling
    (prompts_a, images_a, _), (prompts_b, images_b, _) = batch(seed=1), batch(seed=3)
    other = batch(seed=5)[1]  # pictures of the same sizes: prompts_b's tokens
    a, b = [p.tolist() for p in prompts_a], [p.tolist() for p in prompts_b]

    def alone(images):  # B made from scratch: (its completions, the decode steps they took)
        engine = HFEngine(tiny_vlm(), CharTokenizer(), cfg)
        return engine.generate(b, 3, seed=12, images=images), engine.decode_rows.take()["sampler/decode_steps"]

    def copied(images):  # equal pixels in other tensors, as the next step makes them again
        return [PromptImages(i.pixel_values.clone(), i.grid_thw.clone()) for i in images]

    for given, (expected, from_scratch) in ((copied(images_b), alone(images_b)), (other, alone(other))):
        engine = HFEngine(tiny_vlm(), CharTokenizer(), cfg)
        engine.generate(a, 3, seed=11, images=images_a, then=NextCall(b, 3, 12, images=images_b))
        assert engine.carried.call.versions  # B's completions drew tokens in A's rows
        engine.decode_rows.take()
        got = engine.generate(b, 3, seed=12, images=given)
        steps = engine.decode_rows.take()["sampler/decode_steps"]
        assert engine.carried is None and (steps < from_scratch) == (given is not other)
        for j in range(len(expected.completion_ids)):
            assert torch.equal(got.completion_ids[j], expected.completion_ids[j])
            torch.testing.assert_close(got.logps[j], expected.logps[j], rtol=0, atol=1e-12)


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
