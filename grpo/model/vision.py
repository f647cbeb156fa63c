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


def batch_images(images: list[PromptImages | None]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(pixel_values, image_grid_thw) of rows' images, row after row, as the model's forward takes them (None
    without any)."""
    present = [i for i in images if i is not None]
    if not present:
        return None, None
    return torch.cat([i.pixel_values for i in present]), torch.cat([i.grid_thw for i in present])


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
