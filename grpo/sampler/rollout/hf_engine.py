"""Generation on a transformers model that prefills each prompt once and shares its KV cache among its G
completions.

`generate` runs the continuous decode loop (grpo/sampler/rollout/continuous.py): at most
`generation_batch_size` rows, a finished row refilled at once with the call's next completion, each
prompt prefilled once (all but its last token) when its group's first completion joins. Both loops
are built from grpo/sampler/rollout/decoding.py: `InPlaceLayer`, buffers that take each new token in
place, and `TokenSampler`, which draws tokens and records their log-probs (used as the old log-probs
with `sampling.old_logps=generation`). `generate_in_blocks` is the loop before it, for models the
continuous loop cannot run (sliding-window layers, ALiBi) and for comparison: B x G in chunks of at
most `generation_batch_size` rows, each chunk taking some completions of every prompt, the prefill
repeated G ways, each chunk decoded until its slowest completion ends.

Why not `model.generate`: its per-token bookkeeping was ~13% of a decode step of the default
workload, and it fills unset sampling settings from the checkpoint's generation config
(repetition penalties and the like would change the distribution the tokens come from). The
block loop does what its greedy path did, token for token (tests/test_rollout.py checks it
against `generate` under a seed).
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
from pathlib import Path
from typing import Callable, Sequence

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo.model.completions import chunk_major_to_prompt_major, cut_at_eos, eos_token_ids
from grpo.model.loading import unwrap_causal_lm
from grpo.model.vision import prompt_inputs, vision_language_model
from grpo.sampler.rollout import Rollouts
from grpo.sampler.rollout.continuous import Carried, ContinuousLoop
from grpo.sampler.rollout.decode_graphs import DecodeGraphs
from grpo.sampler.rollout.decoding import DecodeRows, InPlaceLayer, StopStrings, TokenSampler, left_pad, seen_tokens
from grpo.sampler.rollout.loop_cache import runs_continuously
from grpo.sampler.rollout.sequences import Call, NextCall, any_images
from grpo.weights.folder import INITIAL_DIGEST, Staged, stage_into

log = logging.getLogger(__name__)


def chunk_plan(num_prompts: int, group_size: int, max_sequences: int) -> list[int]:
    """Completions per prompt in each chunk, e.g. B=2, G=8, max 6 -> [3, 3, 2]."""
    per_chunk = max(1, max_sequences // num_prompts)
    plan = []
    while sum(plan) < group_size:
        plan.append(min(per_chunk, group_size - sum(plan)))
    return plan


def prompt_blocks(num_prompts: int, max_sequences: int) -> list[range]:
    """Prompts decoded together: at most max_sequences, so that a chunk of one completion each
    fits (`chunk_plan`); e.g. 128 prompts, max 64 -> two blocks of 64 (a later turn of 16 x 8 episodes)."""
    return [range(start, min(start + max_sequences, num_prompts)) for start in range(0, num_prompts, max_sequences)]


def repeat_in_place(cache, repeats: int):
    """A copy of the prefill cache with each row repeated `repeats` ways, its full-attention layers
    as `InPlaceLayer`s (other layer kinds, e.g. sliding windows, repeated as they are)."""
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        if type(layer) is DynamicLayer and layer.is_initialized:
            out.layers.append(InPlaceLayer.repeated(layer, repeats))
        else:
            layer = copy.deepcopy(layer)
            layer.batch_repeat_interleave(repeats)
            out.layers.append(layer)
    return out


class HFEngine:
    """The `RolloutEngine` on a transformers model, which is also the sampler's scoring model."""

    decodes_continuously = True  # grpo/sampler/rollout/continuous.py may run its loop on it (`runs_continuously`)
    generates_with_scoring_model = True

    @classmethod
    def build(cls, cfg, model, tokenizer) -> HFEngine:
        return cls(model, tokenizer, cfg.sampling)

    def __init__(self, model, tokenizer, sampling_cfg):
        self.model, self.tokenizer, self.cfg = model, tokenizer, sampling_cfg
        self.eos_ids = eos_token_ids(tokenizer, model)  # the checkpoint's EOS list counts; its processors do not
        self.version, self.weights_digest = 0, INITIAL_DIGEST
        self.decode_rows = DecodeRows()  # the decode steps' rows, for the step's metrics
        # sampling.in_flight_updates: loads a newly published version (the sampler's watcher), True when it did;
        # the loop calls it between decode steps
        self.poll_weights: Callable[[], bool] | None = None
        self.digests = {0: INITIAL_DIGEST}  # each version served: the oldest token's is the batch's
        self.carried: Carried | None = None  # the next call's completions, started (generate's `then`)
        self.graphs = DecodeGraphs.of(model, sampling_cfg)  # sampling.compile_decode: the loop's compiled step

    def stage_weights(self, folder: Path, manifest: dict, version: int) -> Staged:
        staged = stage_into(self.model, folder, manifest)

        def commit():
            staged.commit()
            self.version, self.weights_digest = version, manifest["digest"]
            self.digests[version] = manifest["digest"]
            self.carried = None  # started with the weights before: made again with these
        return Staged(commit)

    @property
    def loop_metrics(self) -> DecodeRows:
        """What the sampler's step takes from the engine's loop (vLLM has its own)."""
        return self.decode_rows

    def load_weights(self, folder: Path, manifest: dict, version: int) -> None:
        self.stage_weights(folder, manifest, version).commit()

    def close(self) -> None:
        pass  # the model is the sampler's; nothing of the engine's own to release

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor):
        """Run every prompt token but the last once; the decode loop starts from this cache."""
        cache = DynamicCache(config=self.model.config)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() uses with left padding
        with torch.no_grad():
            self.model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                       past_key_values=cache, use_cache=True, **self._one_logit_row)
        return cache

    def _prefill_images(self, prompts: list[list[int]], images: list, pad: int):
        """A vision-language model's prefill of left-padded prompts with their images (grpo/model/vision.py: the
        image tokens' embeddings are the vision encoder's features, the positions M-RoPE's), every token but the
        last; (the cache, each row's shift of its text positions: how far its next position is from its length)."""
        vlm = vision_language_model(unwrap_causal_lm(self.model))
        width = max(len(p) for p in prompts) - 1
        embeddings, positions, shifts = [], torch.zeros(3, len(prompts), width, dtype=torch.long), []
        with torch.no_grad():
            for b, (prompt, own) in enumerate(zip(prompts, images)):
                ids = torch.tensor(prompt, device=self.device)
                embedded, placed, after = prompt_inputs(vlm, ids, own)
                row = vlm.get_input_embeddings()(torch.full((width,), pad, device=self.device))
                row[width - len(prompt) + 1:] = embedded[:-1]
                embeddings.append(row)
                positions[:, b, width - len(prompt) + 1:] = placed[:, :-1].cpu()
                shifts.append(after - len(prompt))
            _, mask = left_pad(prompts, pad)
            cache = DynamicCache(config=self.model.config)
            self.model(inputs_embeds=torch.stack(embeddings), attention_mask=mask[:, :-1].to(self.device),
                       position_ids=positions.to(self.device), past_key_values=cache, use_cache=True,
                       **self._one_logit_row)
        return cache, torch.tensor(shifts, device=self.device)[:, None]

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, cache, sampler: TokenSampler,
                limits: torch.Tensor, stopped: list[int] | None = None, shift: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Decode from the cache of every prompt token but the last: [N, steps] tokens, padded.

        One forward per token for all N rows, as `generate`'s greedy loop ran it over our
        sampler: positions continue each row's unpadded count, rows that drew EOS get the pad
        token from then on and stay in the batch (their random draws too, so a seed gives the
        same tokens however the rows end). It stops once every row has drawn EOS or reached its
        own limit. A row whose text came to hold a stop string (sampling.stop) ends as at EOS:
        `stopped[row]` is then its length (-1 for the others). `shift` [N, 1]: added to each row's positions (a
        prompt with images: its text goes on from its M-RoPE positions).
        """
        n, width = ids.shape
        steps = int(limits.max())
        eos = torch.tensor(self.eos_ids, device=ids.device)
        pad = self.tokenizer.pad_token_id
        mask = torch.cat([mask, mask.new_ones(n, steps)], dim=1)
        position = mask[:, :width].sum(-1, keepdim=True) - 1  # the last prompt token's
        position = position if shift is None else position + shift
        out = ids.new_full((n, steps), pad)
        unfinished = torch.ones(n, dtype=torch.bool, device=ids.device)
        token = ids[:, -1:]
        stops, stopped = StopStrings(self.tokenizer, self.cfg.stop), stopped if stopped is not None else []
        stopped[:] = [-1] * n
        seen = None  # the repetition penalty's: each row's prompt, then what it draws
        with torch.no_grad():
            for t in range(steps):
                self.decode_rows.add(n, int((unfinished & (limits > t)).sum()), min(n, self.cfg.generation_batch_size))
                logits = self.model(input_ids=token, attention_mask=mask[:, : width + t], position_ids=position + t,
                                    past_key_values=cache, use_cache=True).logits[:, -1]
                if sampler.penalises and seen is None:
                    seen = seen_tokens([row[m.bool()].tolist() for row, m in zip(ids, mask[:, :width])],
                                       logits.shape[-1], logits.device)
                drawn = torch.where(unfinished, sampler.draw(logits, seen=seen), pad)
                out[:, t] = drawn
                if seen is not None:
                    seen[torch.arange(n), drawn] = True
                unfinished &= ~torch.isin(drawn, eos)
                for row in ((unfinished & (limits > t)).nonzero().flatten().tolist() if stops else ()):
                    if stops.hit(out[row, : t + 1].tolist()):
                        unfinished[row], stopped[row] = False, t + 1
                if not bool((unfinished & (limits > t + 1)).any()):
                    return out[:, : t + 1]
                token = drawn[:, None]
        return out

    @functools.cached_property
    def _one_logit_row(self) -> dict:
        """Only the cache is wanted from the prefill: the LM head on one row instead of every
        prompt token's (2 x hidden x vocab FLOPs and a [tokens, vocab] float tensor each)."""
        forward = inspect.signature(unwrap_causal_lm(self.model).forward).parameters
        return {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    def generate(self, prompts: list[list[int]], group_size: int, *, seed: int | None = None,
                 greedy: bool = False, max_new_tokens: Sequence[int] | None = None,
                 then: NextCall | None = None, images: list | None = None) -> Rollouts:
        """G completions of each prompt in the continuous loop (grpo/sampler/rollout/continuous.py: at most
        generation_batch_size rows, a finished row refilled at once with the call's next completion), each
        completion seeded on its own; in blocks (`generate_in_blocks`) with sampling.continuous_batching
        off, or for a model the loop cannot continue (sliding-window layers, ALiBi).

        `then`: the next call, sampled with the weights served now: its completions take the rows this
        call's leave free at its end, and stay in the loop (`carried`) for that call, which finds them
        started (or done). A greedy call (an evaluation) leaves them; another sampled call, or new
        weights, drop them (their tokens are the same whichever way they are made: each completion's
        seed is its own). `images`: per prompt, its images (grpo/model/vision.py) or None: each prompt's images
        through the vision encoder once in its prefill, its completions' positions going on from its M-RoPE ones
        (`then.images` likewise)."""
        if not (self.cfg.continuous_batching and runs_continuously(self)):
            if self.poll_weights is not None and not greedy:  # the blocks do not poll: said once, then not asked
                self.poll_weights = None
                log.warning("sampling.in_flight_updates: this model decodes in blocks (its attention depends on "
                            "where a cached column sits: ALiBi, sliding windows), so new weights load between "
                            "steps only")
            if self.graphs is not None:
                self.graphs = None
                log.warning("sampling.compile_decode: completions decode in blocks here (sampling.continuous_batching "
                            "is off, or the model's attention depends on where a cached column sits: ALiBi, sliding "
                            "windows), and the blocks' steps run eagerly")
            return self.generate_in_blocks(prompts, group_size, seed=seed, greedy=greedy, max_new_tokens=max_new_tokens,
                                           images=any_images(images))
        call = self._call(NextCall(prompts, group_size, seed, max_new_tokens, images), greedy)
        loop = self.carried.loop if self.carried is not None and self.carried.matches(call, greedy) else None
        if loop is not None:
            call, self.carried = self.carried.call, None
            queued = sum(s.call is call for s in loop.fresh)
            self.decode_rows.ahead = (call.size - queued) / max(call.size, 1)
        else:
            if not greedy:
                self.carried = None
            loop = ContinuousLoop(self, greedy, None)
            loop.add(call)
        if then is not None:
            self.carried = Carried(self._call(then, greedy), greedy, loop)  # a newer one replaces it
            loop.add(self.carried.call)
        try:
            loop.run(until=call)
        except BaseException:
            self.carried = None  # the loop it was started in is gone
            raise
        ended = call.ended
        versions = [torch.tensor(call.versions[j], dtype=torch.int32) for j in range(len(ended))]
        return Rollouts([ended[j][0] for j in range(len(ended))], [ended[j][2] for j in range(len(ended))],
                        [ended[j][1] for j in range(len(ended))], token_versions=versions)

    def _call(self, spec: NextCall, greedy: bool) -> Call:
        """The loop's Call for `spec`, recording each completion in `call.ended` as it ends (one message:
        it is done)."""
        ended: dict[int, tuple] = {}

        def record(j: int, ids: torch.Tensor, logps: torch.Tensor, cut: bool) -> None:
            ended[j] = (ids, logps, cut)

        limits = list(spec.max_new_tokens) if spec.max_new_tokens is not None else \
            [self.cfg.max_new_tokens] * len(spec.prompts)
        call = Call.of(spec.prompts, spec.group_size, limits, spec.seed, greedy, record, images=any_images(spec.images))
        call.ended = ended
        return call

    def generate_in_blocks(self, prompts: list[list[int]], group_size: int, *, seed: int | None = None,
                           greedy: bool = False, max_new_tokens: Sequence[int] | None = None,
                           images: list | None = None) -> Rollouts:
        """G completions of each prompt, decoded in chunks of at most generation_batch_size rows:
        blocks of prompts (`prompt_blocks`; later turns of episodes are many prompts of one
        completion each), each prefilled once and decoded in chunks of its completions (`chunk_plan`),
        each chunk until its slowest sequence is done; torch's generator draws every row's tokens."""
        limits = list(max_new_tokens) if max_new_tokens is not None else [self.cfg.max_new_tokens] * len(prompts)
        if seed is not None:
            torch.manual_seed(seed)
        parts = [self._generate_block([prompts[i] for i in block], group_size, greedy, [limits[i] for i in block],
                                      None if images is None else [images[i] for i in block])
                 for block in prompt_blocks(len(prompts), self.cfg.generation_batch_size)]
        return Rollouts(*([x for part in parts for x in getattr(part, name)]
                          for name in ("completion_ids", "truncated", "logps")))

    def _generate_block(self, prompts: list[list[int]], group_size: int, greedy: bool, limits: list[int],
                        images: list | None = None) -> Rollouts:
        cfg = self.cfg
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        if images is not None and ids.shape[1] > 1:  # one-token prompts hold no image
            cache, shift = self._prefill_images(prompts, images, self.tokenizer.pad_token_id)
        else:
            cache, shift = self._prefill(ids, mask) if ids.shape[1] > 1 else None, None
        plan = chunk_plan(len(prompts), group_size, cfg.generation_batch_size)
        produced, truncated, logps = [], [], []
        for k in plan:
            row_limits = torch.tensor(limits, device=self.device).repeat_interleave(k)
            if cache is None:  # one-token prompts: nothing to prefill
                chunk_cache = DynamicCache(config=self.model.config)
            else:
                chunk_cache = repeat_in_place(cache, k)
            sampler, stopped = TokenSampler.of(cfg, greedy), []
            out = self._decode(ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0), chunk_cache, sampler,
                               row_limits, stopped, None if shift is None else shift.repeat_interleave(k, 0))
            recorded = sampler.recorded().cpu()
            for i, row in enumerate(out.cpu()):  # chunk rows: k per prompt, prompt-major
                tokens, cut = (row[:stopped[i]], False) if stopped[i] >= 0 else \
                    cut_at_eos(row[:limits[i // k]], self.eos_ids)
                produced.append(tokens)
                truncated.append(cut)
                logps.append(recorded[i, :len(tokens)].clone())

        def prompt_major(items):
            return chunk_major_to_prompt_major(items, len(prompts), plan)

        return Rollouts(prompt_major(produced), prompt_major(truncated), prompt_major(logps))
