"""Strategies: how a role's model runs on a backend, chosen by name (or "module:Class" import path)."""

from __future__ import annotations

import importlib

from baton.strategy.base import (
    InferenceStrategy,
    LossFn,
    ModelStrategy,
    OptimizerConfig,
    RolloutStrategy,
    SamplingParams,
    SchedulerConfig,
    StrategyConfig,
    TrainStrategy,
)

# name -> "module:Class", imported on first use so that e.g. the mock strategy does not import FSDP.
STRATEGIES: dict[str, str] = {
    "hf": "baton.strategy.hf:HFStrategy",
    "fsdp2": "baton.strategy.fsdp2:Fsdp2Strategy",
    "mock": "baton.strategy.mock:MockStrategy",
    # A rollout only, on the vllm engine, so it lives in baton.engines (this layer imports no engine); needs vLLM
    # (scripts/setup.sh --vllm).
    "vllm": "baton.engines.vllm_rollout:VLLMRollout",
}


def strategy_class(name: str) -> type:
    """The class for a registered name, or for an import path "package.module:Class"."""
    target = STRATEGIES.get(name, name)
    if ":" not in target:
        raise ValueError(f"unknown strategy {name!r}; valid: {sorted(STRATEGIES)} or an import path 'package.module:Class'")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def create_strategy(config: StrategyConfig, **kwargs):
    return strategy_class(config.name)(config, **kwargs)


__all__ = [
    "InferenceStrategy", "LossFn", "ModelStrategy", "OptimizerConfig", "RolloutStrategy", "STRATEGIES", "SamplingParams",
    "SchedulerConfig", "StrategyConfig", "TrainStrategy", "create_strategy", "strategy_class",
]
