"""The pieces the HF engine's decode loops are made of (grpo/sampler/rollout/hf_engine.py's blocks,
grpo/sampler/rollout/continuous.py's continuous loop): left padding, the token sampler that records
each drawn token's log-prob, the KV cache layer that takes each new token in place, and the count of
the rows the decode steps ran."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


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

    Sampling is inverse-CDF in float64 from softmax(logits / T) after the repetition penalty and
    top-k / top-p / min-p (transformers' own warpers): torch.multinomial takes ~25 ms per step for
    16 x 49k probabilities on one CPU thread, about 8% of a decode step of the embedded model; a
    cumulative sum and a binary search take a few ms. The recorded log-prob is the one under the
    untruncated, unpenalised softmax(logits / T), as the trainer computes it. Greedy draws (an
    evaluation) take the plain argmax.
    """

    def __init__(self, temperature: float, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                 min_p: float = 0.0, repetition_penalty: float = 1.0):
        from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.temperature, self.greedy, self.logps = (1.0 if greedy else temperature), greedy, []
        self.warpers = ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1 else [])
        self.warpers += [MinPLogitsWarper(min_p)] if min_p > 0 else []
        self.penalty = repetition_penalty

    @classmethod
    def of(cls, sampling, greedy: bool) -> "TokenSampler":
        """The sampler of the `sampling` section's settings."""
        return cls(sampling.temperature, sampling.top_k, sampling.top_p, greedy=greedy, min_p=sampling.min_p,
                   repetition_penalty=sampling.repetition_penalty)

    @property
    def penalises(self) -> bool:
        """Whether a draw needs the tokens each row has seen (`draw`'s `seen`)."""
        return self.penalty != 1.0 and not self.greedy

    def draw(self, scores: torch.Tensor, u: torch.Tensor | None = None,
             seen: torch.Tensor | None = None) -> torch.Tensor:
        """[N, vocab] logits -> [N] tokens; `u`: the rows' [N, 1] float64 uniforms (default: drawn
        from torch's global generator, one per row in row order); `seen`: [N, vocab] bool, the tokens
        of each row's prompt and completion so far (the repetition penalty's)."""
        logits = scores.float() / self.temperature
        tokens = logits.argmax(-1) if self.greedy else self._draw(self._penalised(logits, seen), u)
        self.logps.append(torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, None]).squeeze(-1))
        return tokens

    def _penalised(self, logits: torch.Tensor, seen: torch.Tensor | None) -> torch.Tensor:
        """The repetition penalty on the tempered logits: T > 0 keeps each logit's sign, so dividing
        and multiplying after the temperature is the same as before it."""
        if not self.penalises or seen is None:
            return logits
        penalised = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)
        return torch.where(seen.to(logits.device), penalised, logits)

    def _draw(self, logits: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        for warper in self.warpers:
            logits = warper(None, logits)  # top-k / top-p look at the scores only
        if u is None:
            u = torch.rand(len(logits), 1, device=logits.device, dtype=torch.float64)
        return inverse_cdf(torch.softmax(logits.double(), dim=-1), u.to(logits.device))

    def recorded(self) -> torch.Tensor:
        """[N, steps] log-probs of the drawn tokens."""
        return torch.stack(self.logps, dim=1)


def seen_tokens(histories: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[N, vocab] bool: True at the tokens each row's history holds (the repetition penalty's)."""
    seen = torch.zeros(len(histories), vocab, dtype=torch.bool)
    for row, history in enumerate(histories):
        seen[row, torch.tensor(history, dtype=torch.long)] = True
    return seen.to(device)


class StopStrings:
    """sampling.stop: whether a completion's text now holds one of the strings, read from its last
    tokens after each new one (the first time it does is the token that completed it)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        # tokens enough to spell the longest: a byte-level token holds a UTF-8 byte at least (4 a character at most)
        self.tail = max((len(s.encode()) for s in stops), default=0) + 8

    def __bool__(self) -> bool:
        return bool(self.stops)

    def hit(self, tokens: list[int]) -> bool:
        if not self.stops:
            return False
        text = self.tokenizer.decode(tokens[-self.tail:], skip_special_tokens=False)
        return any(stop in text for stop in self.stops)

    def end(self, tokens: list[int]) -> int | None:
        """How many of `tokens` a decode that stops here keeps: up to the token that completes a stop string
        first (None: none does; read whole once first, so a message without one costs one decode)."""
        if not self.stops or not any(stop in self.tokenizer.decode(tokens, skip_special_tokens=False)
                                     for stop in self.stops):
            return None
        return next((n for n in range(1, len(tokens) + 1) if self.hit(tokens[:n])), None)


class InPlaceLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are views of a larger buffer, each new token written
    in place; the buffer grows by `GROWTH` positions when full (a write of many positions at once, an
    episode's reply, gets `GROWTH` free positions after it).

    DynamicLayer concatenates every token onto the layer's cache, copying the whole cache each
    time (~5 MB a layer a token on the default workload, 29% of a decode step). A preallocated
    StaticCache avoids the copies but attends over its whole length every token, which took the
    gain back (docs/notes/tried-not-kept.md); a view attends over the tokens so far only. Growing in steps
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
        """Keep only these batch rows, with GROWTH positions free: DynamicLayer's batch selection (transformers'
        own), kept in step with the buffers (the loops regroup their rows themselves)."""
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


def append_columns(mask: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """[rows, w] `mask` with [rows, n] `new` after its columns. When `mask` is a view of a wider buffer (what this
    returns) `new` is written into its free columns in place; else the columns so far are copied once into a
    buffer with InPlaceLayer.GROWTH columns free after them: a decode step's mask costs its own columns, not a
    copy of every column so far (as the cache's InPlaceLayer). Only for a fresh tensor or one this returned: a
    column slice of a wider tensor would have that tensor's later columns written."""
    rows, width = mask.shape
    end = width + new.shape[1]
    room = mask.stride(0)  # the buffer's width when `mask` is one of these views
    if rows and mask.stride(1) == 1 and mask.storage_offset() == 0 and room >= end \
            and mask.untyped_storage().nbytes() >= rows * room * mask.element_size():
        wider = mask.as_strided((rows, end), (room, 1))
    else:
        wider = mask.new_zeros(rows, end + InPlaceLayer.GROWTH)[:, :end]
        wider[:, :width] = mask
    wider[:, width:] = new
    return wider


def runs_of(items: list) -> list[tuple[int, int, object]]:
    """(first, end, item) for each run of the same object (by identity) in `items`."""
    runs = []
    for i, item in enumerate(items):
        if runs and runs[-1][2] is item:
            runs[-1] = (runs[-1][0], i + 1, item)
        else:
            runs.append((i, i + 1, item))
    return runs


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
    swaps: int = 0  # new weights loaded between decode steps (sampling.in_flight_updates)
    swap_s: float = 0.0  # of which recomputing the KV under them (sampling.in_flight_kv=recompute)
    load_s: float = 0.0  # the loads themselves (the HF engine's: the copy in; every row waits for it)

    def add(self, rows: int, live: int, full_at: int, waiting: int = 0) -> None:
        """A decode step of `rows` rows, `live` of them generating; full when `full_at` are."""
        self.steps, self.rows, self.live = self.steps + 1, self.rows + rows, self.live + live
        self.full += live >= full_at
        self.waiting += waiting

    def idle(self, seconds: float) -> None:
        self.idle_s += seconds

    def take(self) -> dict[str, float]:
        """The metrics of the steps so far (none without a step), and a fresh count."""
        metrics = {} if not self.steps else {
            "sampler/decode_steps": float(self.steps), "sampler/live_rows_per_decode_step": self.live / self.steps,
            "sampler/live_row_fraction": self.live / self.rows,
            "sampler/full_decode_step_fraction": self.full / self.steps,
            "env/waiting_per_decode_step": self.waiting / self.steps, "timing/env_idle_s": self.idle_s}
        if self.ahead is not None:
            metrics["sampler/started_ahead_fraction"] = self.ahead
        if self.swaps:
            metrics.update({"sampler/in_flight_loads": float(self.swaps), "timing/kv_recompute_s": self.swap_s,
                            "timing/in_flight_load_s": self.load_s})
        self.steps = self.rows = self.live = self.full = self.waiting = self.swaps = 0
        self.idle_s, self.swap_s, self.load_s, self.ahead = 0.0, 0.0, 0.0, None
        return metrics
