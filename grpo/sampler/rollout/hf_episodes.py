"""Episodes on the HF engine in one decode loop: each episode goes on to its next turn from the KV
it already has, while the others are still in theirs.

Turn by turn (`generate` on each later turn's whole context) costs three ways: every later turn
prefills the episode's context again, the group's shared prompt G times; a turn waits for the
slowest episode of the turn before it; and an episode that ended stays in the batch (as a pad row)
until the last one of its turn is done. Here, a block of episodes (the rows of one `generate`
chunk: their prompts prefilled once, the KV repeated to their rows) is decoded by one loop:

- a row that ends a message gets its environment's reply at once (`on_turn`) and is fed it (after
  the message's last token) in one step, or over the next steps at most
  `sampling.episode_feed_tokens` tokens a step where that is set, while the other rows feed one token each: a step's input is [rows, the widest feed], each
  row's feed right-aligned and the columns before it masked, so the cache stays one rectangle and
  every row's logits are at its last column. The cap keeps one long tool output from widening
  every row's step (all rows pay for the widest feed); a step in which every live row is feeding
  a reply takes as much of them as the shortest has left, so a lone row takes its reply at once;
- a row draws its next token only once its whole reply is in: a row part-way through one draws
  nothing (its uniforms stay in its generator for the message that follows);
- a row whose episode is over leaves the batch (its KV rows dropped) once a quarter of the batch
  has ended, so the compute follows the live episodes;
- the masked columns a reply leaves in the other rows are squeezed out once they are a quarter of
  the cache (each row's own columns gathered to the right, in order): the cache stays about as
  wide as the longest live episode. The keys carry their rotary positions already and every
  cached column is in the past of every later token, so where a column sits does not matter.

That last sentence is checked once per model, on the model itself (`masked_gap`): a forward whose
cache holds masked columns between real ones must give the log-probs of the same tokens without
the gap. Attention that depends on a column's place (MPT's and BLOOM's ALiBi bias the scores by
column distance) fails it, and so does a cache of sliding-window layers (it drops old columns,
which the masked ones would count): those models' episodes go turn by turn, as on vLLM.

Seeds: each episode's turn draws its uniforms from its own generator, seeded by (step seed,
episode, turn) (`episode_seed`), so the tokens do not depend on which rows share a forward. The
reference is `generate` on the turn's whole context, one episode at a time, with torch's generator
seeded alike: the same tokens under a seed, log-probs to float32 rounding (the same token's keys
come from forwards of other shapes, and the CPU matmul kernels block by their row count), and the
same log-probs to the last bit for a float64 model (tests/test_hf_episodes.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import weakref
from typing import Callable

import torch

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo.sampler.rollout.hf_engine import (HFEngine, InPlaceLayer, TokenSampler, chunk_plan, left_pad, prompt_blocks,
                                            repeat_in_place)

log = logging.getLogger(__name__)

# (episode, the message's tokens, their log-probs, cut at the budget) -> the environment's reply to feed
# before the episode's next message, or None: the episode is over. A reply must leave the model room for
# one token at least within the episode's budget (grpo/sampler/episodes.py cuts one that does not fit).
OnTurn = Callable[[int, torch.Tensor, torch.Tensor, bool], "list[int] | None"]
COMPACT_FRACTION = 0.25  # ended rows leave the batch, masked columns the cache, once they are this share of it
# (each is a copy of the KV: amortised over the steps until the next one)
MIN_SQUEEZE = 64  # masked columns worth a copy of the KV
# The masked-gap probe: PROBE_TOKENS tokens cached, PROBE_GAP masked columns, then PROBE_TOKENS fed, against
# the same tokens with the masked columns before them (left padding). Both forwards have the same shapes and
# blocks of 4 and 8 columns keep a blocked kernel's sums grouped alike, so a model whose attention ignores
# where a column sits gives the same log-probs to the last bit: 0 measured on CPU for the tiny Llama and
# Qwen2 and the embedded SmolLM2-135M in float32, bfloat16 and float16. On an H100 (sdpa) a random
# Qwen2.5-0.5B-shaped model gave 0 in bfloat16 and float16 and up to 8.1e-5 in float32; a random MPT's ALiBi
# moved them by 0.51 there, and the tests' tiny MPT by 0.51 on CPU (in float64 its padded forward is NaN).
PROBE_TOKENS, PROBE_GAP = 4, 8
PROBE_TOLERANCE = {torch.float64: 1e-6}  # the largest log-prob gap that passes; 1e-2 in other dtypes
_continues: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> it passed the probe


def episode_loop(engine) -> Callable | None:
    """How `engine` runs a step's episodes in one loop: its own `run_episodes` where it has one, this
    module's on the HF engine when its model continues from a cache with masked gaps as from one
    without (`continues`, decided once per model); None: turn by turn."""
    own = getattr(engine, "run_episodes", None)
    if own is not None:
        return own
    if not isinstance(engine, HFEngine):
        return None
    if engine.model not in _continues:
        _continues[engine.model] = continues(engine.model)
    return functools.partial(run_episodes, engine) if _continues[engine.model] else None


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


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """The seed of episode `episode`'s turn `turn` (0: its first message) in a step seeded `seed`."""
    return int.from_bytes(hashlib.sha256(f"{seed}/episode{episode}/turn{turn}".encode()).digest()[:8], "big") >> 2


def run_episodes(engine, prompts: list[list[int]], group_size: int, on_turn: OnTurn, budget: int, *,
                 seed: int | None = None, greedy: bool = False) -> None:
    """B x G episodes, episode j of prompt j // G, each at most `budget` tokens after its prompt (its
    messages and the replies between them: a reply that leaves no room for a token is an error);
    `on_turn` is called at the end of each message. Blocks of prompts and chunks of their
    completions as `generate` plans them."""
    if budget < 1:
        raise ValueError(f"an episode's token budget must be at least 1; got {budget}")
    if seed is None and not greedy:
        seed = int(torch.randint(0, 2**62, (1,)))  # from torch's generator, as `generate` draws without a seed
    gbs = engine.cfg.generation_batch_size
    for block in prompt_blocks(len(prompts), gbs):
        ids, mask = left_pad([prompts[i] for i in block], engine.tokenizer.pad_token_id)
        ids, mask = ids.to(engine.device), mask.to(engine.device)
        cache = engine._prefill(ids, mask) if ids.shape[1] > 1 else None
        offset = 0
        for k in chunk_plan(len(block), group_size, gbs):
            episodes = [(block.start + i) * group_size + offset + c for i in range(len(block)) for c in range(k)]
            EpisodeBlock(engine, ids.repeat_interleave(k, 0), mask.repeat_interleave(k, 0),
                         repeat_in_place(cache, k) if cache is not None else None, episodes,
                         on_turn, budget, seed, greedy).run()
            offset += k


class EpisodeBlock:
    """One chunk's episodes decoded together until the last one is over."""

    def __init__(self, engine, ids, mask, cache, episodes: list[int], on_turn: OnTurn, budget: int,
                 seed: int | None, greedy: bool):
        cfg = engine.cfg
        self.engine, self.episodes, self.on_turn, self.budget, self.seed = engine, episodes, on_turn, budget, seed
        self.feed_limit = cfg.episode_feed_tokens  # 0: a reply in one step
        self.sampler = TokenSampler(cfg.temperature, cfg.top_k, cfg.top_p, greedy=greedy)
        self.cache = cache if cache is not None else DynamicCache(config=engine.model.config)
        n = len(episodes)
        self.mask = mask[:, :-1]  # the prefilled columns: every prompt token but the last
        self.rows = list(range(n))  # the batch's rows, as indices into the per-episode lists below
        self.feed = [[token] for token in ids[:, -1].tolist()]  # what each row has yet to feed
        self.position = (mask.sum(-1) - 1).tolist()  # the position of its next fed token
        self.turn, self.used, self.limit = [0] * n, [0] * n, [budget] * n
        self.drawn: list[list[int]] = [[] for _ in range(n)]
        self.logps: list[list[float]] = [[] for _ in range(n)]
        self.over = [False] * n
        self.generators = [self._generator(r) for r in range(n)]

    def _generator(self, r: int) -> torch.Generator | None:
        if self.sampler.greedy:
            return None
        # on the engine's device: the stream `generate` draws from there after torch.manual_seed
        return torch.Generator(device=self.engine.device).manual_seed(episode_seed(self.seed, self.episodes[r],
                                                                                  self.turn[r]))

    def run(self) -> None:
        device = self.engine.device
        while self.rows:
            drawing, logits = self._forward()
            if drawing:  # the rows whose feed is all in draw; the others go on feeding next step
                rows = [self.rows[b] for b in drawing]
                if len(drawing) < len(self.rows):
                    logits = logits[torch.tensor(drawing, device=logits.device)]
                u = None if self.sampler.greedy else torch.cat(
                    [torch.rand(1, 1, generator=self.generators[r], dtype=torch.float64, device=device) for r in rows])
                tokens = self.sampler.draw(logits, u).tolist()
                for r, token, logp in zip(rows, tokens, self.sampler.logps.pop().tolist()):
                    self._drawn(r, token, logp)
            self._compact()
            self._squeeze()

    def _width(self) -> int:
        """Tokens fed this step: the longest feed, capped at the feed limit unless every live row has
        more than that to feed (then no row's columns are masked up to the shortest feed)."""
        lengths = [len(self.feed[r]) for r in self.rows if not self.over[r]]
        if not self.feed_limit:
            return max(lengths)
        return min(max(lengths), max(self.feed_limit, min(lengths)))

    def _forward(self) -> tuple[list[int], torch.Tensor]:
        """Every live row's next feed in one forward, right-aligned: the batch indices of the rows whose
        feed is all in (they draw), and [rows, vocab] logits at the last column."""
        engine = self.engine
        width, n = self._width(), len(self.rows)
        ids = torch.full((n, width), engine.tokenizer.pad_token_id, dtype=torch.long)
        positions = torch.zeros(n, width, dtype=torch.long)
        new_mask = torch.zeros(n, width, dtype=self.mask.dtype)
        drawing = []
        for b, r in enumerate(self.rows):
            if self.over[r]:  # waiting to leave the batch: a masked pad (it still attends to its earlier columns)
                continue
            chunk, self.feed[r] = self.feed[r][:width], self.feed[r][width:]
            ids[b, width - len(chunk):] = torch.tensor(chunk)
            positions[b, width - len(chunk):] = torch.arange(self.position[r], self.position[r] + len(chunk))
            new_mask[b, width - len(chunk):] = 1
            self.position[r] += len(chunk)
            if not self.feed[r]:
                drawing.append(b)
        self.mask = torch.cat([self.mask, new_mask.to(self.mask.device)], dim=1)
        engine.decode_rows.add(n, sum(not self.over[r] for r in self.rows))
        device = engine.device
        with torch.no_grad():
            out = engine.model(input_ids=ids.to(device), attention_mask=self.mask, position_ids=positions.to(device),
                               past_key_values=self.cache, use_cache=True, **engine._one_logit_row)
        return drawing, out.logits[:, -1]

    def _drawn(self, r: int, token: int, logp: float) -> None:
        self.drawn[r].append(token)
        self.logps[r].append(logp)
        ended = token in self.engine.eos_ids
        if not ended and len(self.drawn[r]) < self.limit[r]:
            self.feed[r] = [token]
            return
        message = torch.tensor(self.drawn[r], dtype=torch.long)
        reply = self.on_turn(self.episodes[r], message, torch.tensor(self.logps[r], dtype=torch.float32), not ended)
        if reply is None:
            self.over[r] = True
            return
        self.used[r] += len(message) + len(reply)
        self.limit[r] = self.budget - self.used[r]
        if self.limit[r] < 1:
            raise ValueError(f"episode {self.episodes[r]}: a reply of {len(reply)} tokens leaves no room for another "
                             f"message within the episode's budget of {self.budget} tokens ({self.used[r]} used with "
                             "it); cut the reply to leave one token at least, or end the episode")
        self.turn[r] += 1
        self.generators[r] = self._generator(r)
        self.feed[r], self.drawn[r], self.logps[r] = [token, *reply], [], []

    def _compact(self) -> None:
        """Rows whose episode is over leave the batch once they are COMPACT_FRACTION of it (all: the block is done)."""
        ended = sum(self.over[r] for r in self.rows)
        if ended == 0 or (ended < len(self.rows) and ended < COMPACT_FRACTION * len(self.rows)):
            return
        keep = [b for b, r in enumerate(self.rows) if not self.over[r]]
        self.rows = [self.rows[b] for b in keep]
        if not self.rows:
            return
        index = torch.tensor(keep, device=self.mask.device)
        self.mask = self.mask[index]
        for layer in self.cache.layers:
            layer.batch_select_indices(index)

    def _squeeze(self) -> None:
        """Each row's real columns gathered to the right of a cache as wide as the widest row's, once
        the masked ones are COMPACT_FRACTION of it (and MIN_SQUEEZE columns)."""
        if not self.rows:
            return
        real = self.mask.sum(-1)
        width, needed = self.mask.shape[1], int(real.max())
        if width - needed < max(MIN_SQUEEZE, COMPACT_FRACTION * width):
            return
        # a stable sort puts each row's masked columns first and its real ones after, in their order
        order = torch.sort(self.mask, dim=1, stable=True).indices[:, width - needed:]  # [rows, needed]
        self.mask = self.mask.gather(1, order)
        for layer in self.cache.layers:
            if isinstance(layer, InPlaceLayer):
                layer.keep_columns(order)
            else:  # a DynamicLayer (one-token prompts: nothing was prefilled to repeat in place)
                for name in ("keys", "values"):  # their head sizes may differ (MLA)
                    cached = getattr(layer, name)
                    index = order[:, None, :, None].expand(-1, cached.shape[1], -1, cached.shape[3])
                    setattr(layer, name, cached.gather(2, index))
