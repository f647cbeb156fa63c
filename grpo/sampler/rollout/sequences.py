"""A generate call's sequences as the decode loops keep them (the HF engine's continuous loop,
grpo/sampler/rollout/continuous.py, and vLLM's tasks, grpo/sampler/rollout/vllm_engine.py): `Call`,
B x G sequences with their budgets and seed; `Sequence`, one row's life in the loop and its state; the
seeds of an episode's turns (`episode_seed`), and the check that a reply leaves room for a token.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch

# (episode, the message's tokens, their log-probs, cut at its limit) -> the environment's reply to feed
# before the episode's next message, or None: the episode is over. A reply must leave the model room for
# one token at least within the episode's budget (grpo/sampler/episodes.py cuts one that does not fit); a
# `ReplyTokens` sets the next message's own limits (TurnLimits); a `NewRow` replaces the episode's context.
OnTurn = Callable[[int, torch.Tensor, torch.Tensor, bool], "list[int] | None"]


@dataclass(frozen=True)
class TurnLimits:
    """What a message may draw within its episode's budget, set by whoever asked for it (an agent request's
    max_tokens and stop): at most `max_tokens` tokens, and it ends at the token that completes a `stop` string."""

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()


NO_LIMITS = TurnLimits()


class ReplyTokens(list):
    """An environment's reply (its tokens) with the limits of the model's next message; a plain list sets none."""

    limits: TurnLimits = NO_LIMITS

    @classmethod
    def of(cls, tokens: list[int], limits: TurnLimits) -> "ReplyTokens":
        reply = cls(tokens)
        reply.limits = limits
        return reply


class NewRow(ReplyTokens):
    """A reply that starts the episode's context again: the model reads next its prompt, then these tokens (an
    agent's request that does not continue what the model read: grpo/agent/tokens.py), not what came before. The
    tokens still count against the episode's budget, as a reply's do (they are stored in its record)."""


def limits_of(reply: list[int]) -> TurnLimits:
    return getattr(reply, "limits", NO_LIMITS)


def message_limit(room: int, limits: TurnLimits) -> int:
    """The most tokens a message may draw: what is left of its episode's budget (`room`), or its max_tokens if less."""
    return room if limits.max_tokens is None else min(room, limits.max_tokens)


def hashed_seed(name: str) -> int:
    """A seed of its own for what `name` names (below 2**62): the same name, the same seed."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") >> 2


def episode_seed(seed: int, episode: int, turn: int) -> int:
    """The seed of episode `episode`'s turn `turn` (0: its first message) in a step seeded `seed`."""
    return hashed_seed(f"{seed}/episode{episode}/turn{turn}")


def check_room(episode: int, reply: int, budget: int, used: int) -> None:
    """An episode's reply of `reply` tokens must leave room for one token of its next message."""
    if budget - used < 1:
        raise ValueError(f"episode {episode}: a reply of {reply} tokens leaves no room for another message within "
                         f"the episode's budget of {budget} tokens ({used} used with it); cut the reply to leave one "
                         "token at least, or end the episode")


@dataclass
class NextCall:
    """A generate call to come: `HFEngine.generate(then=...)` starts its completions in the rows the
    current call leaves free."""

    prompts: list[list[int]]
    group_size: int
    seed: int | None
    max_new_tokens: list[int] | None = None
    images: list | None = None  # per prompt, its images (grpo/model/vision.py) or None


def any_images(images: list | None) -> list | None:
    """Per-prompt images as the loops take them: None when no prompt has any."""
    return images if images is not None and any(i is not None for i in images) else None


def same_images(a: list | None, b: list | None) -> bool:
    """Whether two calls' prompts hold the same images (None: text alone): equal pixels and grids, prompt by prompt
    (pictures of one size give prompts of the same tokens)."""
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x is y or (x is not None and y is not None and torch.equal(x.grid_thw, y.grid_thw)
                   and torch.equal(x.pixel_values, y.pixel_values)) for x, y in zip(a, b))


DECODING, WAITING, QUEUED, DONE = "decoding", "waiting on its environment", "queued", "done"


@dataclass(eq=False)
class Call:
    """One generate call's sequences: B x G, sequence j of prompt j // G."""

    prompts: list[list[int]]
    group_size: int
    budgets: list[int]  # per prompt
    seed: int | None
    on_turn: OnTurn
    first_limits: list[TurnLimits] | None = None  # per sequence: its first message's own limits
    images: list | None = None  # per prompt, its images or None (a vision-language model's prefill reads them)
    pending: int = 0  # its sequences not done
    versions: dict = field(default_factory=dict)  # sequence -> the weights version of each token it drew, in order

    @property
    def size(self) -> int:
        return len(self.prompts) * self.group_size

    @classmethod
    def of(cls, prompts: list[list[int]], group_size: int, budget: int | list[int], seed: int | None, greedy: bool,
           on_turn: OnTurn, first_limits: list[TurnLimits] | None = None, images: list | None = None) -> "Call":
        budgets = [budget] * len(prompts) if isinstance(budget, int) else list(budget)
        if min(budgets, default=1) < 1:
            raise ValueError(f"a sequence's token budget must be at least 1; got {min(budgets)}")
        if seed is None and not greedy:
            seed = int(torch.randint(0, 2**62, (1,)))  # from torch's generator, as `generate` draws without a seed
        if first_limits is not None and len(first_limits) != len(prompts) * group_size:
            raise ValueError(f"first_limits holds {len(first_limits)} for {len(prompts) * group_size} sequences")
        return cls(prompts, group_size, budgets, seed, on_turn, first_limits, images)

    def image(self, i: int):
        """Prompt i's images (None: text alone)."""
        return self.images[i] if self.images else None

    def first(self, j: int) -> TurnLimits:
        """Sequence j's first message's own limits."""
        return self.first_limits[j] if self.first_limits else NO_LIMITS


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
    shift: int = 0  # its positions after the prompt less the prompt's length (images: M-RoPE's positions go on)
    state: str = QUEUED
    in_batch: bool = False
    waiting_since: int = 0  # the decode step its environment call started at
    turn: int = 0
    used: int = 0  # tokens after its prompt so far: its earlier messages and replies
    drawn: list[int] = field(default_factory=list)  # this message's tokens
    logps: list[float] = field(default_factory=list)
    generator: torch.Generator | None = None
    history: list[int] = field(default_factory=list)  # the tokens its KV holds, in order (to compute it again)
    stops: object = None  # its message's own stop strings (a StopStrings), beside sampling.stop

    @property
    def columns(self) -> int:
        return 0 if self.kv is None else self.kv[0][0].shape[1]
