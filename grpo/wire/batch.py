"""RolloutBatch: the sampler's output, in memory and on the wire.

Ragged and unpadded. Prompt-major: completion j of prompt i sits at sum(group_sizes[:i]) + j,
whatever chunking the generator used. `FIELDS` declares every field once (how it travels, its
dtype, what its first axis runs over); the wire format (grpo/wire/transport.py), its validation and
the split into groups (grpo/model/sharding.py) are derived from it, so a new field is one line here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from grpo.weights.folder import INITIAL_DIGEST

# /2: every token carries the weights version that sampled it (token_versions); /3: no loss denominators
# (the trainer counts them from the batch it holds); /4: each sample's total and whether it was scored or failed
# (the trainer recomputes the advantages from them); /5: a sample may hold several rows, each its own context
# (segments: an agent's session whose requests did not continue what the model read), and a prompt may hold images
SCHEMA = "grpo.rollout/5"
ENVIRONMENT_TOKEN = -1  # token_versions of a token an environment wrote (episodes): no version sampled it


@dataclass
class RolloutBatch:
    step: int  # sampler step, monotonic per sampler; the trainer de-duplicates by (sampler, step)
    policy_version: int  # the weights version that sampled its oldest token (staleness is bounded by it)
    prompt_ids: list[torch.Tensor]  # B x int64 [P_i], no padding
    completion_ids: list[torch.Tensor]  # N = sum(group_sizes) x int64 [C_j], cut after the first EOS (kept)
    group_sizes: list[int]  # [B], G per prompt
    old_logps: list[torch.Tensor] | None  # N x float32 [C_j]: the generating policy, at the sampling temperature
    ref_logps: list[torch.Tensor] | None  # N x float32 [C_j]: the reference policy; None when beta = 0
    rewards: torch.Tensor  # float32 [N, R], per reward function, before weighting
    reward_names: list[str]  # [R]
    advantages: torch.Tensor  # float32 [N], group-relative
    truncated: torch.Tensor  # bool [N], hit max_new_tokens without EOS
    meta: dict = field(default_factory=dict)  # JSON-safe: sample ids, timings, sampler metrics
    sampler: int = 0  # which sampler made it: the delivery key is (sampler, step) (grpo/wire/delivery.py)
    behaviour: dict = field(default_factory=dict)  # how it was sampled (grpo/wire/behaviour.py), checked by the trainer
    # sha256 of policy_version's manifest.json (grpo/weights/folder.py), checked too
    weights_digest: str = INITIAL_DIGEST
    model_mask: list[torch.Tensor] | None = None  # N x bool [C_j]: the model's tokens of multi-turn episodes
    # (grpo/sampler/episodes.py); the environment's are context only, out of the loss. None: every token is the model's
    # N x int32 [C_j]: the weights version that sampled each token; ENVIRONMENT_TOKEN where an environment wrote it
    token_versions: list[torch.Tensor] | None = None
    # what the advantages were made from (grpo/objective/advantages.py), so that the trainer can check them:
    totals: torch.Tensor | None = None  # float32 [N], the weighted rewards (a failed sample: the batch's worst)
    scored: torch.Tensor | None = None  # bool [N], the samples in their group's mean and std
    worst: torch.Tensor | None = None  # bool [N], the samples a reward failed on, scoring the batch's worst
    teacher_logps: list[torch.Tensor] | None = None  # N x float32 [C_j]: distill.teacher's; None without one
    # N x int32 [C_j]: which of its sample's rows each token is in (0, then 1 from where a second row begins ...):
    # each row is read after the prompt alone, not after the rows before it (grpo/model/segments.py). None: one row each
    segments: list[torch.Tensor] | None = None
    # a prompt's images (vision-language models: grpo/model/vision.py), flattened: every image's patches, each of
    # patch_values values, and each image's (time, height, width) in patches; an empty tensor for a prompt without
    image_pixels: list[torch.Tensor] | None = None  # B x float32 [patches x patch_values]
    image_grids: list[torch.Tensor] | None = None  # B x int64 [3 x images]
    patch_values: int = 0  # values a patch holds (channels x temporal patch x patch size^2); 0: no images
    schema: str = SCHEMA

    def __post_init__(self):
        if self.token_versions is None:  # sampled with one version: policy_version on every model token
            self.token_versions = one_version(self.policy_version, self.completion_ids, self.model_mask)

    def group_slices(self) -> list[slice]:
        """The completions of each prompt."""
        out, start = [], 0
        for g in self.group_sizes:
            out.append(slice(start, start + g))
            start += g
        return out


def one_version(version: int, completion_ids: list[torch.Tensor], model_mask: list[torch.Tensor] | None = None
                ) -> list[torch.Tensor]:
    """token_versions of completions sampled with `version` alone (ENVIRONMENT_TOKEN at an environment's tokens)."""
    versions = [torch.full((len(c),), version, dtype=torch.int32) for c in completion_ids]
    if model_mask is not None:
        versions = [torch.where(m.bool(), v, ENVIRONMENT_TOKEN) for v, m in zip(versions, model_mask)]
    return versions


@dataclass(frozen=True)
class Field:
    """How one RolloutBatch field travels and what its first axis runs over.

    wire: "header" (a JSON value of Python type `dtype`), "ragged" (a list of 1-D tensors sent as
    one flat frame plus lengths) or "tensor" (one tensor, one frame); `dtype` is then the
    little-endian numpy dtype on the wire, the only one accepted. rows: "prompt" (one entry per
    prompt), "completion" (one per completion), "token" (ragged, one value per completion token)
    or "" (the whole batch). columns: the header list whose length is the tensor's second axis.
    """

    name: str
    wire: str
    dtype: Any
    rows: str = ""
    optional: bool = False
    columns: str = ""


FIELDS = (
    Field("schema", "header", str),
    Field("step", "header", int),
    Field("sampler", "header", int),
    Field("policy_version", "header", int),
    Field("prompt_ids", "ragged", "<i8", rows="prompt"),
    Field("completion_ids", "ragged", "<i8", rows="completion"),
    Field("group_sizes", "header", list, rows="prompt"),
    Field("old_logps", "ragged", "<f4", rows="token", optional=True),
    Field("ref_logps", "ragged", "<f4", rows="token", optional=True),
    Field("teacher_logps", "ragged", "<f4", rows="token", optional=True),
    Field("segments", "ragged", "<i4", rows="token", optional=True),
    Field("image_pixels", "ragged", "<f4", rows="prompt", optional=True),
    Field("image_grids", "ragged", "<i8", rows="prompt", optional=True),
    Field("patch_values", "header", int),
    Field("rewards", "tensor", "<f4", rows="completion", columns="reward_names"),
    Field("reward_names", "header", list),
    Field("advantages", "tensor", "<f4", rows="completion"),
    Field("truncated", "tensor", "|b1", rows="completion"),
    Field("model_mask", "ragged", "|b1", rows="token", optional=True),
    Field("token_versions", "ragged", "<i4", rows="token"),
    Field("totals", "tensor", "<f4", rows="completion"),
    Field("scored", "tensor", "|b1", rows="completion"),
    Field("worst", "tensor", "|b1", rows="completion"),
    Field("meta", "header", dict),
    Field("behaviour", "header", dict),
    Field("weights_digest", "header", str),
)
HEADER_FIELDS = tuple(f for f in FIELDS if f.wire == "header")
TENSOR_FIELDS = tuple(f for f in FIELDS if f.wire != "header")
