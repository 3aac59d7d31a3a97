"""Reward functions: `fn(response: str, ground_truth: str, **fields) -> float`, by name or import path."""

from baton.rewards.registry import REWARDS, RewardFn, get_reward_fn, register_reward
from baton.rewards.rules import exact_match, extract_answer, format_reward, math_reward, normalize_answer
from baton.rewards.scoring import REWARD_ON_ERROR, RewardError, check_reward_columns, score_rows

__all__ = ["REWARDS", "REWARD_ON_ERROR", "RewardError", "RewardFn", "check_reward_columns", "exact_match",
           "extract_answer", "format_reward", "get_reward_fn", "math_reward", "normalize_answer", "register_reward",
           "score_rows"]
