"""Reward functions: built-in pure `(completion, answer) -> float`, or a user's by import path;
and service rewards (a reward model, an HTTP endpoint, an LLM judge: rewards/services.py).

The names below load the registry (and torch) when first used: the jail that runs rule rewards
imports grpo.rewards.builtins alone. Installed as grpo.rewards (pyproject.toml's package-dir)."""

__all__ = ["REWARD_FUNCTIONS", "RewardScores", "batched", "get_reward", "score_completions"]


def __getattr__(name: str):
    if name in __all__:
        from grpo.rewards import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'rewards' has no attribute {name!r}")
