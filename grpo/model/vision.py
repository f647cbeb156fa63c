"""Images in prompts, for vision-language models (Qwen2-VL and Qwen2.5-VL): a prompt's images as its processor made
them (`PromptImages`), and what the language model reads of a group's prompt with them: its token embeddings with
the vision encoder's features in place of the image tokens, and its multimodal rotary positions (M-RoPE: three
position ids a token; an image's laid out on its grid of patches). Both are computed once per group; the
completions' embeddings are their tokens', their positions going on from the prompt's largest, one a token, in all
three (the model's own `get_rope_index` on the whole sequence gives the same: tests/test_vision.py).
"""

from __future__ import annotations

import torch

from grpo.data.images import PromptImages

__all__ = ["PromptImages"]  # defined with the data, which makes it

SUPPORTED_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def vision_language_model(causal_lm):
    """The multimodal model inside a *ForConditionalGeneration (its `visual` encoder and `language_model`), or None
    for a text-only model."""
    inner = getattr(causal_lm, "model", None)
    return inner if inner is not None and hasattr(inner, "visual") and hasattr(inner, "get_rope_index") else None


def image_tokens(vlm, images: PromptImages) -> int:
    """How many image tokens the prompt must hold for `images`: each image's patches merged spatial_merge_size^2 to
    one."""
    merge = vlm.config.vision_config.spatial_merge_size
    return int((images.grid_thw.prod(-1) // merge**2).sum())


def prompt_inputs(vlm, prompt_ids: torch.Tensor, images: PromptImages | None
                  ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(embeddings [P, H] with the images' features at their tokens, positions int64 [3, P], the position the text
    after the prompt starts at). The vision encoder runs here, once for the prompt's images."""
    embeddings = vlm.get_input_embeddings()(prompt_ids)
    if images is None:
        return embeddings, torch.arange(len(prompt_ids), device=prompt_ids.device).expand(3, -1), len(prompt_ids)
    at = prompt_ids == vlm.config.image_token_id
    grid = images.grid_thw.to(prompt_ids.device)
    expected = image_tokens(vlm, images)
    if int(at.sum()) != expected:
        raise ValueError(f"the prompt holds {int(at.sum())} image tokens and its images make {expected}")
    features = vlm.get_image_features(images.pixel_values.to(prompt_ids.device), grid, return_dict=True).pooler_output
    features = torch.cat(list(features)).to(embeddings.dtype)  # [image tokens, H]
    embeddings = embeddings.masked_scatter(at[:, None], features)
    positions, _ = vlm.get_rope_index(prompt_ids[None], mm_token_type_ids=at.int()[None], image_grid_thw=grid)
    positions = positions[:, 0]  # [3, P]
    return embeddings, positions, int(positions.max()) + 1


def packed_inputs(vlm, input_ids: torch.Tensor, position_ids: torch.Tensor, spans: list, prompt_ids: list,
                  images: list) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed shared-prefix row's (embeddings [L, H], positions [3, L]): each group's prompt with its images (its
    span's `prompt` the index into `prompt_ids` and `images`), its completions after it, their positions shifted
    to go on from the prompt's largest. `position_ids`: the row's text positions (a completion's from its prompt's
    length)."""
    device = input_ids.device
    pieces, positions, at = [], position_ids.expand(3, -1).clone(), 0
    embed = vlm.get_input_embeddings()
    for span in spans:
        start, after, end = span.start, span.start + span.prompt_len, span.end
        if start > at:
            pieces.append(embed(input_ids[at:start]))
        prompt_embeddings, prompt_positions, next_position = prompt_inputs(
            vlm, prompt_ids[span.prompt].to(device), images[span.prompt])
        pieces += [prompt_embeddings, embed(input_ids[after:end])]
        positions[:, start:after] = prompt_positions
        positions[:, after:end] += next_position - span.prompt_len
        at = end
    if at < len(input_ids):
        pieces.append(embed(input_ids[at:]))
    return torch.cat(pieces), positions


def plain_inputs(vlm, prompts: list[torch.Tensor], completions: list[torch.Tensor], images: list,
                 width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded [prompt | completion] rows' (embeddings [n, width, H], positions [3, n, width]): each row's prompt
    with its images (the encoder run for each row), its completion's tokens (an image token the model drew is
    text: it has no image) going on from the prompt's largest position."""
    device = vlm.get_input_embeddings().weight.device
    rows, positions = [], torch.zeros(3, len(prompts), width, dtype=torch.long, device=device)
    for k, (prompt, completion, own) in enumerate(zip(prompts, completions, images)):
        embedded, placed, after = prompt_inputs(vlm, prompt.to(device), own)
        row = torch.cat([embedded, vlm.get_input_embeddings()(completion.to(device))])
        rows.append(torch.nn.functional.pad(row, (0, 0, 0, width - len(row))))
        positions[:, k, :len(prompt)] = placed
        positions[:, k, len(prompt):len(row)] = after + torch.arange(len(completion), device=device)
    return torch.stack(rows), positions


def wire_images(images: list[PromptImages | None]) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Prompts' images as a batch carries them (grpo/wire/batch.py): per prompt its pixels and grids flattened
    (empty without images), and the values a patch holds."""
    present = [i for i in images if i is not None]
    patch_values = int(present[0].pixel_values.shape[1]) if present else 0
    if any(int(i.pixel_values.shape[1]) != patch_values for i in present):
        raise ValueError("the prompts' images hold patches of different sizes (one image processor makes them all)")
    pixels = [i.pixel_values.float().reshape(-1) if i is not None else torch.zeros(0) for i in images]
    grids = [i.grid_thw.long().reshape(-1) if i is not None else torch.zeros(0, dtype=torch.long) for i in images]
    return pixels, grids, patch_values


def batch_prompt_images(batch) -> list[PromptImages | None] | None:
    """A RolloutBatch's images, per prompt (None for a prompt without; None for a batch of text alone)."""
    if batch.image_pixels is None:
        return None
    return [PromptImages(pixels.reshape(-1, batch.patch_values), grid.reshape(-1, 3)) if len(grid) else None
            for pixels, grid in zip(batch.image_pixels, batch.image_grids)]


def check_batch_images(batch, causal_lm) -> str | None:
    """Why the batch's images cannot be what this model reads (None: they can): the model has no vision encoder;
    a patch's values are not its encoder's (channels x temporal patch x patch size^2); a grid is not a whole number
    of merged tokens; a prompt's image tokens are not its images' count. Checked before any forward, on every rank
    alike."""
    images = batch_prompt_images(batch)
    if images is None:
        return None
    vlm = vision_language_model(causal_lm)
    if vlm is None:
        return "the batch holds images, and the model is not a vision-language model"
    vision = vlm.config.vision_config
    values = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    if batch.patch_values != values:
        return f"the batch's patches hold {batch.patch_values} values, and this model's {values}"
    for i, (prompt, own) in enumerate(zip(batch.prompt_ids, images)):
        count = int((prompt == vlm.config.image_token_id).sum())
        if own is not None and bool((own.grid_thw[:, 1:] % vision.spatial_merge_size).any()):
            return f"prompt {i}'s image grid is not a whole number of {vision.spatial_merge_size}-patch tokens a side"
        expected = 0 if own is None else image_tokens(vlm, own)
        if count != expected:
            return f"prompt {i} holds {count} image tokens, and its images make {expected}"
    return None
