"""The HF engine's continuous decode loop: every sequence of a call (a completion, or an episode: the
model's messages and its environment's replies between them) is decoded in one batch of at most
`sampling.generation_batch_size` rows, and a row's slot goes to the next waiting sequence as soon as
its own is done.

A sequence's life: queued -> decoding -> (an episode whose message ended: waiting on its environment
-> queued again with the reply) -> done.

- Rows join the batch in regroups (`_regroup`): the queued sequences, those back from their
  environment first, then the call's next ones in prompt-major order. A prompt is prefilled once
  (every token but its last) when its first sequence joins, and its KV serves its whole group.
- A row whose message ended hands it to `on_turn` (its environment) and stops decoding: on a
  thread of the caller's `executor` (environment calls of different episodes at once, off the
  loop), or inline without one. A reply that comes back while the row is still in the batch is fed
  there; a row that waited through a whole decode step leaves the batch at the next regroup with
  its KV (its own columns, in order: parked, not recomputed) and joins again when its reply is in.
- A regroup is one copy of the KV: it runs when the rows that left (done, or parked) are
  COMPACT_FRACTION of the batch, or when that many queued rows (or all of them) fit. The kept rows'
  columns stay where they are, a joining row's columns are right-aligned, and the columns left of
  them masked, so the cache stays one rectangle and every row's logits are at its last column.
- A step's input is [rows, the widest feed]: a row fed a reply takes it in one step (or at most
  `sampling.episode_feed_tokens` tokens a step where that is set) while the others feed one token
  each, each row's feed right-aligned and the columns before it masked. A row draws its next token
  only once its whole feed is in.
- The masked columns are squeezed out once they are COMPACT_FRACTION of the cache (each row's own
  columns gathered to the right, in order). The keys carry their rotary positions already and every
  cached column is in the past of every later token, so where a column sits does not matter.

That last sentence is checked once per model, on the model itself (`masked_gap`): a forward whose
cache holds masked columns between real ones must give the log-probs of the same tokens without
the gap. Attention that depends on a column's place (MPT's and BLOOM's ALiBi bias the scores by
column distance) fails it, and so does a cache of sliding-window layers (it drops old columns,
which the masked ones would count): those models generate in blocks (`HFEngine.generate_in_blocks`)
and their episodes go turn by turn, as on vLLM.

Seeds: each sequence's message draws its uniforms from its own generator, seeded by (call seed,
sequence, turn) (`episode_seed`), so the tokens do not depend on which rows share a forward, when
a row joined, or how long its environment took. The reference is `generate` on the message's whole
context, one sequence at a time, with torch's generator seeded alike: the same tokens under a
seed, log-probs to float32 rounding (the same token's keys come from forwards of other shapes, and
the CPU matmul kernels block by their row count), and the same log-probs to the last bit for a
float64 model (tests/test_continuous.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import time
import weakref
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpo.sampler.rollout.decoding import InPlaceLayer, TokenSampler, left_pad

log = logging.getLogger(__name__)

# (episode, the message's tokens, their log-probs, cut at the budget) -> the environment's reply to feed
# before the episode's next message, or None: the episode is over. A reply must leave the model room for
# one token at least within the episode's budget (grpo/sampler/episodes.py cuts one that does not fit).
OnTurn = Callable[[int, torch.Tensor, torch.Tensor, bool], "list[int] | None"]
COMPACT_FRACTION = 0.25  # rows that left the batch, or queued ones that fit, and masked columns of the cache:
# a regroup or a squeeze once they are this share of it (each is a copy of the KV, amortised over the steps until the next)
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
    """How `engine` runs a step's episodes in one loop (called as `run_episodes` below, with an executor for
    the environment calls): its own `run_episodes` where it has one (vLLM), this
    module's on the HF engine when its model continues from a cache with masked gaps as from one
    without (`runs_continuously`); None: turn by turn."""
    own = getattr(engine, "run_episodes", None)
    if own is not None:  # vLLM's, unless sampling.continuous_batching is off
        return own if getattr(engine, "continuous", True) else None
    if not runs_continuously(engine):
        return None
    cfg = engine.cfg  # environments overlap decoding where the run is off-policy: an on-policy one is reproducible
    return functools.partial(run_episodes, engine, continuous=cfg.continuous_batching, overlap=cfg.max_staleness > 0)


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


def hashed_seed(name: str) -> int:
    """A seed of its own for what `name` names (below 2**62): the same name, the same seed."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 2


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """The seed of episode `episode`'s turn `turn` (0: its first message) in a step seeded `seed`."""
    return hashed_seed(f"{seed}/episode{episode}/turn{turn}")



def run_episodes(engine, prompts: list[list[int]], group_size: int, on_turn: OnTurn, budget: int | list[int], *,
                 seed: int | None = None, greedy: bool = False, executor: Executor | None = None,
                 continuous: bool = True, overlap: bool = True) -> None:
    """B x G sequences, sequence j of prompt j // G, each at most `budget` tokens after its prompt (one
    budget, or one per prompt; an episode's messages and the replies between them: a reply that leaves
    no room for a token is an error); `on_turn` is called at the end of each message, on `executor`'s
    threads where one is given, while the loop goes on decoding the other rows. With `overlap` a reply
    is taken as soon as it is in (the rows sharing a forward then follow the environments' timing, and
    float32 log-probs their rounding); without, the waiting rows stay in the batch and their replies
    are all taken, waited for, once no row is decoding or they are COMPACT_FRACTION of the batch: points
    the tokens alone decide, so every forward's rows, and every bit, are the same on a run made again.
    `continuous=False`: a block of generation_batch_size rows at a time, each decoded until its last
    sequence is done, the environments called in turn (the loop before continuous batching, for comparison)."""
    call = Call.of(prompts, group_size, budget, seed, greedy, on_turn)
    loop = ContinuousLoop(engine, greedy, executor if continuous else None, continuous, overlap)
    loop.add(call)
    loop.run(until=call)


def last_columns(cache: DynamicCache, row: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Row `row`'s last `n` cached columns of every layer (a left-padded forward's: its real ones)."""
    return [(layer.keys[row, :, layer.keys.shape[2] - n:], layer.values[row, :, layer.values.shape[2] - n:])
            for layer in cache.layers]


def check_room(episode: int, reply: int, budget: int, used: int) -> None:
    """An episode's reply of `reply` tokens must leave room for one token of its next message."""
    if budget - used < 1:
        raise ValueError(f"episode {episode}: a reply of {reply} tokens leaves no room for another message within "
                         f"the episode's budget of {budget} tokens ({used} used with it); cut the reply to leave one "
                         "token at least, or end the episode")


DECODING, WAITING, QUEUED, DONE = "decoding", "waiting on its environment", "queued", "done"


@dataclass(eq=False)
class Call:
    """One generate call's sequences: B x G, sequence j of prompt j // G."""

    prompts: list[list[int]]
    group_size: int
    budgets: list[int]  # per prompt
    seed: int | None
    on_turn: OnTurn
    pending: int = 0  # its sequences not done
    versions: dict = field(default_factory=dict)  # sequence -> the weights version of each token it drew, in order

    @property
    def size(self) -> int:
        return len(self.prompts) * self.group_size

    @classmethod
    def of(cls, prompts: list[list[int]], group_size: int, budget: int | list[int], seed: int | None, greedy: bool,
           on_turn: OnTurn) -> "Call":
        budgets = [budget] * len(prompts) if isinstance(budget, int) else list(budget)
        if min(budgets, default=1) < 1:
            raise ValueError(f"a sequence's token budget must be at least 1; got {min(budgets)}")
        if seed is None and not greedy:
            seed = int(torch.randint(0, 2**62, (1,)))  # from torch's generator, as `generate` draws without a seed
        return cls(prompts, group_size, budgets, seed, on_turn)


@dataclass(eq=False)
class Sequence:
    """One row's life in the loop: a completion, or an episode's messages and the replies fed between them."""

    call: Call
    episode: int  # its index in its call: B x G, prompt-major
    prompt: int  # its prompt's index in its call
    budget: int  # tokens after its prompt, in all
    feed: list[int]  # what it has yet to feed (its prompt's last token, then each drawn token, a reply)
    position: int  # the position of its next fed token
    limit: int  # tokens its message may still draw
    # its KV while out of the batch: per layer (keys [H, n, Dk], values [H, n, Dv]), its own columns in order
    # (a queued group shares its prompt's); None: nothing cached yet (a one-token prompt)
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    prefilled: bool = False  # kv holds its prompt's prefill (or it has decoded)
    state: str = QUEUED
    in_batch: bool = False
    waiting_since: int = 0  # the decode step its environment call started at
    turn: int = 0
    used: int = 0  # tokens after its prompt so far: its earlier messages and replies
    drawn: list[int] = field(default_factory=list)  # this message's tokens
    logps: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    history: list[int] = field(default_factory=list)  # the tokens its KV holds, in order (to compute it again)

    @property
    def columns(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[1]


class ContinuousLoop:
    """Calls' sequences decoded in one batch of at most generation_batch_size rows, refilled as rows leave:
    a call's own, then those of the calls added after it (`add`), which join once its own are all in."""

    def __init__(self, engine, greedy: bool, executor: Executor | None, continuous: bool = True,
                 overlap: bool = True):
        cfg = engine.cfg
        self.engine, self.executor = engine, executor
        self.device = engine.device  # read once: it looks the model's parameters up
        self.capacity = cfg.generation_batch_size
        self.continuous, self.overlap = continuous, overlap
        self.admit_at = max(1, math.ceil(COMPACT_FRACTION * self.capacity))  # queued rows worth a regroup
        self.feed_limit = cfg.episode_feed_tokens  # 0: a reply in one step
        self.pad = engine.tokenizer.pad_token_id  # read once: environment threads share the tokenizer
        self.sampler = TokenSampler(cfg.temperature, cfg.top_k, cfg.top_p, greedy=greedy)
        self.fresh: deque[Sequence] = deque()  # not started, in call order, each call's prompt-major
        self.returned: deque[Sequence] = deque()  # back from their environment, out of the batch: first to join
        self.rows: list[Sequence] = []  # the batch's rows, in cache order
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [rows, cached columns]
        self.cache = None
        self.calls: dict[Future, Sequence] = {}  # environment calls in flight
        self.active: list[Call] = []  # calls with sequences not done
        self.steps = 0

    def add(self, call: Call) -> None:
        """`call`'s sequences, queued after those already queued."""
        n = call.pending = call.size
        for j in range(n):
            i = j // call.group_size
            s = Sequence(call, j, i, call.budgets[i], [call.prompts[i][-1]], len(call.prompts[i]) - 1, call.budgets[i])
            s.generator, s.history = self._generator(s), list(call.prompts[i][:-1])
            self.fresh.append(s)
        if n:
            self.active.append(call)

    def run(self, until: Call) -> None:
        """Decode until every sequence of `until` is done; the later calls' sequences stay where they are."""
        try:
            while until.pending:
                self._load_new_weights()
                if self.overlap:  # nothing to decode and none may join: wait for a reply
                    self._take_replies(block=not self._live() and sum(self._joinable([])) == 0)
                elif self.calls and (not self._live() or len(self.calls) >= COMPACT_FRACTION * len(self.rows)):
                    self._take_all_replies()
                self._regroup_if_due()
                if self._live():
                    self._step()
            if self.active and any(s.state == DONE for s in self.rows):  # the later calls' rows stay, alone
                self._regroup([s for s in self.rows if s.state != DONE], [])
        except BaseException:  # no environment call outlives the loop (its episode's records are the caller's)
            for future in self.calls:
                future.cancel()
            wait(list(self.calls))
            raise

    def _live(self) -> int:
        return sum(s.state == DECODING for s in self.rows)

    # ------------------------------------------------------------------ new weights between decode steps

    def _load_new_weights(self) -> None:
        """A version published since the last decode step, loaded now (`engine.poll_weights`, with
        sampling.in_flight_updates); with sampling.in_flight_kv=recompute every cached column is computed
        again under it, so each token drawn from here on has the log-prob of its version given its whole
        prefix; with `keep` the sequences go on from the KV of the weights before."""
        poll = getattr(self.engine, "poll_weights", None)
        if poll is None or self.sampler.greedy or not poll():  # greedy: an evaluation, of the version it started with
            return
        self.engine.decode_rows.swaps += 1
        if self.engine.cfg.in_flight_kv == "recompute":
            self._recompute_kv()

    def _recompute_kv(self) -> None:
        """Every sequence's cached columns computed again from the tokens they hold: the batch's rows (the
        cache rebuilt, each row's columns right-aligned), the parked ones; the queued ones' shared prompt
        KV is dropped (prefilled again when they join)."""
        t = time.perf_counter()
        parked = [s for s in (*self.returned, *self.calls.values()) if not s.in_batch and s.kv is not None]
        holding = [s for s in (*self.rows, *parked) if s.history]
        for s in self.fresh:
            s.kv, s.prefilled = None, False
        if holding:
            ids, mask = left_pad([s.history for s in holding], self.pad)
            ids, mask = ids.to(self.device), mask.to(self.device)
            cache = DynamicCache(config=self.engine.model.config)
            with torch.no_grad():
                self.engine.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                                  past_key_values=cache, use_cache=True, **self.engine._one_logit_row)
            for row, s in enumerate(holding):
                s.kv = last_columns(cache, row, len(s.history))
        if self.rows:
            total = max(len(s.history) for s in self.rows)
            self.mask = torch.zeros(len(self.rows), total, dtype=self.mask.dtype, device=self.mask.device)
            for i, s in enumerate(self.rows):
                self.mask[i, total - len(s.history):] = 1
            self.cache = self._regrouped_cache([], self.rows, total)
            for s in self.rows:
                s.kv = None
        self.engine.decode_rows.swap_s += time.perf_counter() - t

    def _step(self) -> None:
        drawing, logits = self._forward()
        self.steps += 1
        if drawing:  # the rows whose feed is all in draw; the others go on feeding next step
            rows = [self.rows[b] for b in drawing]
            if len(drawing) < len(self.rows):
                logits = logits[torch.tensor(drawing, device=logits.device)]
            u = None if self.sampler.greedy else torch.cat(  # on the CPU: no device launch per row
                [torch.rand(1, 1, generator=s.generator, dtype=torch.float64) for s in rows]).to(self.device)
            tokens = self.sampler.draw(logits, u).tolist()
            for s, token, logp in zip(rows, tokens, self.sampler.logps.pop().tolist()):
                self._drawn(s, token, logp)
        self._squeeze()

    # ------------------------------------------------------------------ a message's end, its environment

    def _drawn(self, s: Sequence, token: int, logp: float) -> None:
        s.drawn.append(token)
        s.logps.append(logp)
        s.call.versions.setdefault(s.episode, []).append(self.engine.version)
        ended = token in self.engine.eos_ids
        if not ended and len(s.drawn) < s.limit:
            s.feed = [token]
            return
        message = torch.tensor(s.drawn, dtype=torch.long)
        logps = torch.tensor(s.logps, dtype=torch.float32)
        s.feed, s.state, s.waiting_since = [token], WAITING, self.steps  # the last token is fed with the reply
        if self.executor is None:
            self._replied(s, s.call.on_turn(s.episode, message, logps, not ended))
        else:
            self.calls[self.executor.submit(s.call.on_turn, s.episode, message, logps, not ended)] = s

    def _take_replies(self, block: bool) -> None:
        """The environment calls that are done (with `block`, at least one: nothing else to decode)."""
        if not self.calls:
            return
        if block:
            t = time.perf_counter()
            done, _ = wait(list(self.calls), return_when=FIRST_COMPLETED)
            self.engine.decode_rows.idle(time.perf_counter() - t)
        else:
            done = [future for future in self.calls if future.done()]
        for future in done:
            self._replied(self.calls.pop(future), future.result())  # an on_turn that raised raises here

    def _take_all_replies(self) -> None:
        """Every environment call in flight, waited for, taken in the order they were made (without overlap:
        at points the tokens alone decide, so every forward's rows are the same on a run made again)."""
        calls, self.calls, t = self.calls, {}, time.perf_counter()
        wait(list(calls))
        self.engine.decode_rows.idle(time.perf_counter() - t)
        for future, s in calls.items():
            self._replied(s, future.result())

    def _replied(self, s: Sequence, reply: list[int] | None) -> None:
        if reply is None:
            s.state, s.kv = DONE, None
            s.call.pending -= 1
            if not s.call.pending:
                self.active.remove(s.call)
            return
        s.used += len(s.drawn) + len(reply)
        s.limit = s.budget - s.used
        check_room(s.episode, len(reply), s.budget, s.used)
        s.turn += 1
        s.generator = self._generator(s)
        s.feed, s.drawn, s.logps = [*s.feed, *reply], [], []
        if s.in_batch:
            s.state = DECODING
        else:
            s.state = QUEUED
            self.returned.append(s)

    def _generator(self, s: Sequence) -> torch.Generator | None:
        if self.sampler.greedy:
            return None
        # a CPU generator on every device: on the CPU, the stream `generate` draws after torch.manual_seed
        return torch.Generator().manual_seed(episode_seed(s.call.seed, s.episode, s.turn))

    # ------------------------------------------------------------------ the forward

    def _width(self) -> int:
        """Tokens fed this step: the longest feed, capped at the feed limit unless every live row has
        more than that to feed (then no row's columns are masked up to the shortest feed)."""
        lengths = [len(s.feed) for s in self.rows if s.state == DECODING]
        if not self.feed_limit:
            return max(lengths)
        return min(max(lengths), max(self.feed_limit, min(lengths)))

    def _forward(self) -> tuple[list[int], torch.Tensor]:
        """Every decoding row's next feed in one forward, right-aligned: the batch indices of the rows
        whose feed is all in (they draw), and [rows, vocab] logits at the last column."""
        engine = self.engine
        width = self._width()
        ids, positions, fed, drawing = [], [], [], []  # built as lists, one tensor each: a step's rows cost no ops
        for b, s in enumerate(self.rows):
            chunk = []
            if s.state == DECODING:  # else waiting, or to leave the batch: a masked pad (it attends to its columns)
                chunk, s.feed = s.feed[:width], s.feed[width:]
                if not s.feed:
                    drawing.append(b)
            pad = width - len(chunk)
            ids.append([self.pad] * pad + chunk)
            positions.append([0] * pad + list(range(s.position, s.position + len(chunk))))
            fed.append(len(chunk))
            s.position += len(chunk)
            s.history += chunk
        columns = torch.arange(width)
        new_mask = (columns >= width - torch.tensor(fed)[:, None]).to(self.mask.dtype)  # each row's last fed[b]
        self.mask = torch.cat([self.mask, new_mask.to(self.device)], dim=1)
        full = min(self.capacity, sum(call.size for call in self.active))  # rows decoding in a full step
        engine.decode_rows.add(len(self.rows), self._live(), full, len(self.calls))
        with torch.no_grad():
            out = engine.model(input_ids=torch.tensor(ids, device=self.device), attention_mask=self.mask,
                               position_ids=torch.tensor(positions, device=self.device), past_key_values=self.cache,
                               use_cache=True, **engine._one_logit_row)
        return drawing, out.logits[:, -1]

    # ------------------------------------------------------------------ rows leaving and joining

    def _regroup_if_due(self) -> None:
        """Rows that are done, or waited on their environment through a decode step, leave the batch and
        queued ones join, once either is COMPACT_FRACTION of it (or nothing is left decoding; or an
        episode is back from its environment); before continuous batching (`continuous=False`), rows
        join only an empty batch."""
        decoding = [s for s in self.rows if s.state == DECODING]
        staying = self._staying(decoding)
        leaving = len(self.rows) - len(staying)
        returning, fresh = self._joinable(staying)
        queued = len(self.returned) + len(self.fresh)
        joinable = returning + fresh
        joining = joinable > 0 and (joinable >= min(queued, self.admit_at) or not decoding or returning > 0)
        if not self.continuous:
            joining = queued > 0 and not staying and not self.calls
        compacting = leaving > 0 and (not staying or leaving >= COMPACT_FRACTION * len(self.rows))
        if joining or compacting:
            self._regroup(staying, self._joining(returning, fresh) if joining else [])

    def _staying(self, decoding: list[Sequence]) -> list[Sequence]:
        """The rows that stay at a regroup: the decoding ones, and those waiting on their environment since
        this step (for their reply) unless nothing is left to decode; without overlap every waiting row
        (its reply is taken at a point the tokens decide: `run`)."""
        return [s for s in self.rows if s.state == DECODING or (s.state == WAITING and (
            not self.overlap or (decoding and s.waiting_since == self.steps)))]

    def _joinable(self, staying: list[Sequence]) -> tuple[int, int]:
        """(sequences back from their environment, fresh ones) that may join a batch keeping `staying`: as
        many as fit, the fresh ones only while every sequence holding KV (in the batch, or parked out of
        it waiting on its environment) stays within generation_batch_size, so memory stays what that many
        sequences use however slow the environments."""
        free, stays = self.capacity - len(staying), {id(s) for s in staying}
        parked = (len(self.returned) + sum(not s.in_batch for s in self.calls.values())  # out of the batch now
                  + sum(s.state == WAITING and id(s) not in stays for s in self.rows))  # about to leave it
        returning = min(free, len(self.returned))
        return returning, max(0, min(len(self.fresh), free - returning, self.capacity - len(staying) - parked))

    def _joining(self, returning: int, fresh: int) -> list[Sequence]:
        """That many queued sequences, those back from their environment first, with their KV: the prompts of
        fresh ones prefilled once for their whole group."""
        joining = [self.returned.popleft() for _ in range(returning)]
        new = [self.fresh.popleft() for _ in range(fresh)]
        self._prefill([s for s in new if not s.prefilled])
        return joining + new

    def _prefill(self, sequences: list[Sequence]) -> None:
        """The prompts of `sequences` prefilled in one forward (every token but the last); each prompt's KV
        given to its sequences, and to the queued ones of its group, which join later."""
        if not sequences:
            return
        order = list(dict.fromkeys((s.call, s.prompt) for s in sequences))  # (call, prompt), as they queued
        ids, mask = left_pad([call.prompts[i] for call, i in order], self.pad)
        group = {key: [s for s in (*sequences, *self.fresh) if (s.call, s.prompt) == key] for key in order}
        if ids.shape[1] > 1:
            cache = self.engine._prefill(ids.to(self.device), mask.to(self.device))
        for row, (call, i) in enumerate(order):
            kv = None if ids.shape[1] == 1 else last_columns(cache, row, len(call.prompts[i]) - 1)
            for s in group[call, i]:
                s.kv, s.prefilled = kv, True

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
        return cache

    def _squeeze(self) -> None:
        """Each row's real columns gathered to the right of a cache as wide as the widest row's, once
        the masked ones are COMPACT_FRACTION of it (and MIN_SQUEEZE columns)."""
        if not self.rows or self.cache is None:
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


@dataclass
class NextCall:
    """A generate call to come: `HFEngine.generate(then=...)` starts its completions in the rows the
    current call leaves free."""

    prompts: list[list[int]]
    group_size: int
    seed: int | None
    max_new_tokens: list[int] | None = None


@dataclass
class Carried:
    """A call's completions started in the loop of the call before it, with the weights then served."""

    call: Call
    greedy: bool
    loop: ContinuousLoop

    def matches(self, call, greedy: bool) -> bool:
        """Whether `call` is the one carried: the same prompts, G, seed and limits, sampled alike."""
        mine = self.call
        return (greedy == self.greedy and call.seed == mine.seed and call.group_size == mine.group_size
                and call.budgets == mine.budgets and call.prompts == mine.prompts)
