"""Reward functions: built-in pure `(completion, answer) -> float`, or a user's by import path;
and service rewards (a reward model, an HTTP endpoint, an LLM judge: rewards/services.py)."""

from rewards.registry import REWARD_FUNCTIONS, RewardScores, batched, get_reward, score_completions

__all__ = ["REWARD_FUNCTIONS", "RewardScores", "batched", "get_reward", "score_completions"]
