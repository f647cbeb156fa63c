"""A dataset row's images (data.image_column), for a vision-language model: read as their encoded bytes (a path
relative to the dataset's folder, the bytes a parquet or Hub Image column holds), each checked to decode; a row whose
image is missing, unreadable or a URL (nothing is downloaded) is skipped and counted by that reason. `ImageReader`
makes them the model's input (`PromptImages`: pixel values and grids) and says how many tokens each image takes."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images, as the model's image processor made them (what grpo/model/vision.py reads)."""

    pixel_values: torch.Tensor  # float [patches, values a patch]: every image's patches, image after image
    grid_thw: torch.Tensor  # int64 [images, 3]: each image's (time, height, width) in patches

    @property
    def patches(self) -> int:
        return int(self.grid_thw.prod(-1).sum())


@dataclass(frozen=True)
class ImageReader:
    """A vision-language model's way with images: its image processor makes an image's patches and grid, and each
    image's one placeholder token in the chat template's text is widened to the image's tokens (one per
    merge x merge patches), as Qwen2-VL's processor does."""

    image_processor: object
    image_token: str  # the placeholder (Qwen2-VL's <|image_pad|>)
    merge: int  # patches merged a side into one token (spatial_merge_size)

    def pixels(self, images: tuple[bytes, ...]) -> PromptImages:
        out = self.image_processor(images=pil_images(images), return_tensors="pt")
        return PromptImages(out["pixel_values"], out["image_grid_thw"])

    def token_counts(self, images: tuple[bytes, ...]) -> list[int]:
        """Each image's tokens, from its size alone where the image processor can say (no pixels made)."""
        count = getattr(self.image_processor, "get_number_of_image_patches", None)
        if count is None:
            return (self.pixels(images).grid_thw.prod(-1) // self.merge**2).tolist()
        return [count(height, width) // self.merge**2 for width, height in image_sizes(images)]

    def widen(self, text: str, counts: list[int]) -> str:
        """`text` with its k-th placeholder repeated for image k's `counts[k]` tokens; ValueError when the number of
        placeholders differs."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(counts):
            raise ValueError(f"the prompt holds {len(pieces) - 1} image placeholders for {len(counts)} images")
        return pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))


def has_images(source) -> bool:
    """Whether a data source's prompts hold images (data.image_column, or the shapes task's pictures)."""
    from grpo.data.shapes import is_shapes

    return bool(source.image_column) or is_shapes(source.path)


MISSING, UNREADABLE, URL = "missing image", "unreadable image", "image is a URL (store the file and give its path)"


def read_images(value, folder: Path | None) -> tuple[tuple[bytes, ...], str | None]:
    """(the row's images' bytes, or the reason the row is skipped). `value`: a path, {bytes} or {path}, a PIL image,
    or a list of them."""
    items = value if isinstance(value, list) else [value]
    if not items or any(item is None for item in items):
        return (), MISSING
    out = []
    for item in items:
        data, problem = _read_one(item, folder)
        if problem:
            return (), problem
        out.append(data)
    return tuple(out), None


def _read_one(item, folder: Path | None) -> tuple[bytes, str | None]:
    if isinstance(item, dict):
        item = item.get("bytes") or item.get("path")
    if hasattr(item, "save") and hasattr(item, "mode"):  # a PIL image (an Image column someone decoded)
        out = io.BytesIO()
        try:
            on_white(item).save(out, format="PNG")
        except (OSError, ValueError):
            return b"", UNREADABLE
        item = out.getvalue()
    if isinstance(item, (bytes, bytearray)):
        data = bytes(item)
    elif isinstance(item, str) and item.strip():
        if item.startswith(("http://", "https://", "ftp://")):
            return b"", URL
        path = Path(item).expanduser()
        path = path if path.is_absolute() or folder is None else folder / path
        if not path.is_file():
            return b"", MISSING
        data = path.read_bytes()
    else:
        return b"", MISSING
    return data, (None if decodes(data) else UNREADABLE)


def decodes(data: bytes) -> bool:
    """Whether the bytes are an image the processor can be given (decoded, and made RGB)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            on_white(image)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return False
    return True


def image_sizes(images: tuple[bytes, ...]) -> list[list[int]]:
    """Each image's [width, height] in pixels, as the rewards get them (row["image_sizes"])."""
    from PIL import Image

    out = []
    for data in images:
        with Image.open(io.BytesIO(data)) as image:
            out.append(list(image.size))
    return out


def pil_images(images: tuple[bytes, ...]) -> list:
    """The images as RGB PIL images, for the model's processor."""
    from PIL import Image

    return [on_white(Image.open(io.BytesIO(data))) for data in images]


def on_white(image):
    """An RGB image; a transparent one laid on white (as transformers' convert_to_rgb does: a line drawing on a
    transparent background stays a drawing, not a black square)."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")
