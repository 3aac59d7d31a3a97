"""The reward registry: name → reward function, `fn(response: str, ground_truth: str, **fields) -> float | dict`,
or verl's `compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`: a function with
parameters named `data_source` and `solution_str` is called as verl calls it (`baton.rewards.routing.Reward`)."""

from __future__ import annotations

import importlib
from typing import Callable

RewardFn = Callable[..., float]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str):
    """Decorator: make a reward function available by name."""

    def decorator(fn: RewardFn) -> RewardFn:
        if name in REWARDS:
            raise ValueError(f"reward {name!r} is already registered")
        REWARDS[name] = fn
        return fn

    return decorator


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward, or one given by import path "package.module:function"."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" not in name:
        raise ValueError(f"unknown reward {name!r}; valid: {sorted(REWARDS)} or an import path 'package.module:function'")
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load reward function {name!r}: {exc} (modules are found beside the config file, "
                         "in the working directory and on PYTHONPATH)") from exc
