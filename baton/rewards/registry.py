"""The reward registry: name → reward function, `fn(response: str, ground_truth: str, **fields) -> float | dict`,
or verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`: a function with
parameters named `data_source` and `solution_str` is called as verl calls it (`baton.rewards.routing.Reward`)."""

from __future__ import annotations

from typing import Callable

from baton.config.registry import Registry

RewardFn = Callable[..., float]
REWARDS: Registry[RewardFn] = Registry("reward")


def register_reward(name: str):
    """Decorator: make a reward function available by name."""
    return REWARDS.register(name)


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward, or one given by import path "package.module:function"."""
    return REWARDS.get(name)
