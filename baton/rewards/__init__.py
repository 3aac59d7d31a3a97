"""Reward functions: `fn(response: str, ground_truth: str, **fields) -> float` (or a dict: the reward under "score",
further numeric fields and maybe a string "pred" beside it), or verl's `compute_score(data_source, solution_str,
ground_truth, extra_info=None)`; by name or import path, one for every row or one per data_source, with their
settings from the config (`reward_kwargs`), never from data rows."""

import baton.rewards.sandbox  # noqa: F401  registers code_sandbox and code_sandbox_all
from baton.rewards.math_equiv import math_verify_reward
from baton.rewards.overlong import overlong_penalty
from baton.rewards.pool import DEFAULT_TIMEOUT_S_PER_ROW, ScoringPool, ScoringProcessError, scoring_pool
from baton.rewards.registry import REWARDS, RewardFn, get_reward_fn, is_slow, register_reward
from baton.rewards.routing import (DATA_SOURCE, DEFAULT_ROUTE, Reward, RewardRoutes, check_reward_columns,
                                   uses_verl_signature)
from baton.rewards.rules import (exact_match, exact_match_parts, extract_answer, format_reward, math_reward,
                                 normalize_answer)
from baton.rewards.scoring import REWARD_EXTRA_PREFIX, REWARD_ON_ERROR, RewardError, Scores, score_rows
from baton.rewards.values import PRED

__all__ = ["DATA_SOURCE", "DEFAULT_ROUTE", "DEFAULT_TIMEOUT_S_PER_ROW", "PRED", "REWARDS", "REWARD_EXTRA_PREFIX",
           "REWARD_ON_ERROR", "Reward", "RewardError", "RewardFn", "RewardRoutes", "Scores", "ScoringPool",
           "ScoringProcessError", "check_reward_columns", "exact_match", "exact_match_parts", "extract_answer",
           "format_reward", "get_reward_fn", "is_slow", "math_reward", "math_verify_reward", "normalize_answer",
           "overlong_penalty", "register_reward", "score_rows", "scoring_pool", "uses_verl_signature"]
