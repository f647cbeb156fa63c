"""A dataset row's images (data.image_column), for a vision-language model: read as their encoded bytes (a path
relative to the dataset's folder, or the bytes a parquet Image column holds), each checked to decode. A row whose
image is missing, unreadable or a URL (nothing is downloaded) is skipped and counted by that reason."""

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

    def widen(self, text: str, grid_thw: torch.Tensor) -> str:
        """`text` with its k-th placeholder repeated for image k's tokens; ValueError when the counts differ."""
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(grid_thw):
            raise ValueError(f"the prompt holds {len(pieces) - 1} image placeholders for {len(grid_thw)} images")
        counts = (grid_thw.prod(-1) // self.merge**2).tolist()
        return pieces[0] + "".join(self.image_token * n + piece for n, piece in zip(counts, pieces[1:]))


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
    if hasattr(item, "save") and hasattr(item, "mode"):  # a PIL image (a Hub dataset's Image column, decoded)
        out = io.BytesIO()
        item.save(out, format="PNG")
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
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError):
        return False
    return True


def pil_images(images: tuple[bytes, ...]) -> list:
    """The images as RGB PIL images, for the model's processor."""
    from PIL import Image

    return [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
