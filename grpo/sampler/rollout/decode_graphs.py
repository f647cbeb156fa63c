"""The HF engine's one-token decode steps at fixed shapes, compiled (sampling.compile_decode): on a GPU the
compiled step is captured as a CUDA graph once per shape and replayed, so a decode step costs one launch, not
one per kernel (a small model's eager step is launch-bound: ~1,200 tokens/s measured on an H100).

The continuous loop (grpo/sampler/rollout/continuous.py) keeps its cache as `InPlaceLayer`s whose width grows a
column a step and whose rows change at each regroup. Here the same cache lives in fixed buffers instead
(`FixedLayer`): generation_batch_size rows, columns in blocks of GRAPH_COLUMNS (and one SPARE row and column),
kept at one address for as long as the engine lives (a compiled graph reads them where they were when it was
captured). A decode step then has one of a few shapes: its rows rounded up to a power of two (the spare ones fed
a pad token that attends to itself), the columns the loop has reached rounded up to a block (those past the
loop's masked), each row's new column written at a position held in a tensor. Everything else (prefills,
regroups, squeezes, an episode's longer feeds, in-flight recomputes) stays eager and writes into the same buffers.
"""

from __future__ import annotations

import logging
import math
import weakref

import torch
from transformers import DynamicCache

from grpo.model.loading import unwrap_causal_lm
from grpo.model.vision import vision_language_model
from grpo.sampler.rollout.decoding import InPlaceLayer

log = logging.getLogger(__name__)

GRAPH_COLUMNS = 256  # the fixed cache grows in blocks of this many columns: one compiled shape (graph) each
# a row and a column more than any step reads: a step's views are then never the whole buffers, so torch compiles
# one graph for every bucket instead of one more where they would be (a contiguous view guards apart)
SPARE = 1
KEPT_CACHES = 2  # fixed caches an engine keeps for its loops (a carried call's and an evaluation's at once)
COMPILED_ATTENTION = ("sdpa", "eager")  # attention kernels the fixed step is checked with (tests/test_decode_graphs.py)


class FixedLayer(InPlaceLayer):
    """One layer of a fixed cache: buffers [rows, heads, columns, dim] at one address; `keys` and `values` are the
    loop's rows and columns so far (views, as InPlaceLayer's). In a compiled step (`fixed` on) every row's new
    column is written at `at` (a one-element tensor: no Python number changes between steps) and the step's views of
    the buffers (`use`: its rows and columns, in buckets) are attended to, its mask hiding what is not the row's."""

    is_compileable = True  # transformers: its mask is sized by get_mask_sizes, its offset a tensor

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, at: torch.Tensor):
        super().__init__()
        self.key_buffer, self.value_buffer, self.at = key_buffer, value_buffer, at
        self.rows, self.length, self.fixed = 0, 0, False
        self.step_keys = self.step_values = None  # a compiled step's rows and columns of the buffers (`use`)
        self.step_shape = (0, 0)
        self.dtype, self.device, self.is_initialized = key_buffer.dtype, key_buffer.device, True
        self._expose()

    def use(self, rows: int, columns: int) -> None:
        """A compiled step of `rows` rows and `columns` columns (buckets) reads and writes the buffers' first ones:
        views at the buffers' address (so a graph's input), made again only when a bucket or the buffers change;
        a step attends to the columns its loop has reached, not to the widest a call ever grew them to."""
        if self.step_keys is None or self.step_shape != (rows, columns):
            self.step_keys = static(self.key_buffer[:rows, :, :columns])
            self.step_values = static(self.value_buffer[:rows, :, :columns])
            self.step_shape = (rows, columns)

    def _expose(self) -> None:
        self.keys = self.key_buffer[: self.rows, :, : self.length]
        self.values = self.value_buffer[: self.rows, :, : self.length]

    def place(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The loop's new rows and columns ([rows, heads, n, dim] each) written over the buffers' first ones."""
        rows, n = keys.shape[0], keys.shape[2]
        self.reserve(n)
        self.key_buffer[:rows, :, :n] = keys
        self.value_buffer[:rows, :, :n] = values
        self.rows, self.length = rows, n
        self._expose()

    def keep_columns(self, columns: torch.Tensor) -> None:
        """Row r keeps the positions columns[r] ([rows, n], in that order), written back to the first n columns."""
        kept = []
        for cached in (self.keys, self.values):
            index = columns[:, None, :, None].expand(-1, cached.shape[1], -1, cached.shape[3])
            kept.append(cached.gather(2, index))
        self.place(*kept)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.fixed:  # traced: tensors only (the loop moves `length` on after the step)
            self.step_keys.index_copy_(2, self.at, key_states)
            self.step_values.index_copy_(2, self.at, value_states)
            return self.step_keys, self.step_values
        end = self.length + key_states.shape[-2]
        self.reserve(end)
        self.key_buffer[: self.rows, :, self.length:end] = key_states
        self.value_buffer[: self.rows, :, self.length:end] = value_states
        self.length = end
        self._expose()
        return self.keys, self.values

    def reserve(self, columns: int) -> None:
        """Buffers at least `columns` wide, in blocks of GRAPH_COLUMNS: a wider cache is a new shape and address
        (compiled again, or captured again), so it grows rarely and stays grown."""
        if columns < self.key_buffer.shape[2]:
            return
        width = math.ceil(columns / GRAPH_COLUMNS) * GRAPH_COLUMNS + SPARE
        for name in ("key_buffer", "value_buffer"):
            old = getattr(self, name)
            buffer = old.new_zeros(old.shape[0], old.shape[1], width, old.shape[3])
            buffer[:, :, : old.shape[2]] = old
            setattr(self, name, static(buffer))
        self.step_keys = self.step_values = None
        self._expose()

    def get_seq_length(self, *args) -> int | torch.Tensor:
        return self.at if self.fixed else self.length

    def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
        return (self.step_keys.shape[2], 0) if self.fixed else (self.length + query_length, 0)


def static(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` marked as living at one address: a CUDA graph may read and write it in place (no guard on its
    identity: a wider buffer replaces it as the same input)."""
    torch._dynamo.mark_static_address(tensor, guard=False)
    return tensor


class FixedCache:
    """A loop's cache in fixed buffers (`FixedLayer` a layer), `rows` rows; the `DynamicCache` the model is called
    with is one object for the engine's life (a compiled step is specialised on the objects it is given)."""

    def __init__(self, model, rows: int, like: list[tuple[torch.Tensor, torch.Tensor]]):
        """`like`: a layer's keys and values of each layer, for their heads, head sizes, dtype and device."""
        self.rows, self.owner = rows, None
        device = like[0][0].device
        self.at = static(torch.zeros(1, dtype=torch.long, device=device))
        self.cache = DynamicCache(config=model.config)
        for i, (keys, values) in enumerate(like):
            buffers = [static(t.new_zeros(rows + SPARE, t.shape[-3], GRAPH_COLUMNS + SPARE, t.shape[-1]))
                       for t in (keys, values)]
            self.cache.layers[i] = FixedLayer(*buffers, self.at)

    def bucket(self, rows: int) -> int:
        """The rows a compiled step of `rows` rows runs: the next power of two (at most the buffers' rows), so a
        call's last few rows do not cost a full batch's step, and a few shapes serve every row count."""
        return min(self.rows, 1 << max(rows - 1, 0).bit_length())

    def place(self, layers: list) -> DynamicCache:
        """The loop's new cache (one InPlaceLayer a layer) written into the fixed buffers; returns their cache."""
        for fixed, layer in zip(self.cache.layers, layers):
            fixed.place(layer.keys, layer.values)
        return self.cache

    @property
    def layers(self) -> list[FixedLayer]:
        return self.cache.layers


class DecodeGraphs:
    """The engine's compiled decode step and the fixed caches its loops decode in (at most KEPT_CACHES kept; a loop
    takes one that no live loop holds)."""

    def __init__(self, model):
        self.model = model
        cuda = next(model.parameters()).device.type == "cuda"
        # reduce-overhead: inductor's kernels captured as CUDA graphs (cudagraph trees); on the CPU, the same
        # compiled step without graphs (what the tests run)
        self.step = torch.compile(model, mode="reduce-overhead" if cuda else "default", dynamic=True)
        self.cuda, self.kept, self.fixed_steps = cuda, [], 0

    @classmethod
    def of(cls, model, cfg) -> DecodeGraphs | None:
        """The engine's graphs with sampling.compile_decode, else None; None with one line where they cannot run."""
        if not cfg.compile_decode:
            return None
        attention = getattr(model.config, "_attn_implementation", None)
        if vision_language_model(unwrap_causal_lm(model)) is not None:
            log.warning("sampling.compile_decode: decode steps run eagerly: compiled steps are not checked with a "
                        "vision-language model's positions")
            return None
        if attention not in COMPILED_ATTENTION:
            log.warning("sampling.compile_decode: decode steps run eagerly: the model's attention is %s (compiled "
                        "steps are checked with %s)", attention, " or ".join(COMPILED_ATTENTION))
            return None
        if next(model.parameters()).device.type == "cpu":
            log.warning("sampling.compile_decode on the CPU: the default workload's compiled steps decoded at "
                        "about 0.6x the eager ones' tokens/s on one CPU thread (docs/performance.md); it is meant for "
                        "a GPU, where a step is replayed as a CUDA graph")
        return cls(model)

    def cache_for(self, loop, like: list[tuple[torch.Tensor, torch.Tensor]], rows: int) -> FixedCache:
        """A fixed cache for `loop`: its own if it has one, else a kept one no live loop holds, else a new one
        (kept while fewer than KEPT_CACHES are: a new cache is a new address, captured again)."""
        if loop.fixed is not None and loop.fixed.rows >= rows:  # its own, kept or not
            return loop.fixed
        free = next((fixed for fixed in self.kept if fixed.owner is None or fixed.owner() is None), None)
        if free is None or free.rows < rows:
            free = FixedCache(self.model, rows, like)
            if len(self.kept) < KEPT_CACHES:
                self.kept.append(free)
        free.owner = weakref.ref(loop)
        return free

    def forward(self, fixed: FixedCache, ids: list[list[int]], positions: list[list[int]], mask: torch.Tensor,
                pad: int, extra: dict) -> torch.Tensor:
        """One decode step of the loop's rows (one token each; `mask` [rows, columns] with this step's column) at
        the fixed shape; returns the rows' [rows, vocab] logits (a copy: a graph's outputs are its own)."""
        rows, width = mask.shape
        bucket, columns = fixed.bucket(rows), math.ceil(width / GRAPH_COLUMNS) * GRAPH_COLUMNS
        for layer in fixed.layers:
            if (layer.rows, layer.length) != (rows, width - 1):  # the new column where the mask has it, or nowhere
                raise RuntimeError(f"the fixed cache holds {layer.rows} rows x {layer.length} columns; this step's "
                                   f"mask is {rows} x {width}")
            layer.reserve(width)
            layer.use(bucket, columns)
        spare, device = bucket - rows, mask.device  # spare rows: a pad token at position 0 attending to itself only
        full = torch.zeros(bucket, columns, dtype=torch.bool, device=device)
        full[:rows, :width] = mask.bool()
        full[rows:, width - 1] = True
        fixed.at.fill_(width - 1)
        for layer in fixed.layers:
            layer.fixed = True
        try:
            if self.cuda:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's outputs are no longer read
            # no duck sizing: a bucket equal to another size (the key/value heads, say) is not compiled apart
            with torch.no_grad(), torch.fx.experimental._config.patch(use_duck_shape=False):
                out = self.step(input_ids=torch.tensor(ids + [[pad]] * spare, device=device), attention_mask=full,
                                position_ids=torch.tensor(positions + [[0]] * spare, device=device),
                                past_key_values=fixed.cache, use_cache=True, **extra)
            logits = out.logits[:rows, -1].clone()
        finally:
            for layer in fixed.layers:
                layer.fixed = False
        for layer in fixed.layers:
            layer.length = width
            layer._expose()
        self.fixed_steps += 1
        return logits
