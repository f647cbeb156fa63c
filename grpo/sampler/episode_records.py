"""What an episode records, and the step's metrics of them: one episode's tokens (the model's, with
their behaviour log-probs, and the environment's replies), its turns, tool calls and environment
failures (`Episode`), a run's B x G episodes as rollouts and reward rows (`Episodes`), and the
per-step means over a batch's episodes (`episode_metrics`). The runner that fills them in:
grpo/sampler/episodes.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from grpo.sampler.rollout import Rollouts
from grpo.wire.batch import ENVIRONMENT_TOKEN


@dataclass
class Episode:
    tokens: list[int] = field(default_factory=list)  # after the prompt: model and environment tokens
    model: list[bool] = field(default_factory=list)  # True where the model drew the token
    logps: list[float] = field(default_factory=list)  # behaviour log-probs (0 at environment tokens)
    drawn: list[int] = field(default_factory=list)  # where in `tokens` the model's draws stand, in the order drawn
    # the weights version that drew each of `drawn` (sampling.in_flight_updates: the decode loop's record); None: all
    # drawn by the version served when the step started
    versions: list[int] | None = None
    messages: list[str] = field(default_factory=list)  # the model's messages the environment took, in order
    last_message: str = ""  # the last model message as the rewards read it (data.prefill, no special tokens)
    said: str = ""  # the last model message as the environment reads it: special tokens kept, less the EOS
    turns: int = 0
    truncated: bool = False
    reward: float | None = None  # the environment's, summed over its replies
    tool_calls: int = 0
    tool_errors: int = 0
    malformed_calls: int = 0  # of the tool calls, the ones that could not be read or named no tool
    call_messages: int = 0  # model messages that made a tool call (well-formed or not)
    well_formed_messages: int = 0  # of them, the ones whose every call was well-formed
    env_errors: int = 0  # steps that raised or timed out (grpo/environments/pool.py)
    open_failed: bool = False  # its environment could not start before turn 1 (counted in env_errors)
    replies: int = 0  # the environment's steps that answered (did not fail)
    env_error: str = ""  # its environment's first failure: the error, and where in its code it was raised
    # digests of what it was shown (grpo.environments.pool.shown_digest): the opening its environment made
    # (None: it could not open), then the reply to each of `messages`; a rebuild's replay is checked against them
    shown: list = field(default_factory=list)
    replay_mismatch: bool = False  # its rebuilt environment replayed otherwise than it was shown: ended, failed
    child_restarts: int = 0  # restarts of the environments' child during its calls (its own hang, say)
    rebuilds: int = 0  # times its environment was made again at a step (lost with the child, a raise, a session)
    replayed_steps: int = 0  # earlier messages replayed in those rebuilds
    # an agent's session (grpo/agent/runner.py): its requests by how they continued the row (clean, equivalent),
    # the ones refused (by reason: the prefix rule's, or a limit's), and its turns the harness never received
    agent: bool = False
    continued: dict = field(default_factory=dict)
    breaks: dict = field(default_factory=dict)
    undelivered: int = 0
    # where in `tokens` each row after the first begins (a request that did not continue what the model read starts
    # a new row, read after the prompt alone), and why each did (by reason: history.py's, or the template's)
    row_starts: list[int] = field(default_factory=list)
    new_rows: dict = field(default_factory=dict)

    @property
    def environment_failed(self) -> bool:
        """Its environment failed it: it could not open and no step replied, or its rebuilt
        environment replayed otherwise than it was shown (the episode was ended there). An agent's session: any
        failure (its harness raised or gave no reward, its first request was refused, a turn failed)."""
        if self.agent:
            return self.env_errors > 0
        return self.replay_mismatch or (self.env_errors > 0 and self.replies == 0)

    @property
    def lost_its_own_environment(self) -> bool:
        """Its own call hung, died or raised before its environment was rebuilt: a replay that then
        differed may be its doing, so its failure is the episode's, not a loss nobody caused."""
        return self.child_restarts > 0 or self.env_errors > self.replay_mismatch + self.open_failed

    def stamp(self, versions: list[int]) -> None:
        """The version of each token the model drew, as the decode loop recorded them (one per draw, in order)."""
        if len(versions) != len(self.drawn):
            raise RuntimeError(f"the decode loop recorded {len(versions)} versions for an episode whose model drew "
                               f"{len(self.drawn)} tokens")
        self.versions = list(versions)

    def token_versions(self) -> torch.Tensor:
        """int32 [len(tokens)]: each model token's version, ENVIRONMENT_TOKEN elsewhere (a draw masked out since,
        e.g. a turn its harness never received, is context too). Needs `stamp`."""
        out = torch.full((len(self.tokens),), ENVIRONMENT_TOKEN, dtype=torch.int32)
        out[torch.tensor(self.drawn, dtype=torch.long)] = torch.tensor(self.versions, dtype=torch.int32)
        return torch.where(torch.tensor(self.model, dtype=torch.bool), out, ENVIRONMENT_TOKEN)

    def new_row(self, ids, why: str) -> None:
        """A new row of this sample from here (grpo/sampler/rollout/sequences.py NewRow): `ids`, the tokens the model
        reads after the prompt before its next message, context only."""
        self.row_starts.append(len(self.tokens))
        self.new_rows[why] = self.new_rows.get(why, 0) + 1
        self.add(ids, model=False)

    def rows(self) -> list[list[int]]:
        """Its rows' tokens (each after the prompt), in order."""
        bounds = [0, *self.row_starts, len(self.tokens)]
        return [self.tokens[a:b] for a, b in zip(bounds, bounds[1:])]

    def segments(self) -> torch.Tensor:
        """int32 [len(tokens)]: which of the sample's rows each token is in (0 up to the first new row)."""
        out = torch.zeros(len(self.tokens), dtype=torch.int32)
        for start in self.row_starts:
            out[start:] += 1
        return out

    def count_failure(self, failure: str | None) -> None:
        """Count a failed environment call (None: it answered); the first one is kept."""
        if failure is not None:
            self.env_errors += 1
            self.env_error = self.env_error or failure

    def add(self, ids, model: bool, logps=None) -> None:
        ids = [int(t) for t in ids]
        if model:
            self.drawn += range(len(self.tokens), len(self.tokens) + len(ids))
        self.tokens += ids
        self.model += [model] * len(ids)
        self.logps += [float(x) for x in logps] if logps is not None else [0.0] * len(ids)


@dataclass
class Episodes:
    """B x G episodes, prompt-major."""

    prompts: list  # the prompts as the episodes saw them: with their environment's opening message
    rollouts: Rollouts  # completion_ids: whole episodes; model_masks set
    texts: list[str]  # each episode's last model message (data.prefill included): what the rewards score
    rows: list[dict]  # the reward rows, each with the episode's `env_reward`
    episodes: list[Episode]

    @classmethod
    def of(cls, prompts: list, episodes: list[Episode], rows: list[dict]) -> "Episodes":
        """The episodes as rollouts, with each one's reward row (`rows`: its dataset row, one per episode)."""
        return cls(prompts=prompts,
                   rollouts=Rollouts(completion_ids=[torch.tensor(e.tokens, dtype=torch.long) for e in episodes],
                                     truncated=[e.truncated for e in episodes],
                                     logps=[torch.tensor(e.logps, dtype=torch.float32) for e in episodes],
                                     model_masks=[torch.tensor(e.model, dtype=torch.bool) for e in episodes],
                                     token_versions=[e.token_versions() for e in episodes]
                                     if episodes and all(e.versions is not None for e in episodes) else None,
                                     segments=[e.segments() for e in episodes]
                                     if any(e.row_starts for e in episodes) else None),
                   texts=[e.last_message for e in episodes],
                   rows=[{**row, "env_reward": e.reward} for row, e in zip(rows, episodes, strict=True)],
                   episodes=episodes)


def episode_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Per-step means over the batch's episodes. env/tool_messages/well_formed_rate: of the model's
    messages that made a tool call, the share whose every call was well-formed (readable, to a tool
    the environment has, with arguments that fit); absent when no message made one."""
    n = max(len(episodes), 1)
    calls = sum(e.tool_calls for e in episodes)
    call_messages = sum(e.call_messages for e in episodes)
    model_tokens = sum(sum(e.model) for e in episodes)
    well_formed = sum(e.well_formed_messages for e in episodes)
    return {**({"env/tool_messages/well_formed_rate": well_formed / call_messages} if call_messages else {}),
            **(agent_metrics(episodes) if any(e.agent for e in episodes) else {}),
            "env/turns/mean": sum(e.turns for e in episodes) / n,
            "env/turns/max": float(max((e.turns for e in episodes), default=0)),
            "env/tool_calls/mean": calls / n,
            "env/tool_errors/mean": sum(e.tool_errors for e in episodes) / n,
            "env/tool_error_rate": sum(e.tool_errors for e in episodes) / max(calls, 1),
            # the share of episodes with a call the environment could read, to a tool it has, with arguments that fit
            "env/well_formed_call_rate": sum(e.tool_calls > e.malformed_calls for e in episodes) / n,
            "env/env_errors": float(sum(e.env_errors for e in episodes)),
            # rebuilt environments: the child's restarts (a hang, a death), episodes made again at a step
            # and the earlier messages replayed in them, and the episodes ended because a replay differed
            "env/child_restarts": float(sum(e.child_restarts for e in episodes)),
            "env/rebuilds": float(sum(e.rebuilds for e in episodes)),
            "env/replayed_steps": float(sum(e.replayed_steps for e in episodes)),
            "env/replay_mismatches": float(sum(e.replay_mismatch for e in episodes)),
            "env/model_token_fraction": model_tokens / max(sum(len(e.tokens) for e in episodes), 1)}


def agent_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Agents' sessions: their requests that continued the row exactly (clean: the fresh render extends it) or by
    the reply rule (equivalent), those that started a new row, by reason, those refused by reason (the prefix rule's,
    or a limit's), the rows per session, and the turns whose response never reached its client (never trained)."""
    metrics = {"agent/undelivered_turns": float(sum(e.undelivered for e in episodes)),
               "agent/rows_per_session": sum(1 + len(e.row_starts) for e in episodes) / max(len(episodes), 1)}
    for name, counts in (("continued", [e.continued for e in episodes]),
                         ("refused", [e.breaks for e in episodes]), ("new_row", [e.new_rows for e in episodes])):
        for key in sorted({k for c in counts for k in c}):
            metrics[f"agent/{name}/{key}"] = float(sum(c.get(key, 0) for c in counts))
    return metrics
