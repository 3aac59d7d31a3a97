"""The reward registry: name → reward function, `fn(response: str, ground_truth: str, **fields) -> float | dict`,
or verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`: a function with
parameters named `data_source` and `solution_str` is called as verl calls it (`baton.rewards.routing.Reward`)."""

from __future__ import annotations

from typing import Callable

from baton.config.registry import Registry

RewardFn = Callable[..., float]
REWARDS: Registry[RewardFn] = Registry("reward")
# Rewards whose running time the response decides (a parser or a solver that model output can make run for
# minutes): scored in processes with a per-row time limit unless the config chooses one (`scoring_plan`).
_SLOW: set[RewardFn] = set()


def register_reward(name: str, *, slow: bool = False):
    """Decorator: make a reward function available by name. slow: the response can make it run for long (see
    `is_slow`)."""
    def decorator(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        if slow:
            _SLOW.add(fn)
        return fn
    return decorator


def is_slow(fn: RewardFn) -> bool:
    """Whether `fn` was registered with `slow=True`, however it is named (by registry name or import path)."""
    return fn in _SLOW


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward, or one given by import path "package.module:function"."""
    return REWARDS.get(name)
