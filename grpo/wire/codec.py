"""A RolloutBatch as frames of bytes: a JSON header plus raw little-endian tensor frames. Never pickle.
(The frames travel by grpo/wire/transport.py.)

Frames: [header, tensor_0, tensor_1, ...], or [signature, header, ...] with a shared secret
(HMAC-SHA256 over every other frame). The decoder trusts nothing: it checks the signature,
the schema, the size cap, a dtype allow-list per field, that every byte count matches its
shape, that the pieces agree with each other, and that floats are finite, and answers any
bad input with MessageError (a ValueError) naming the problem.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os

import numpy as np
import torch

from grpo.wire.batch import ENVIRONMENT_TOKEN, FIELDS, HEADER_FIELDS, SCHEMA, TENSOR_FIELDS, RolloutBatch

log = logging.getLogger(__name__)

SECRET_ENV = "GRPO_TRANSPORT_SECRET"
DEFAULT_MAX_BYTES = 512 * 2**20
MAX_HEADER_BYTES = 4 * 2**20  # the header is metadata; anything bigger is an attack or a bug
MAX_IMAGE_PATCHES = 65536  # a prompt's images: a 12.8-megapixel image in 14-pixel patches (Qwen2-VL's largest)
MAX_GRID_SIDE = MAX_IMAGE_PATCHES  # patches along one side (bounds the product: no overflow)
EARLIER_SCHEMAS = ("grpo.rollout/1", "grpo.rollout/2", "grpo.rollout/3", "grpo.rollout/4")

TENSORS = {f.name: f for f in TENSOR_FIELDS}
TORCH_DTYPE = {"<i8": torch.int64, "<i4": torch.int32, "<f4": torch.float32, "|b1": torch.bool}
HEADER_TYPES = {**{f.name: f.dtype for f in HEADER_FIELDS}, "tensors": list}  # "tensors": the frames' specs


class MessageError(ValueError):
    """A message that is not a valid RolloutBatch."""


def resolve_secret(secret: str | bytes | None) -> bytes | None:
    """The secret as bytes: `secret`, else the environment's GRPO_TRANSPORT_SECRET, else None."""
    secret = secret or os.environ.get(SECRET_ENV)
    return secret if isinstance(secret, bytes) or not secret else secret.encode()


def signature_problem(frames: list[bytes], secret: bytes) -> str | None:
    """Why `frames` (signature first) are not signed with `secret`; None when they are."""
    if len(frames) < 2 or not hmac.compare_digest(bytes(frames[0]), _signature(secret, [bytes(f) for f in frames[1:]])):
        return ("bad or missing signature (do both ends read the same run folder's secret file, or have the same "
                "transport.secret?)")
    return None


def _signature(secret: bytes, frames: list[bytes]) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))  # length-prefixed: frames cannot be re-split
        mac.update(frame)
    return mac.digest()


# ----------------------------------------------------------------------------- encode

def _flat(field, value) -> tuple[np.ndarray, list[int]]:
    dtype = field.dtype
    if field.wire == "ragged":
        lengths = [int(t.numel()) for t in value]
        flat = torch.cat([t.reshape(-1) for t in value]) if value else torch.zeros(0)
        return flat.to(TORCH_DTYPE[dtype]).cpu().numpy().astype(dtype, copy=False), lengths
    array = value.to(TORCH_DTYPE[dtype]).cpu().numpy().astype(dtype, copy=False)
    return array, list(array.shape)


def _json_scalar(value):
    """numpy / torch integers and floats that reached a header field, as plain numbers."""
    return value.item() if hasattr(value, "item") else int(value)


def encode_batch(batch: RolloutBatch, secret: bytes | None = None) -> list[bytes]:
    """The multipart frames of `batch`; signed when `secret` is given."""
    specs, buffers = [], []
    for f in TENSOR_FIELDS:
        value = getattr(batch, f.name)
        if value is None:
            continue
        array, shape = _flat(f, value)
        key = "lengths" if f.wire == "ragged" else "shape"
        specs.append({"name": f.name, "dtype": f.dtype, key: shape, "nbytes": array.nbytes})
        buffers.append(np.ascontiguousarray(array).tobytes())
    header = {f.name: getattr(batch, f.name) for f in HEADER_FIELDS}
    header["tensors"] = specs
    frames = [json.dumps(header, allow_nan=False, default=_json_scalar).encode()] + buffers
    return [_signature(secret, frames)] + frames if secret else frames


# ----------------------------------------------------------------------------- decode

def _header(frame: bytes) -> dict:
    if len(frame) > MAX_HEADER_BYTES:
        raise MessageError(f"header of {len(frame)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(frame.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise MessageError(f"header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise MessageError(f"header must be a JSON object, got {type(header).__name__}")
    if header.get("schema") in EARLIER_SCHEMAS:
        raise MessageError(f"a batch of schema {header['schema']}, from a sampler older than this trainer, which "
                           f"speaks {SCHEMA} (what a batch holds has changed since): run the sampler of the "
                           "same version")
    if header.get("schema") != SCHEMA:
        raise MessageError(f"unknown schema {str(header.get('schema'))[:80]!r}; this trainer speaks {SCHEMA}")
    for key, kind in HEADER_TYPES.items():
        if key not in header:
            raise MessageError(f"missing field '{key}'")
        value = header[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise MessageError(f"field '{key}' must be {kind.__name__}, got {type(value).__name__}")
    return header


def _reject_constant(name: str):
    raise MessageError(f"header holds {name}, which is not JSON")


def _int_list(value, what: str, minimum: int) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= minimum
                                              for v in value):
        raise MessageError(f"{what} must be a list of integers >= {minimum}")
    return value


def _tensor(spec, frame: bytes):
    if not isinstance(spec, dict):
        raise MessageError("tensor spec must be an object")
    name = spec.get("name")
    if not isinstance(name, str) or name not in TENSORS:
        raise MessageError(f"unknown tensor field {str(name)[:80]!r}")
    dtype, ragged = TENSORS[name].dtype, TENSORS[name].wire == "ragged"
    if not isinstance(spec.get("dtype"), str) or spec["dtype"] != dtype:
        raise MessageError(f"{name}: dtype {str(spec.get('dtype'))[:20]!r} not allowed, expected {dtype!r}")
    dims = _int_list(spec.get("lengths" if ragged else "shape"), f"{name} {'lengths' if ragged else 'shape'}", 0)
    count = sum(dims) if ragged else math.prod(dims)
    expected = count * np.dtype(dtype).itemsize
    if spec.get("nbytes") != expected or len(frame) != expected:
        raise MessageError(f"{name}: {len(frame)} bytes do not match its shape ({expected} bytes expected)")
    array = np.frombuffer(frame, dtype=dtype).copy()
    tensor = torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=False))
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise MessageError(f"{name}: holds NaN or infinite values")
    if name.endswith("_ids") and tensor.numel() and int(tensor.min()) < 0:
        raise MessageError(f"{name}: negative token id")
    if ragged:
        return name, list(tensor.split(dims)), dims
    return name, tensor.reshape(dims), dims


def _check_consistency(h: dict, dims: dict) -> None:
    sizes = _int_list(h["group_sizes"], "group_sizes", 1)
    n = sum(sizes)
    if len(dims["prompt_ids"]) != len(sizes):
        raise MessageError(f"{len(dims['prompt_ids'])} prompts but {len(sizes)} group sizes")
    if len(dims["completion_ids"]) != n:
        raise MessageError(f"{len(dims['completion_ids'])} completions but group sizes sum to {n}")
    if 0 in dims["prompt_ids"] or 0 in dims["completion_ids"]:
        raise MessageError("empty prompt or completion")
    if not all(isinstance(r, str) for r in h["reward_names"]):
        raise MessageError("reward_names must be strings")
    for f in TENSOR_FIELDS:
        if f.name not in dims:
            continue
        if f.rows == "token" and dims[f.name] != dims["completion_ids"]:
            raise MessageError(f"{f.name} lengths do not match the completions")
        if f.wire == "tensor":
            shape = [n] + ([len(h[f.columns])] if f.columns else [])
            if dims[f.name] != shape:
                raise MessageError(f"{f.name} has shape {dims[f.name]}, expected {shape}")
    if h["step"] < 0 or h["sampler"] < 0 or h["policy_version"] < 0:
        raise MessageError("step, sampler and policy_version must be >= 0")


def _check_versions(policy_version: int, versions: list[torch.Tensor], model_mask: list[torch.Tensor] | None) -> None:
    """Every model token has a version, environment tokens none, and policy_version is the oldest."""
    model = torch.cat(versions)
    if model_mask is not None:
        mask = torch.cat(model_mask)
        if bool((model[~mask] != ENVIRONMENT_TOKEN).any()):
            raise MessageError(f"token_versions: an environment's token must be {ENVIRONMENT_TOKEN}")
        model = model[mask]
    if model.numel() and int(model.min()) < 0:
        raise MessageError("token_versions: a model token without a version")
    if model.numel() and int(model.min()) != policy_version:
        raise MessageError(f"policy_version {policy_version} is not the oldest token's version {int(model.min())}")


def _check_segments(segments: list[torch.Tensor] | None, model_mask: list[torch.Tensor] | None) -> None:
    """Each sample's rows: 0 first, then each new row one more, and each new row begins with context (its first
    token the template's or the harness's: the shared-prefix forward reads no log-prob of it)."""
    if segments is None:
        return
    if model_mask is None:
        raise MessageError("segments: a sample of several rows needs model_mask (a new row begins with context)")
    for j, (rows, mask) in enumerate(zip(segments, model_mask)):
        steps = rows.diff(prepend=rows.new_zeros(1))
        if bool(((steps != 0) & (steps != 1)).any()) or (len(rows) and int(rows[0]) != 0):
            raise MessageError(f"segments: sample {j}'s row indices must start at 0 and grow by one at a time")
        if bool(mask[steps == 1].any()):
            raise MessageError(f"segments: sample {j} has a row that begins with a model token")


def _check_images(h: dict, tensors: dict) -> None:
    """Images travel per prompt, both fields or neither: each prompt's grids whole (3 numbers an image, each at least
    1), its pixels exactly its patches x patch_values, at most MAX_IMAGE_PATCHES patches."""
    pixels, grids = tensors.get("image_pixels"), tensors.get("image_grids")
    if pixels is None and grids is None:
        return
    if pixels is None or grids is None:
        raise MessageError("image_pixels and image_grids travel together")
    prompts, patch_values = len(tensors["prompt_ids"]), h["patch_values"]
    if len(pixels) != prompts or len(grids) != prompts:
        raise MessageError(f"images for {len(pixels)} and {len(grids)} prompts, and the batch has {prompts}")
    if patch_values < 1:
        raise MessageError("patch_values must be >= 1 in a batch with images")
    for i, (values, grid) in enumerate(zip(pixels, grids)):
        if len(grid) % 3 or (len(grid) and (int(grid.min()) < 1 or int(grid.max()) > MAX_GRID_SIDE)):
            raise MessageError(f"image_grids: prompt {i}'s grid is not (time, height, width) in 1..{MAX_GRID_SIDE} "
                               "an image")
        patches = int(grid.reshape(-1, 3).prod(-1).sum())
        if patches > MAX_IMAGE_PATCHES:
            raise MessageError(f"image_pixels: prompt {i}'s images hold {patches} patches, over {MAX_IMAGE_PATCHES}")
        if len(values) != patches * patch_values:
            raise MessageError(f"image_pixels: prompt {i} holds {len(values)} values; its grids make {patches} "
                               f"patches of {patch_values}")


def decode_batch(frames, secret: bytes | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> RolloutBatch:
    """Frames -> RolloutBatch, or MessageError for any bad input (never another exception)."""
    try:
        return _decode(frames, secret, max_bytes)
    except MessageError:
        raise
    except Exception as e:  # a decoder bug must still read as a rejected message, not a crash
        raise MessageError(f"malformed message ({type(e).__name__}: {str(e)[:200]})") from None


def _decode(frames, secret, max_bytes) -> RolloutBatch:
    if not isinstance(frames, (list, tuple)) or not frames or not all(isinstance(f, (bytes, bytearray, memoryview))
                                                                     for f in frames):
        raise MessageError("a message is a non-empty list of byte frames")
    frames = [bytes(f) for f in frames]
    size = sum(len(f) for f in frames)
    if size > max_bytes:
        raise MessageError(f"message of {size} bytes exceeds the cap of {max_bytes}")
    if secret is not None:
        problem = signature_problem(frames, secret)
        if problem:
            raise MessageError(problem)
        frames = frames[1:]
    header = _header(frames[0])
    specs = header["tensors"]
    if len(specs) != len(frames) - 1:
        raise MessageError(f"header lists {len(specs)} tensors but {len(frames) - 1} frames follow")
    tensors, dims = {}, {}
    for spec, frame in zip(specs, frames[1:]):
        name, value, shape = _tensor(spec, frame)
        if name in tensors:
            raise MessageError(f"tensor field '{name}' appears twice")
        tensors[name], dims[name] = value, shape
    for f in TENSOR_FIELDS:
        if f.name not in tensors and not f.optional:
            raise MessageError(f"missing tensor field '{f.name}'")
    _check_consistency(header, dims)
    _check_versions(header["policy_version"], tensors["token_versions"], tensors.get("model_mask"))
    _check_segments(tensors.get("segments"), tensors.get("model_mask"))
    _check_images(header, tensors)
    return RolloutBatch(**{f.name: header[f.name] if f.wire == "header" else tensors.get(f.name) for f in FIELDS})
