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
- A `NewRow` reply (an agent's request that does not continue what the model read) rewinds its row
  to its prompt: its columns past the prompt masked (cut off its KV while parked), then it is fed the
  prompt's last token and the reply, as a fresh sequence with that context would be.
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

That last sentence is checked once per model, on the model itself (`masked_gap`, in
grpo/sampler/rollout/loop_cache.py with the loop's copies of the cache): a forward whose cache holds
masked columns between real ones must give the log-probs of the same tokens without the gap.
Attention that depends on a column's place (MPT's and BLOOM's ALiBi bias the scores by column
distance) fails it, and so does a cache of sliding-window layers (it drops old columns, which the
masked ones would count): those models generate in blocks (`HFEngine.generate_in_blocks`) and their
episodes go turn by turn, as on vLLM.

Seeds: each sequence's message draws its uniforms from its own generator, seeded by (call seed,
sequence, turn) (`episode_seed`; a call's sequences: grpo/sampler/rollout/sequences.py), so the
tokens do not depend on which rows share a forward, when a row joined, or how long its environment
took. The reference is `generate` on the message's whole context, one sequence at a time, with
torch's generator seeded alike: the same tokens under a seed, log-probs to float32 rounding (the
same token's keys come from forwards of other shapes, and the CPU matmul kernels block by their row
count), and the same log-probs to the last bit for a float64 model (tests/test_continuous.py).
"""

from __future__ import annotations

import functools
import math
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from dataclasses import dataclass
from typing import Callable

import torch

from grpo.sampler.rollout.decoding import InPlaceLayer, StopStrings, TokenSampler, append_columns, seen_tokens
from grpo.sampler.rollout.loop_cache import LoopCache, runs_continuously
from grpo.sampler.rollout.sequences import (
    DECODING,
    DONE,
    QUEUED,
    WAITING,
    Call,
    NewRow,
    OnTurn,
    Sequence,
    TurnLimits,
    check_room,
    episode_seed,
    limits_of,
    message_limit,
    same_images,
)

COMPACT_FRACTION = 0.25  # rows that left the batch, or queued ones that fit, and masked columns of the cache:
# a regroup or a squeeze once they are this share of it (each is a copy of the KV, amortised over the steps
# until the next)
MIN_SQUEEZE = 64  # masked columns worth a copy of the KV


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


def run_episodes(engine, prompts: list[list[int]], group_size: int, on_turn: OnTurn, budget: int | list[int], *,
                 seed: int | None = None, greedy: bool = False, executor: Executor | None = None,
                 continuous: bool = True, overlap: bool = True, first_limits: list[TurnLimits] | None = None
                 ) -> dict[int, list[int]]:
    """B x G sequences, sequence j of prompt j // G, each at most `budget` tokens after its prompt (one
    budget, or one per prompt; an episode's messages and the replies between them: a reply that leaves
    no room for a token is an error); `on_turn` is called at the end of each message, on `executor`'s
    threads where one is given, while the loop goes on decoding the other rows. With `overlap` a reply
    is taken as soon as it is in (the rows sharing a forward then follow the environments' timing, and
    float32 log-probs their rounding); without, the waiting rows stay in the batch and their replies
    are all taken, waited for, once no row is decoding or they are COMPACT_FRACTION of the batch: points
    the tokens alone decide, so every forward's rows, and every bit, are the same on a run made again.
    `continuous=False`: a block of generation_batch_size rows at a time, each decoded until its last
    sequence is done, the environments called in turn (the loop before continuous batching, for comparison).
    `first_limits`: per sequence, its first message's own max_tokens and stop strings (TurnLimits); a later
    message's come with the reply before it (`ReplyTokens`). Returns, per sequence, the weights version that drew
    each of its tokens, in the order drawn (new weights may load between decode steps: sampling.in_flight_updates)."""
    call = Call.of(prompts, group_size, budget, seed, greedy, on_turn, first_limits)
    loop = ContinuousLoop(engine, greedy, executor if continuous else None, continuous, overlap)
    loop.add(call)
    loop.run(until=call)
    return call.versions


class ContinuousLoop(LoopCache):
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
        self.sampler = TokenSampler.of(cfg, greedy)
        self.stops = StopStrings(engine.tokenizer, cfg.stop)  # sampling.stop: a completion's text ends them too
        self.fresh: deque[Sequence] = deque()  # not started, in call order, each call's prompt-major
        self.returned: deque[Sequence] = deque()  # back from their environment, out of the batch: first to join
        self.rows: list[Sequence] = []  # the batch's rows, in cache order
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [rows, cached columns]
        self.cache = None
        # the repetition penalty's [rows, vocab]: the tokens each row's history holds, built at a regroup (for the
        # rows list it names) and kept up with each step's feed
        self.seen, self.seen_for = None, None
        self.until: Call | None = None  # the call `run` decodes for; the later ones' sequences join after it
        self.calls: dict[Future, Sequence] = {}  # environment calls in flight
        self.active: list[Call] = []  # calls with sequences not done
        self.steps = 0

    def add(self, call: Call) -> None:
        """`call`'s sequences, queued after those already queued."""
        n = call.pending = call.size
        for j in range(n):
            i = j // call.group_size
            limits = call.first(j)
            s = Sequence(call, j, i, call.budgets[i], [call.prompts[i][-1]], len(call.prompts[i]) - 1,
                         message_limit(call.budgets[i], limits), stops=self._stops_of(limits))
            s.generator, s.history = self._generator(s), list(call.prompts[i][:-1])
            self.fresh.append(s)
        if n:
            self.active.append(call)

    def run(self, until: Call) -> None:
        """Decode until every sequence of `until` is done; the later calls' sequences stay where they are."""
        self.until = until
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
        if poll is None or self.sampler.greedy:  # greedy: an evaluation, of the version it started with
            return
        t = time.perf_counter()
        if not poll():
            return
        self.engine.decode_rows.swaps += 1
        self.engine.decode_rows.load_s += time.perf_counter() - t
        self._drop_later_calls()
        if self.engine.cfg.in_flight_kv == "recompute":
            self._recompute_kv()

    def _drop_later_calls(self) -> None:
        """The calls after the one decoding, started with the weights before a load: the engine makes them
        again with the new ones (it let go of them), so their rows stop here and are not recomputed."""
        later = {id(call) for call in self.active if call is not self.until}
        if not later:
            return
        for s in self.rows:
            if id(s.call) in later:
                s.state, s.kv = DONE, None
        self.fresh = deque(s for s in self.fresh if id(s.call) not in later)
        self.returned = deque(s for s in self.returned if id(s.call) not in later)
        self.active = [call for call in self.active if call is self.until]
        carried = getattr(self.engine, "carried", None)
        if carried is not None and carried.loop is self:  # never found started: its rows are gone
            self.engine.carried = None

    def _step(self) -> None:
        drawing, logits, fed = self._forward()
        self.steps += 1
        if self.sampler.penalises:
            self._see(fed, logits.shape[-1])
        if drawing:  # the rows whose feed is all in draw; the others go on feeding next step
            rows = [self.rows[b] for b in drawing]
            seen = self.seen
            if len(drawing) < len(self.rows):
                at = torch.tensor(drawing, device=logits.device)
                logits, seen = logits[at], (None if seen is None else seen[at])
            u = None if self.sampler.greedy else torch.cat(  # on the CPU: no device launch per row
                [torch.rand(1, 1, generator=s.generator, dtype=torch.float64) for s in rows]).to(self.device)
            tokens = self.sampler.draw(logits, u, seen).tolist()
            for s, token, logp in zip(rows, tokens, self.sampler.logps.pop().tolist()):
                self._drawn(s, token, logp)
        self._squeeze()

    def _see(self, fed: list[list[int]], vocab: int) -> None:
        """The repetition penalty's rows (what each row's prompt and completion hold): from the histories
        after a regroup, else this step's feed set in them (one indexing op, not the histories again)."""
        if self.seen_for is not self.rows:
            self.seen, self.seen_for = seen_tokens([s.history for s in self.rows], vocab, self.device), self.rows
            return
        rows = [b for b, chunk in enumerate(fed) for _ in chunk]
        if rows:
            self.seen[torch.tensor(rows, device=self.device),
                      torch.tensor([t for chunk in fed for t in chunk], device=self.device)] = True

    # ------------------------------------------------------------------ a message's end, its environment

    def _drawn(self, s: Sequence, token: int, logp: float) -> None:
        s.drawn.append(token)
        s.logps.append(logp)
        s.call.versions.setdefault(s.episode, []).append(self.engine.version)
        own = s.stops is not None and s.stops.hit(s.drawn)  # its message's own stop strings
        ended = token in self.engine.eos_ids or self.stops.hit(s.drawn) or own
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
        limits = limits_of(reply)
        s.limit, s.stops = message_limit(s.budget - s.used, limits), self._stops_of(limits)
        check_room(s.episode, len(reply), s.budget, s.used)
        s.turn += 1
        s.generator = self._generator(s)
        if isinstance(reply, NewRow):  # its context starts again: its prompt, then the reply
            self._rewind(s)
        s.feed, s.drawn, s.logps = [*s.feed, *reply], [], []
        if s.in_batch:
            s.state = DECODING
        else:
            s.state = QUEUED
            self.returned.append(s)

    def _stops_of(self, limits: TurnLimits) -> StopStrings | None:
        return StopStrings(self.engine.tokenizer, list(limits.stop)) if limits.stop else None

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

    def _forward(self) -> tuple[list[int], torch.Tensor, list[list[int]]]:
        """Every decoding row's next feed in one forward, right-aligned: the batch indices of the rows
        whose feed is all in (they draw), [rows, vocab] logits at the last column, and each row's tokens fed."""
        engine = self.engine
        width = self._width()
        ids, positions, fed, drawing, chunks = [], [], [], [], []  # lists, one tensor each: a step's rows cost no ops
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
            chunks.append(chunk)
        columns = torch.arange(width)
        new_mask = (columns >= width - torch.tensor(fed)[:, None]).to(self.mask.dtype)  # each row's last fed[b]
        self.mask = append_columns(self.mask, new_mask.to(self.device))  # in place, in blocks of columns
        full = min(self.capacity, sum(call.size for call in self.active))  # rows decoding in a full step
        engine.decode_rows.add(len(self.rows), self._live(), full, len(self.calls))
        return drawing, self._logits(ids, positions), chunks

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
class Carried:
    """A call's completions started in the loop of the call before it, with the weights then served."""

    call: Call
    greedy: bool
    loop: ContinuousLoop

    def matches(self, call, greedy: bool) -> bool:
        """Whether `call` is the one carried: the same prompts and images, G, seed and limits, sampled alike."""
        mine = self.call
        return (greedy == self.greedy and call.seed == mine.seed and call.group_size == mine.group_size
                and call.budgets == mine.budgets and call.prompts == mine.prompts
                and same_images(call.images, mine.images))
