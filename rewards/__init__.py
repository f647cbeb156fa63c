"""Reward functions: pure `(completion, answer) -> float`, selected by name."""

from rewards.registry import REWARD_FUNCTIONS, RewardScores, get_reward, score_completions

__all__ = ["REWARD_FUNCTIONS", "RewardScores", "get_reward", "score_completions"]
