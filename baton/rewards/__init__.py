"""Reward functions: `fn(response: str, ground_truth: str, **fields) -> float` (or a dict: the reward under "score",
further numeric fields beside it), by name or import path."""

from baton.rewards.registry import REWARDS, RewardFn, get_reward_fn, register_reward
from baton.rewards.rules import (exact_match, exact_match_parts, extract_answer, format_reward, math_reward,
                                 normalize_answer)
from baton.rewards.scoring import REWARD_EXTRA_PREFIX, REWARD_ON_ERROR, RewardError, check_reward_columns, score_rows

__all__ = ["REWARDS", "REWARD_EXTRA_PREFIX", "REWARD_ON_ERROR", "RewardError", "RewardFn", "check_reward_columns",
           "exact_match", "exact_match_parts", "extract_answer", "format_reward", "get_reward_fn", "math_reward",
           "normalize_answer", "register_reward", "score_rows"]
