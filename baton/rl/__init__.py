"""The RL algorithm object that every driver composes (`RLAlgorithm`), its settings, losses and metrics."""

from baton.rl.algorithm import (
                                RLAlgorithm,
                                StaleSamplesWarning,
                                TrainingRoles,
                                add_model_scores,
                                advantage_columns,
                                baseline_per_row,
                                per_row,
                                reward_components,
)
from baton.rl.config import AlgorithmConfig, KLControlConfig
from baton.rl.losses import DistillLoss, PolicyLoss, SFTLoss, ValueLoss
from baton.rl.metrics import SignalWatch, batch_metrics, logprob_gap, validation_set_metrics, zero_std_group_fraction

__all__ = ["AlgorithmConfig", "DistillLoss", "KLControlConfig", "PolicyLoss", "RLAlgorithm", "SFTLoss", "SignalWatch",
           "StaleSamplesWarning", "TrainingRoles", "ValueLoss", "add_model_scores", "advantage_columns",
           "baseline_per_row", "batch_metrics", "logprob_gap", "per_row", "reward_components", "validation_set_metrics",
           "zero_std_group_fraction"]
