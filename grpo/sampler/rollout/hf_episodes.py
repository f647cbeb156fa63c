"""Episodes on the HF engine in one decode loop: each episode goes on to its next turn from the KV
it already has, while the others are still in theirs.

Turn by turn (`generate` on each later turn's whole context) costs three ways: every later turn
prefills the episode's context again, the group's shared prompt G times; a turn waits for the
slowest episode of the turn before it; and an episode that ended stays in the batch (as a pad row)
until the last one of its turn is done. Here, a block of episodes (the rows of one `generate`
chunk: their prompts prefilled once, the KV repeated to their rows) is decoded by one loop:

- a row that ends a message gets its environment's reply at once (`on_turn`); the next forward
  feeds it the reply (after the message's last token) while the other rows feed one token each:
  a step's input is [rows, the widest feed], each row's feed right-aligned and the columns before
  it masked, so the cache stays one rectangle and every row's logits are at its last column;
- a row whose episode is over leaves the batch (its KV rows dropped) once a quarter of the batch
  has ended, so the compute follows the live episodes;
- the masked columns a reply leaves in the other rows are squeezed out once they are a quarter of
  the cache (each row's own columns gathered to the right, in order): the cache stays about as
  wide as the longest live episode. The keys carry their rotary positions already and every
  cached column is in the past of every later token, so where a column sits does not matter.

Seeds: each episode's turn draws its uniforms from its own generator, seeded by (step seed,
episode, turn) (`episode_seed`), so the tokens do not depend on which rows share a forward. The
reference is `generate` on the turn's whole context, one episode at a time, with torch's generator
seeded alike: the same tokens under a seed, and log-probs to float32 rounding (the same token's
keys come from forwards of other shapes, and the CPU matmul kernels block by their row count:
tests/test_hf_episodes.py).
"""

from __future__ import annotations

import functools
import hashlib
from typing import Callable

import torch

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo.sampler.rollout.hf_engine import (HFEngine, InPlaceLayer, TokenSampler, chunk_plan, left_pad, prompt_blocks,
                                            repeat_in_place)

# (episode, the message's tokens, their log-probs, cut at the budget) -> the environment's reply to feed
# before the episode's next message, or None: the episode is over
OnTurn = Callable[[int, torch.Tensor, torch.Tensor, bool], "list[int] | None"]
COMPACT_FRACTION = 0.25  # ended rows leave the batch, masked columns the cache, once they are this share of it
# (each is a copy of the KV: amortised over the steps until the next one)
MIN_SQUEEZE = 64  # masked columns worth a copy of the KV


def episode_loop(engine) -> Callable | None:
    """How `engine` runs a step's episodes in one loop: its own `run_episodes` where it has one, this
    module's on the HF engine when every layer's cache is full attention (a sliding window's drops
    old positions, which the masked columns of a continued batch would count); None: turn by turn."""
    own = getattr(engine, "run_episodes", None)
    if own is not None:
        return own
    if isinstance(engine, HFEngine) and all(type(layer) is DynamicLayer
                                            for layer in DynamicCache(config=engine.model.config).layers):
        return functools.partial(run_episodes, engine)
    return None


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """The seed of episode `episode`'s turn `turn` (0: its first message) in a step seeded `seed`."""
    return int.from_bytes(hashlib.sha256(f"{seed}/episode{episode}/turn{turn}".encode()).digest()[:8], "big") >> 2


def run_episodes(engine, prompts: list[list[int]], group_size: int, on_turn: OnTurn, budget: int, *,
                 seed: int | None = None, greedy: bool = False) -> None:
    """B x G episodes, episode j of prompt j // G, each at most `budget` tokens after its prompt (its
    messages and the replies between them); `on_turn` is called at the end of each message.
    Blocks of prompts and chunks of their completions as `generate` plans them."""
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
        self.sampler = TokenSampler(cfg.temperature, cfg.top_k, cfg.top_p, greedy=greedy)
        self.cache = cache if cache is not None else DynamicCache(config=engine.model.config)
        n = len(episodes)
        self.mask = mask[:, :-1]  # the prefilled columns: every prompt token but the last
        self.rows = list(range(n))  # the batch's rows, as indices into the per-episode lists below
        self.feed = [[token] for token in ids[:, -1].tolist()]  # what each row feeds next
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
        while self.rows:
            logits = self._forward()
            device = self.engine.device
            u = None if self.sampler.greedy else torch.cat(
                [torch.rand(1, 1, generator=self.generators[r], dtype=torch.float64, device=device) for r in self.rows])
            tokens = self.sampler.draw(logits, u).tolist()
            logps = self.sampler.logps.pop().tolist()
            for r, token, logp in zip(self.rows, tokens, logps):
                if not self.over[r]:
                    self._drawn(r, token, logp)
            self._compact()
            self._squeeze()

    def _forward(self) -> torch.Tensor:
        """Every row's feed in one forward, right-aligned; [rows, vocab] logits at the last column."""
        engine = self.engine
        width = max(len(self.feed[r]) for r in self.rows if not self.over[r])
        n = len(self.rows)
        ids = torch.full((n, width), engine.tokenizer.pad_token_id, dtype=torch.long)
        positions = torch.zeros(n, width, dtype=torch.long)
        new_mask = torch.zeros(n, width, dtype=self.mask.dtype)
        for b, r in enumerate(self.rows):
            feed = self.feed[r]
            if self.over[r]:  # waiting to leave the batch: a masked pad (it still attends to its earlier columns)
                continue
            ids[b, width - len(feed):] = torch.tensor(feed)
            positions[b, width - len(feed):] = torch.arange(self.position[r], self.position[r] + len(feed))
            new_mask[b, width - len(feed):] = 1
            self.position[r] += len(feed)
        self.mask = torch.cat([self.mask, new_mask.to(self.mask.device)], dim=1)
        device = engine.device
        with torch.no_grad():
            out = engine.model(input_ids=ids.to(device), attention_mask=self.mask, position_ids=positions.to(device),
                               past_key_values=self.cache, use_cache=True, **engine._one_logit_row)
        return out.logits[:, -1]

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
                index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)
