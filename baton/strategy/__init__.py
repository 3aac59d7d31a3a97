"""Strategies: how a role's model runs on a backend, chosen by name (or "module:Class" import path); the backends and
what each can do are declared in `baton.strategy.capabilities`."""

from __future__ import annotations

from baton.strategy.base import (
    InferenceStrategy,
    LossFn,
    ModelStrategy,
    OptimizerConfig,
    ParallelConfig,
    RolloutStrategy,
    SamplingParams,
    SchedulerConfig,
    StrategyConfig,
    TrainStrategy,
)
from baton.strategy.capabilities import BACKENDS, Capabilities, capabilities, check_parallel_layout, strategy_class


def create_strategy(config: StrategyConfig, **kwargs):
    """The strategy `config.name` names, built from `config` (`kwargs`: its class's own arguments)."""
    check_parallel_layout(config)
    return strategy_class(config.name)(config, **kwargs)


__all__ = [
    "BACKENDS", "Capabilities", "InferenceStrategy", "LossFn", "ModelStrategy", "OptimizerConfig", "ParallelConfig", "RolloutStrategy",
    "SamplingParams", "SchedulerConfig", "StrategyConfig", "TrainStrategy", "capabilities", "create_strategy",
    "strategy_class",
]
