"""What never works stops the sampler: a reward that fails on every sample, or an environment that
fails on every episode, for several steps in a row (rewards.max_failed_steps, env.max_failed_steps).
A run without scores (every sample left out or the batch's worst, or on rewards.fallback alone),
or on error messages alone, learns nothing; one that fails on some samples only scores those as
rewards.on_failure says, with a warning."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grpo.rewards.registry import ENV_REWARD
from grpo.rewards.services import is_service_name

if TYPE_CHECKING:
    from grpo.rewards import RewardScores
    from grpo.settings import Config


@dataclass
class FailedOnAll:
    """What failed on every sample of a round (merged: of every round of a step)."""

    samples: int  # the samples (episodes) they failed on
    rewards: dict[str, str]  # reward name -> its first failure, for each reward that failed on every sample
    environment: str | None = None  # its first failure, when the environment failed on every episode

    @classmethod
    def of(cls, scores: RewardScores, episodes: list | None) -> "FailedOnAll":
        """From a round's scores and episodes. env_reward failing because the environment failed on
        every episode is the environment's failure: env.max_failed_steps decides, not the reward's limit."""
        n = len(scores.total)
        broken = bool(episodes) and all(e.environment_failed for e in episodes)
        rewards = {name: scores.errors.get(name, "") for name, failed in scores.failures.items()
                   if n and failed == n and not (broken and name == ENV_REWARD)}
        return cls(n, rewards, episodes[0].env_error if broken else None)

    def both(self, other: "FailedOnAll") -> "FailedOnAll":
        """Over this round and `other`: what failed on every sample of each."""
        return FailedOnAll(self.samples + other.samples,
                           {name: error for name, error in self.rewards.items() if name in other.rewards},
                           self.environment if other.environment else None)


class AlwaysFailing(RuntimeError):
    """A reward or the environment failed on every sample of its max_failed_steps steps in a row."""


class RewardAlwaysFails(AlwaysFailing):
    """A reward failed on every sample of rewards.max_failed_steps steps in a row."""


class EnvironmentAlwaysFails(AlwaysFailing):
    """The environment failed on every episode of env.max_failed_steps steps in a row."""


@dataclass
class FailureStreaks:
    """Steps in a row on which a reward, or the environment, failed on every sample: one that trains
    without scores, or on error messages alone, learns nothing. At rewards.max_failed_steps
    (env.max_failed_steps) steps in a row the sampler stops (0: never); failing on some samples only
    scores those as rewards.on_failure says, with a warning."""

    rewards: dict[str, int] = field(default_factory=dict)  # reward name -> steps in a row
    environment: int = 0

    def observe(self, cfg: Config, failed: FailedOnAll) -> None:
        """Count this step; AlwaysFailing, naming what failed, why and what to do, at a limit."""
        self.environment = self.environment + 1 if failed.environment else 0
        self.rewards = {name: self.rewards.get(name, 0) + 1 for name in failed.rewards}
        if failed.environment and self.environment >= cfg.env.max_failed_steps > 0:
            what = f"environment {cfg.env.name}" if cfg.env.name else f"agent {cfg.agent.harness}"
            raise EnvironmentAlwaysFails(
                f"{what} failed on all {failed.samples} episodes in each of the last "
                f"{self.environment} steps: {failed.environment}; stopped. Fix the {what.split()[0]}, or set "
                "env.max_failed_steps=0 to train on with its errors shown to the model")
        for name, error in failed.rewards.items():
            if self.rewards[name] >= cfg.rewards.max_failed_steps > 0:
                raise RewardAlwaysFails(
                    f"reward {name} failed on all {failed.samples} samples in each of the last {self.rewards[name]} "
                    f"steps: {error}; stopped. Fix the {'service' if is_service_name(name) else 'function'}, or set "
                    f"rewards.max_failed_steps=0 to train on {GOING_ON[cfg.rewards.on_failure]}")


GOING_ON = {"worst": "without it (the samples it fails on score the batch's worst, or are left out)",
            "fallback": "with rewards.fallback"}  # what rewards.max_failed_steps=0 trains on, per rewards.on_failure
