"""The KV cache of the HF engine's continuous loop (grpo/sampler/rollout/continuous.py), which holds
masked columns between each row's real ones: the probe that decides, once per model, whether its
attention lets a sequence go on from such a cache as from one without (`masked_gap`, `continues`), and
the loop's copies of the cache (`LoopCache`, which `ContinuousLoop` is built on): the prompts' prefill,
a regroup's new batch with the rows parked or joining with their own columns, and every cached column
computed again under new weights.
"""

from __future__ import annotations

import logging
import math
import time
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo.sampler.rollout.decode_graphs import FixedCache
from grpo.sampler.rollout.decoding import InPlaceLayer, left_pad
from grpo.sampler.rollout.sequences import DECODING, DONE, QUEUED, WAITING, Sequence

log = logging.getLogger(__name__)

# The masked-gap probe: PROBE_TOKENS tokens cached, PROBE_GAP masked columns, then PROBE_TOKENS fed, against
# the same tokens with the masked columns before them (left padding). Both forwards have the same shapes and
# blocks of 4 and 8 columns keep a blocked kernel's sums grouped alike, so a model whose attention ignores
# where a column sits gives the same log-probs to the last bit: 0 measured on CPU for the tiny Llama and
# Qwen2 and the embedded SmolLM2-135M in float32, bfloat16 and float16. On an H100 (sdpa) a random
# Qwen2.5-0.5B-shaped model gave 0 in bfloat16 and float16 and up to 8.1e-5 in float32; a random MPT's ALiBi
# moved them by 0.51 there, and the tests' tiny MPT by 0.51 on CPU (in float64 its padded forward is NaN).
PROBE_TOKENS, PROBE_GAP = 4, 8
RECOMPUTE_TOKENS = 16384  # padded tokens of one forward of an in-flight KV recompute
PROBE_TOLERANCE = {torch.float64: 1e-6}  # the largest log-prob gap that passes; 1e-2 in other dtypes
_continues: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> it passed the probe


def runs_continuously(engine) -> bool:
    """Whether this loop can decode for `engine`: an HF engine whose model passed `continues` (decided once
    per model)."""
    if not getattr(engine, "decodes_continuously", False):
        return False
    if engine.model not in _continues:
        _continues[engine.model] = continues(engine.model)
    return _continues[engine.model]


def continues(model) -> bool:
    """Whether `model`'s episodes can run in one decode loop: every layer's cache is full attention
    and a masked gap in it changes no log-prob (`masked_gap`). Says which, once."""
    if not all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers):
        log.info("episodes go turn by turn: the model has sliding-window layers, whose cache drops old "
                 "columns (the masked columns of a continued batch would count among them)")
        return False
    dtype = next(model.parameters()).dtype
    gap, tolerance = masked_gap(model), PROBE_TOLERANCE.get(dtype, 1e-2)
    if gap > tolerance:
        log.warning("episodes go turn by turn: masked columns in the cache move this model's log-probs by %.3g "
                    "(more than %g in %s): its attention depends on where a cached column sits (ALiBi, say), so "
                    "an episode cannot go on beside others from the KV it has", gap, tolerance, dtype)
        return False
    log.info("episodes run in one decode loop (masked columns in the cache move the log-probs by %.3g)", gap)
    return True


def recompute_chunks(holding: list[Sequence]) -> list[list[Sequence]]:
    """The sequences by length, in runs whose forward (rows x the longest) is at most RECOMPUTE_TOKENS padded
    tokens (one sequence longer than that alone): a recompute's activations stay a decode step's size, not the
    whole batch's at full length."""
    return chunks_by_tokens(holding, lambda s: len(s.history))


def chunks_by_tokens(items: list, length) -> list[list]:
    """`items` sorted by `length`, in runs of at most RECOMPUTE_TOKENS padded tokens (one longer item alone)."""
    chunks, current = [], []
    for item in sorted(items, key=length):
        if current and length(item) * (len(current) + 1) > RECOMPUTE_TOKENS:
            chunks.append(current)
            current = []
        current.append(item)
    return chunks + ([current] if current else [])


def prompt_key(s: Sequence) -> tuple:
    """The group `s` belongs to: its call and prompt (its history starts with that prompt, but its last token)."""
    return id(s.call), s.prompt


def prompt_length(s: Sequence) -> int:
    """How many tokens of `s`'s history are its group's shared prompt (every prompt token but the last)."""
    return len(s.call.prompts[s.prompt]) - 1


def masked_gap(model) -> float:
    """The largest gap between the log-probs of PROBE_TOKENS tokens fed after PROBE_TOKENS cached ones
    with PROBE_GAP masked columns between them (as the loop's cache holds them) and without (the masked
    columns first: left padding). Positions come from position_ids, as in the loop; a few tokens, once."""
    device, n = next(model.parameters()).device, PROBE_TOKENS
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(2 * n, device=device) * 7919 + 5) % vocab  # any tokens: fixed, no random state used
    ones = torch.ones(n, dtype=torch.long, device=device)
    zeros = torch.zeros(PROBE_GAP, dtype=torch.long, device=device)  # the masked columns: token, mask, position 0
    positions = torch.arange(n, device=device)
    logps = []
    for cached, mask, at in (((ids[:n], zeros), (ones, zeros), (positions, zeros)),   # the gap between the tokens
                             ((zeros, ids[:n]), (zeros, ones), (zeros, positions))):  # the gap before them
        cache, mask = DynamicCache(config=model.config), torch.cat(mask)[None]
        with torch.no_grad():
            model(input_ids=torch.cat(cached)[None], attention_mask=mask, position_ids=torch.cat(at)[None],
                  past_key_values=cache, use_cache=True)
            logits = model(input_ids=ids[None, n:], attention_mask=torch.cat([mask, ones[None]], dim=1),
                           position_ids=positions[None] + n, past_key_values=cache, use_cache=True).logits[0]
        logps.append(torch.log_softmax(logits.double(), dim=-1))  # [n, vocab]
    between, before = logps
    diff = torch.where(between == before, 0.0, (between - before).abs())  # -inf in both (a token ruled out): 0
    return math.inf if diff.isnan().any() else float(diff.max())  # NaN: masked columns that poison the rest


def last_columns(cache: DynamicCache, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row `row`'s last `n` cached columns of every layer (a left-padded forward's: its real ones)."""
    return [(layer.keys[row, :, layer.keys.shape[2] - n:], layer.values[row, :, layer.values.shape[2] - n:])
            for layer in cache.layers]


class LoopCache:
    """The cache side of `ContinuousLoop` (its attributes: the engine, the batch's rows, their mask and
    cache, the queued and parked sequences): the copies of the KV its regroups and new weights make, and the
    forward of a decode step (compiled at a fixed shape with sampling.compile_decode: `fixed`)."""

    fixed: FixedCache | None = None  # the engine's fixed buffers this loop's cache is in (DecodeGraphs)

    def _prefill(self, sequences: list[Sequence]) -> None:
        """The prompts of `sequences` prefilled in one forward (every token but the last); each prompt's KV
        given to its sequences, and to the queued ones of its group, which join later."""
        if not sequences:
            return
        order = list(dict.fromkeys((s.call, s.prompt) for s in sequences))  # (call, prompt), as they queued
        ids, mask = left_pad([call.prompts[i] for call, i in order], self.pad)
        group = {key: [s for s in (*sequences, *self.fresh) if (s.call, s.prompt) == key] for key in order}
        shifts = None
        if ids.shape[1] > 1 and any(call.images is not None for call, _ in order):  # a VLM's prompts with images
            cache, shifts = self.engine._prefill_images([call.prompts[i] for call, i in order],
                                                        [call.image(i) for call, i in order], self.pad)
        elif ids.shape[1] > 1:
            cache = self.engine._prefill(ids.to(self.device), mask.to(self.device))
        for row, (call, i) in enumerate(order):
            kv = None if ids.shape[1] == 1 else last_columns(cache, row, len(call.prompts[i]) - 1)
            for s in group[call, i]:
                s.kv, s.prefilled = kv, True
                if shifts is not None:  # its text goes on from the prompt's M-RoPE positions
                    s.shift = int(shifts[row])
                    s.position = len(call.prompts[i]) - 1 + s.shift

    def _regroup(self, staying: list[Sequence], joining: list[Sequence]) -> None:
        """One copy of the KV: the staying rows (their columns where they are), then the joining ones'
        right-aligned; the rows waiting on their environment parked with their own columns."""
        stays = {id(s) for s in staying}
        keep = [b for b, s in enumerate(self.rows) if id(s) in stays]
        for b, s in enumerate(self.rows):
            s.in_batch = False
            if s.state == WAITING and id(s) not in stays:
                s.kv = self._own_columns(b)
        width = self.mask.shape[1] if keep else 0
        total = max([width, *(s.columns for s in joining)])
        rows = [self.rows[b] for b in keep] + joining
        mask = torch.zeros(len(rows), total, dtype=self.mask.dtype, device=self.mask.device)
        if keep:
            mask[: len(keep), total - width:] = self.mask[keep]
        for i, s in enumerate(joining, start=len(keep)):
            mask[i, total - s.columns:] = 1
        self.cache = self._regrouped_cache(keep, joining, total) if rows else None
        self.rows, self.mask = rows, mask
        for s in rows:
            s.in_batch = True
            if s.state == QUEUED:
                s.state = DECODING
            s.kv = None  # in the cache now (a group's prompt KV stays with its queued rows)

    def _rewind(self, s: Sequence) -> None:
        """Sequence `s` back to its prompt (a `NewRow` reply): its KV past the prompt dropped (masked in the batch,
        cut off a parked one), so that what it is fed next follows its prompt alone, as a fresh sequence's does."""
        kept = prompt_length(s)  # the cached prompt: every token but the last, which is fed again first
        if s.in_batch:
            b = self.rows.index(s)
            self.mask[b, self.mask[b].nonzero().squeeze(-1)[kept:]] = 0
        elif s.kv is not None:
            s.kv = [(keys[:, :kept].clone(), values[:, :kept].clone()) for keys, values in s.kv] if kept else None
        s.history, s.position, s.feed = s.history[:kept], kept + s.shift, [s.call.prompts[s.prompt][-1]]
        self.seen_for = None  # the repetition penalty's rows are built again, from the histories

    def _own_columns(self, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row b's cached columns (the unmasked ones, in order) of every layer, copied out of the batch."""
        columns = self.mask[b].nonzero().squeeze(-1)
        return [(layer.keys[b, :, columns].clone(), layer.values[b, :, columns].clone()) for layer in self.cache.layers]

    def _regrouped_cache(self, keep: list[int], joining: list[Sequence], total: int) -> DynamicCache:
        """The cache of the new batch, `total` columns wide; a fresh one when nothing is cached yet (one-token
        prompts: the first forward fills it)."""
        cache = DynamicCache(config=self.engine.model.config)
        if total == 0:
            return cache
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        for i in range(len(cache.layers)):
            old = self.cache.layers[i] if keep else None
            cache.layers[i] = InPlaceLayer.of_rows((old.keys[index], old.values[index]) if keep else None,
                                                   [s.kv[i] if s.kv is not None else None for s in joining], total)
        return self._in_fixed_buffers(cache)

    def _in_fixed_buffers(self, cache: DynamicCache) -> DynamicCache:
        """`cache` written into the engine's fixed buffers (sampling.compile_decode), where its layers are all
        InPlaceLayers and its rows fit; else as it is (its steps run eagerly)."""
        graphs = getattr(self.engine, "graphs", None)
        if graphs is None or any(type(layer) is not InPlaceLayer for layer in cache.layers) \
                or len(cache.layers[0].keys) > self.capacity:
            return cache
        self.fixed = graphs.cache_for(self, [(layer.keys, layer.values) for layer in cache.layers], self.capacity)
        return self.fixed.place(cache.layers)

    def _logits(self, ids: list[list[int]], positions: list[list[int]]) -> torch.Tensor:
        """The [rows, vocab] next-token logits of a decode step's feed (`ids`, `positions`: [rows, width]) after
        the cache: compiled at the fixed shape where the step feeds one token a row into the fixed buffers."""
        engine = self.engine
        if len(ids[0]) == 1 and self.fixed is not None and self.cache is self.fixed.cache and engine.graphs is not None:
            return engine.graphs.forward(self.fixed, ids, positions, self.mask, self.pad, engine._one_logit_row)
        with torch.no_grad():
            out = engine.model(input_ids=torch.tensor(ids, device=self.device), attention_mask=self.mask,
                               position_ids=torch.tensor(positions, device=self.device), past_key_values=self.cache,
                               use_cache=True, **engine._one_logit_row)
        return out.logits[:, -1]

    def _recompute_kv(self) -> None:
        """Every sequence's cached columns computed again from the tokens they hold: the batch's rows (the
        cache rebuilt, each row's columns right-aligned), the parked ones; the queued ones' shared prompt
        KV is dropped (prefilled again when they join). Done rows leave the batch first (nothing of theirs
        is computed); each group's prompt is computed once, and each sequence's tokens after it go on from
        its KV, in forwards of at most RECOMPUTE_TOKENS padded tokens, shortest first."""
        t = time.perf_counter()
        for s in self.rows:
            s.in_batch = s.state != DONE
        self.rows, self.cache = [s for s in self.rows if s.in_batch], None  # rebuilt below, from the recompute
        parked = [s for s in (*self.returned, *self.calls.values()) if not s.in_batch and s.kv is not None]
        holding = [s for s in (*self.rows, *parked) if s.history]
        for s in self.fresh:
            s.kv, s.prefilled = None, False
        shared = self._recompute_prompts(holding)
        for s in holding:
            s.kv = shared[prompt_key(s)]  # a sequence that holds its prompt only
        for chunk in recompute_chunks([s for s in holding if len(s.history) > prompt_length(s)]):
            self._recompute_after_prompts(chunk, shared)
        if self.rows:
            total = max(len(s.history) for s in self.rows)
            self.mask = torch.zeros(len(self.rows), total, dtype=self.mask.dtype, device=self.mask.device)
            for i, s in enumerate(self.rows):
                self.mask[i, total - len(s.history):] = 1
            self.cache = self._regrouped_cache([], self.rows, total)
            for s in self.rows:
                s.kv = None
        else:
            self.mask = self.mask.new_zeros(0, 0)
        self.engine.decode_rows.swap_s += time.perf_counter() - t

    def _recompute_prompts(self, holding: list[Sequence]) -> dict:
        """(call, prompt) -> the KV of that shared prompt under the weights now, one per group however many of
        its sequences hold KV (None: a one-token prompt, nothing cached)."""
        first = {}
        for s in holding:
            first.setdefault(prompt_key(s), s)
        shared = {key: None for key in first}
        for chunk in chunks_by_tokens([s for s in first.values() if prompt_length(s)], prompt_length):
            prompts = [s.call.prompts[s.prompt] for s in chunk]
            if any(s.call.images is not None for s in chunk):  # the images' features again, under the new weights
                cache, _ = self.engine._prefill_images(prompts, [s.call.image(s.prompt) for s in chunk], self.pad)
            else:
                ids, mask = left_pad(prompts, self.pad)
                cache = self.engine._prefill(ids.to(self.device), mask.to(self.device))  # every prompt token but last
            for row, s in enumerate(chunk):
                shared[prompt_key(s)] = last_columns(cache, row, prompt_length(s))
        return shared

    def _recompute_after_prompts(self, chunk: list[Sequence], shared: dict) -> None:
        """The tokens of `chunk`'s sequences after their prompt, in one forward from their prompts' KV (each
        right-aligned, then the rest, left-padded: masked columns between, as in the loop's own cache); each
        sequence's KV is then its real columns."""
        width = max(prompt_length(s) for s in chunk)
        rest = [s.history[prompt_length(s):] for s in chunk]
        ids, rest_mask = left_pad(rest, self.pad)
        prompt_mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, s in enumerate(chunk):
            prompt_mask[i, width - prompt_length(s):] = 1
        lengths = torch.tensor([prompt_length(s) + s.shift for s in chunk])[:, None]  # where each one's text goes on
        positions = lengths + (rest_mask.cumsum(-1) - 1).clamp(min=0)
        mask, ids, positions = torch.cat([prompt_mask, rest_mask], dim=1).to(self.device), ids.to(self.device), \
            positions.to(self.device)
        cache = DynamicCache(config=self.engine.model.config)
        if width:
            kvs = [shared[prompt_key(s)] for s in chunk]
            for i in range(len(cache.layers)):
                cache.layers[i] = InPlaceLayer.of_rows(None, [kv[i] if kv is not None else None for kv in kvs], width)
        with torch.no_grad():
            self.engine.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                              past_key_values=cache, use_cache=True, **self.engine._one_logit_row)
        for row, s in enumerate(chunk):
            columns = mask[row].nonzero().squeeze(-1)
            s.kv = [(layer.keys[row, :, columns], layer.values[row, :, columns]) for layer in cache.layers]
