"""Generation on a transformers model that prefills each prompt once and shares its KV cache among its G
completions.

`generate` runs the continuous decode loop (grpo/sampler/rollout/continuous.py): at most
`generation_batch_size` rows, a finished row refilled at once with the call's next completion, each
prompt prefilled once (all but its last token) when its group's first completion joins. The pieces
it is built from are here: `InPlaceLayer`, buffers that take each new token in place, and
`TokenSampler`, which draws tokens and records their log-probs (used as the old log-probs with
`sampling.old_logps=generation`). `generate_in_blocks` is the loop before it, for models the
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
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo.model.completions import chunk_major_to_prompt_major, cut_at_eos, eos_token_ids
from grpo.model.loading import unwrap_causal_lm
from grpo.sampler.rollout import Rollouts
from grpo.wire.weights import INITIAL_DIGEST, Staged, stage_into


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


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


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[N, vocab] float64 probabilities, [N, 1] uniforms in [0, 1) -> [N] tokens: token i when u
    falls in [cdf_{i-1}, cdf_i). In float64 the cumulative sum keeps every token's share to ~1e-16
    (in float32 the tail's small probabilities round to nothing after ~1 of mass: ~1e-4 of the
    embedded model's mass could never be drawn)."""
    cdf = probs.cumsum(-1)  # [N, vocab]
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1)  # right: never a zero-probability token
    last_possible = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(-1)  # u rounded up to the total
    return torch.minimum(tokens, last_possible)


class TokenSampler:
    """Draws each next token from the raw logits and records its log-prob on the way.

    Sampling is inverse-CDF in float64 from softmax(logits / T) after top-k / top-p (transformers'
    own warpers): torch.multinomial takes ~25 ms per step for 16 x 49k probabilities on one CPU
    thread, about 8% of a decode step of the embedded model; a cumulative sum and a binary
    search take a few ms. The recorded log-prob is the one under the untruncated softmax(logits / T),
    as the trainer computes it.
    """

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0, greedy: bool = False):
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.temperature, self.greedy, self.logps = (1.0 if greedy else temperature), greedy, []
        self.warpers = ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])

    def draw(self, scores: torch.Tensor, u: torch.Tensor | None = None) -> torch.Tensor:
        """[N, vocab] logits -> [N] tokens; `u`: the rows' [N, 1] float64 uniforms (default: drawn
        from torch's global generator, one per row in row order)."""
        logits = scores.float() / self.temperature
        tokens = logits.argmax(-1) if self.greedy else self._draw(logits, u)
        self.logps.append(torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1))
        return tokens

    def _draw(self, logits: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        for warper in self.warpers:
            logits = warper(None, logits)  # top-k / top-p look at the scores only
        if u is None:
            u = torch.rand(len(logits), 1, device=logits.device, dtype=torch.float64)
        return inverse_cdf(torch.softmax(logits.double(), dim=-1), u.to(logits.device))

    def recorded(self) -> torch.Tensor:
        """[N, steps] log-probs of the drawn tokens."""
        return torch.stack(self.logps, dim=1)


class InPlaceLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of a larger buffer, each new token written
    in place; the buffer grows by `GROWTH` positions when full (a write of many positions at once, an
    episode's reply, gets `GROWTH` free positions after it).

    DynamicLayer concatenates every token onto the layer's cache, copying the whole cache each
    time (~5 MB a layer a token on the default workload, 29% of a decode step). A preallocated
    StaticCache avoids the copies but attends over its whole length every token, which took the
    gain back (docs/performance.md); a view attends over the tokens so far only. Growing in steps
    rather than reserving `max_new_tokens` keeps the memory at what the completions use (16 rows
    of the embedded model: 0.7 MB a position) for a copy every 64 tokens.
    """

    GROWTH = 64

    @classmethod
    def repeated(cls, layer: DynamicLayer, repeats: int) -> "InPlaceLayer":
        """`layer` (keys [B, H, n, Dk], values [B, H, n, Dv]) repeated `repeats` ways along the batch
        (row i -> rows i*repeats...): the repeat and the first reservation are one copy."""
        new = cls()
        n = layer.keys.shape[2]
        new.dtype, new.device, new.is_initialized, new.length = layer.dtype, layer.device, True, n
        for name, cached in (("key_buffer", layer.keys), ("value_buffer", layer.values)):
            b, heads, _, dim = cached.shape  # keys and values may differ in head size (MLA: DeepSeek-V3)
            buffer = cached.new_empty(b * repeats, heads, n + cls.GROWTH, dim)
            buffer.view(b, repeats, heads, n + cls.GROWTH, dim)[:, :, :, :n] = cached[:, None]
            setattr(new, name, buffer)
        new._expose()
        return new

    @classmethod
    def of_rows(cls, kept: tuple[torch.Tensor, torch.Tensor] | None,
                joining: list[tuple[torch.Tensor, torch.Tensor] | None], width: int) -> "InPlaceLayer":
        """A layer `width` columns wide: the rows of `kept` (keys [K, H, w, Dk], values [K, H, w, Dv]),
        then one row per `joining` entry (keys [H, n, Dk], values [H, n, Dv]; None: nothing cached), each
        right-aligned, the columns left of them zero (masked), GROWTH positions free after them."""
        new = cls()
        like = kept if kept is not None else next(kv for kv in joining if kv is not None)
        rows = (len(kept[0]) if kept is not None else 0) + len(joining)
        for name, example, part in (("key_buffer", like[0], 0), ("value_buffer", like[1], 1)):
            # zeros, not garbage: a masked column's value still meets a zero weight (NaN * 0 is NaN)
            buffer = example.new_zeros(rows, example.shape[-3], width + cls.GROWTH, example.shape[-1])
            if kept is not None:
                buffer[: len(kept[part]), :, width - kept[part].shape[2]: width] = kept[part]
            start = rows - len(joining)
            for first, last, kv in runs_of(joining):  # a group's rows share their prompt's KV: one copy each run
                if kv is not None and kv[part].shape[1]:
                    buffer[start + first: start + last, :, width - kv[part].shape[1]: width] = kv[part]
            setattr(new, name, buffer)
        new.dtype, new.device, new.is_initialized, new.length = like[0].dtype, like[0].device, True, width
        new._expose()
        return new

    def _expose(self) -> None:
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def _grow(self, needed: int) -> None:
        capacity = self.key_buffer.shape[2] + self.GROWTH
        if needed >= capacity:  # many positions at once (an episode's reply): GROWTH free after them too,
            capacity = needed + self.GROWTH  # or the next token would copy the buffer again
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            buffer = old.new_empty(old.shape[0], old.shape[1], capacity, old.shape[3])
            buffer[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, buffer)

    def batch_select_indices(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (episodes that ended leave the batch), with GROWTH positions free."""
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            buffer = old.new_empty(len(rows), old.shape[1], self.length + self.GROWTH, old.shape[3])
            buffer[:, :, : self.length] = old[rows, :, : self.length]
            setattr(self, name, buffer)
        self._expose()

    def keep_columns(self, columns: torch.Tensor) -> None:
        """Row r keeps the positions columns[r] ([rows, n], in that order), GROWTH positions free after them."""
        rows, n = columns.shape
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            buffer = old.new_empty(rows, old.shape[1], n + self.GROWTH, old.shape[3])
            index = columns[:, None, :, None].expand(rows, old.shape[1], n, old.shape[3])
            buffer[:, :, :n] = old[:, :, : self.length].gather(2, index)
            setattr(self, name, buffer)
        self.length = n
        self._expose()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[-2]
        if end > self.key_buffer.shape[2]:
            self._grow(end)
        self.key_buffer[:, :, self.length:end] = key_states
        self.value_buffer[:, :, self.length:end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values


def runs_of(items: list) -> list[tuple[int, int, object]]:
    """(first, end, item) for each run of the same object (by identity) in `items`."""
    runs = []
    for i, item in enumerate(items):
        if runs and runs[-1][2] is item:
            runs[-1] = (runs[-1][0], i + 1, item)
        else:
            runs.append((i, i + 1, item))
    return runs


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


@dataclass
class DecodeRows:
    """What the decode steps since the last `take` computed: the steps, the rows they ran, and of
    those the rows still generating (not done, not past their limit, not waiting to leave the
    batch); the steps at a full batch (generation_batch_size rows generating, or every sequence of
    the call where it has fewer); episodes waiting on their environment, and the time the loop had
    nothing to decode but waited on them. Live rows per step below the batch's rows is what a
    step's slowest sequence costs."""

    steps: int = 0
    rows: int = 0
    live: int = 0
    full: int = 0
    waiting: int = 0
    idle_s: float = 0.0
    ahead: float | None = None  # the share of a call's completions the call before it started (`then`)

    def add(self, rows: int, live: int, full_at: int | None = None, waiting: int = 0) -> None:
        self.steps, self.rows, self.live = self.steps + 1, self.rows + rows, self.live + live
        self.full += live >= (rows if full_at is None else full_at)
        self.waiting += waiting

    def idle(self, seconds: float) -> None:
        self.idle_s += seconds

    def take(self) -> dict[str, float]:
        """The metrics of the steps so far (none without a step), and a fresh count."""
        metrics = {} if not self.steps else {
            "sampler/decode_steps": float(self.steps), "sampler/live_rows_per_decode_step": self.live / self.steps,
            "sampler/live_row_fraction": self.live / self.rows, "sampler/full_decode_step_fraction": self.full / self.steps,
            "env/waiting_per_decode_step": self.waiting / self.steps, "timing/env_idle_s": self.idle_s}
        if self.ahead is not None:
            metrics["sampler/started_ahead_fraction"] = self.ahead
        self.steps = self.rows = self.live = self.full = self.waiting = 0
        self.idle_s, self.ahead = 0.0, None
        return metrics


@dataclass
class NextCall:
    """A generate call to come: `HFEngine.generate(then=...)` starts its completions in the rows the
    current call leaves free."""

    prompts: list[list[int]]
    group_size: int
    seed: int | None
    max_new_tokens: Sequence[int] | None = None


@dataclass
class Carried:
    """A call's completions started in the loop of the call before it, with the weights then served."""

    call: object  # grpo.sampler.rollout.continuous.Call
    greedy: bool
    loop: object  # grpo.sampler.rollout.continuous.ContinuousLoop

    def matches(self, call, greedy: bool) -> bool:
        """Whether `call` is the one carried: the same prompts, G, seed and limits, sampled alike."""
        mine = self.call
        return (greedy == self.greedy and call.seed == mine.seed and call.group_size == mine.group_size
                and call.budgets == mine.budgets and call.prompts == mine.prompts)


class HFEngine:
    """The `RolloutEngine` on a transformers model, which is also the sampler's scoring model."""

    def __init__(self, model, tokenizer, sampling_cfg):
        self.model, self.tokenizer, self.cfg = model, tokenizer, sampling_cfg
        self.eos_ids = eos_token_ids(tokenizer, model)  # the checkpoint's EOS list counts; its processors do not
        self.version, self.weights_digest = 0, INITIAL_DIGEST
        self.decode_rows = DecodeRows()  # the decode steps' rows, for the step's metrics
        self.carried: Carried | None = None  # the next call's completions, started (generate's `then`)

    def stage_weights(self, folder: Path, manifest: dict, version: int) -> Staged:
        staged = stage_into(self.model, folder, manifest)

        def commit():
            staged.commit()
            self.version, self.weights_digest = version, manifest["digest"]
            self.carried = None  # started with the weights before: made again with these
        return Staged(commit)

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

    def _decode(self, ids: torch.Tensor, mask: torch.Tensor, cache, sampler: TokenSampler,
                limits: torch.Tensor) -> torch.Tensor:
        """Decode from the cache of every prompt token but the last: [N, steps] tokens, padded.

        One forward per token for all N rows, as `generate`'s greedy loop ran it over our
        sampler: positions continue each row's unpadded count, rows that drew EOS get the pad
        token from then on and stay in the batch (their random draws too, so a seed gives the
        same tokens however the rows end). It stops once every row has drawn EOS or reached its
        own limit.
        """
        n, width = ids.shape
        steps = int(limits.max())
        eos = torch.tensor(self.eos_ids, device=ids.device)
        pad = self.tokenizer.pad_token_id
        mask = torch.cat([mask, mask.new_ones(n, steps)], dim=1)
        position = mask[:, :width].sum(-1, keepdim=True) - 1  # the last prompt token's
        out = ids.new_full((n, steps), pad)
        unfinished = torch.ones(n, dtype=torch.bool, device=ids.device)
        token = ids[:, -1:]
        with torch.no_grad():
            for t in range(steps):
                self.decode_rows.add(n, int((unfinished & (limits > t)).sum()), min(n, self.cfg.generation_batch_size))
                logits = self.model(input_ids=token, attention_mask=mask[:, : width + t], position_ids=position + t,
                                    past_key_values=cache, use_cache=True).logits[:, -1]
                drawn = torch.where(unfinished, sampler.draw(logits), pad)
                out[:, t] = drawn
                unfinished &= ~torch.isin(drawn, eos)
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
                 then: "NextCall | None" = None) -> Rollouts:
        """G completions of each prompt in the continuous loop (grpo/sampler/rollout/continuous.py: at most
        generation_batch_size rows, a finished row refilled at once with the call's next completion), each
        completion seeded on its own; in blocks (`generate_in_blocks`) with sampling.continuous_batching
        off, or for a model the loop cannot continue (sliding-window layers, ALiBi).

        `then`: the next call, sampled with the weights served now: its completions take the rows this
        call's leave free at its end, and stay in the loop (`carried`) for that call, which finds them
        started (or done). A greedy call (an evaluation) leaves them; another sampled call, or new
        weights, drop them (their tokens are the same whichever way they are made: each completion's
        seed is its own)."""
        from grpo.sampler.rollout.continuous import Call, ContinuousLoop, runs_continuously  # it builds on this module

        if not (self.cfg.continuous_batching and runs_continuously(self)):
            return self.generate_in_blocks(prompts, group_size, seed=seed, greedy=greedy, max_new_tokens=max_new_tokens)
        call = self._call(Call, NextCall(prompts, group_size, seed, max_new_tokens), greedy)
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
            self.carried = Carried(self._call(Call, then, greedy), greedy, loop)  # a newer one replaces it
            loop.add(self.carried.call)
        loop.run(until=call)
        ended = call.ended
        return Rollouts([ended[j][0] for j in range(len(ended))], [ended[j][2] for j in range(len(ended))],
                        [ended[j][1] for j in range(len(ended))])

    def _call(self, call_type, spec: "NextCall", greedy: bool):
        """The loop's Call for `spec`, recording each completion as it ends (one message: it is done)."""
        ended: dict[int, tuple] = {}

        def record(j: int, ids: torch.Tensor, logps: torch.Tensor, cut: bool) -> None:
            ended[j] = (ids, logps, cut)

        limits = list(spec.max_new_tokens) if spec.max_new_tokens is not None else \
            [self.cfg.max_new_tokens] * len(spec.prompts)
        call = call_type.of(spec.prompts, spec.group_size, limits, spec.seed, greedy, record)
        call.ended = ended
        return call

    def generate_in_blocks(self, prompts: list[list[int]], group_size: int, *, seed: int | None = None,
                           greedy: bool = False, max_new_tokens: Sequence[int] | None = None) -> Rollouts:
        """G completions of each prompt, decoded in chunks of at most generation_batch_size rows:
        blocks of prompts (`prompt_blocks`; later turns of episodes are many prompts of one
        completion each), each prefilled once and decoded in chunks of its completions (`chunk_plan`),
        each chunk until its slowest sequence is done; torch's generator draws every row's tokens."""
        limits = list(max_new_tokens) if max_new_tokens is not None else [self.cfg.max_new_tokens] * len(prompts)
        if seed is not None:
            torch.manual_seed(seed)
        parts = [self._generate_block([prompts[i] for i in block], group_size, greedy, [limits[i] for i in block])
                 for block in prompt_blocks(len(prompts), self.cfg.generation_batch_size)]
        return Rollouts(*([x for part in parts for x in getattr(part, name)]
                          for name in ("completion_ids", "truncated", "logps")))

    def _generate_block(self, prompts: list[list[int]], group_size: int, greedy: bool, limits: list[int]) -> Rollouts:
        cfg = self.cfg
        ids, mask = left_pad(prompts, self.tokenizer.pad_token_id)
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = self._prefill(ids, mask) if ids.shape[1] > 1 else None
        plan = chunk_plan(len(prompts), group_size, cfg.generation_batch_size)
        produced, truncated, logps = [], [], []
        for k in plan:
            row_limits = torch.tensor(limits, device=self.device).repeat_interleave(k)
            if cache is None:  # one-token prompts: nothing to prefill
                chunk_cache = DynamicCache(config=self.model.config)
            else:
                chunk_cache = repeat_in_place(cache, k)
            sampler = TokenSampler(cfg.temperature, cfg.top_k, cfg.top_p, greedy=greedy)
            out = self._decode(ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0), chunk_cache, sampler,
                               row_limits)
            recorded = sampler.recorded().cpu()
            for i, row in enumerate(out.cpu()):  # chunk rows: k per prompt, prompt-major
                tokens, cut = cut_at_eos(row[:limits[i // k]], self.eos_ids)
                produced.append(tokens)
                truncated.append(cut)
                logps.append(recorded[i, :len(tokens)].clone())

        def prompt_major(items):
            return chunk_major_to_prompt_major(items, len(prompts), plan)

        return Rollouts(prompt_major(produced), prompt_major(truncated), prompt_major(logps))
