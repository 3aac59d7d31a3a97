"""KL estimators between the policy and a reference policy, per token, and the KL reward penalty.

Estimators (J. Schulman, "Approximating KL divergence", 2020), with d = log_probs - ref_log_probs:
k1 = d, abs = |d|, k2 = d²/2, k3 = exp(-d) + d - 1 (verl's "low_var_kl", clamped to [-10, 10]).
"k1+", "abs+", "k2+", "k3+" (verl's names) have the value of k1, abs, k2, k3 and the gradient of k2
(straight through), whose expected gradient is that of the true KL; "k2+" is k2.
`AdaptiveKLController` adapts the reward penalty's coefficient towards a target KL (Ziegler et al.,
2019; verl's semantics).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from baton.algorithms.utils import masked, masked_mean
from baton.config.registry import Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator")


def register_kl_estimator(name: str):
    """Decorator: make a KL estimator `fn(log_probs, ref_log_probs) -> kl` available by name."""
    return KL_ESTIMATORS.register(name)


def get_kl_estimator(name: str) -> KLFn:
    """A registered KL estimator, or one given by import path "package.module:function"."""
    return KL_ESTIMATORS.get(name)


@register_kl_estimator("k1")
def k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return log_probs - ref_log_probs


@register_kl_estimator("abs")
def abs_kl(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return (log_probs - ref_log_probs).abs()


@register_kl_estimator("k2")
def k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return 0.5 * (log_probs - ref_log_probs).square()


@register_kl_estimator("k3")
def k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    log_ratio = (ref_log_probs - log_probs).clamp(min=-20, max=20)  # keeps exp finite
    return (log_ratio.exp() - log_ratio - 1).clamp(min=-10, max=10)


def _straight_through_k2(value: torch.Tensor, log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """`value` forward, k2's gradient backward."""
    grad_source = k2(log_probs, ref_log_probs)
    return grad_source - grad_source.detach() + value.detach()


@register_kl_estimator("k1+")
def k1_plus(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return _straight_through_k2(k1(log_probs, ref_log_probs), log_probs, ref_log_probs)


@register_kl_estimator("abs+")
def abs_kl_plus(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return _straight_through_k2(abs_kl(log_probs, ref_log_probs), log_probs, ref_log_probs)


@register_kl_estimator("k2+")
def k2_plus(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return k2(log_probs, ref_log_probs)


@register_kl_estimator("k3+")
def k3_plus(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    return _straight_through_k2(k3(log_probs, ref_log_probs), log_probs, ref_log_probs)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token KL estimate [batch, response_len], elementwise (mask it when aggregating).

    As a loss term: `agg_loss(kl_penalty(log_probs, ref_log_probs, "k3"), response_mask, mode)`.
    """
    return get_kl_estimator(estimator)(log_probs, ref_log_probs)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,  # [batch, response_len]
    log_probs: torch.Tensor,  # [batch, response_len]
    ref_log_probs: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """token_level_rewards = scores - kl_coef · kl, 0 off the mask; metrics
    `actor/reward_kl_penalty` (per-sequence masked mean KL, averaged over sequences, as verl) and
    `actor/reward_kl_penalty_coeff`."""
    log_probs, ref_log_probs = masked(log_probs, response_mask), masked(ref_log_probs, response_mask)
    kl = masked(kl_penalty(log_probs, ref_log_probs, estimator), response_mask)
    rewards = masked(token_level_scores, response_mask) - kl_coef * kl
    mean_kl = masked_mean(kl, response_mask, dim=-1).mean()
    return rewards, {"actor/reward_kl_penalty": float(mean_kl), "actor/reward_kl_penalty_coeff": float(kl_coef)}


class AdaptiveKLController:
    """KL reward coefficient adapted towards `target_kl` (verl's `AdaptiveKLController`): after a
    step with observed KL `current_kl` over `num_steps` samples, the coefficient is multiplied by
    1 + clip(current_kl / target_kl - 1, -0.2, 0.2) · num_steps / horizon."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0 and horizon > 0 (got {target_kl}, {horizon})")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, num_steps: int) -> float:
        """Update and return the coefficient."""
        proportional_error = float(np.clip(current_kl / self.target_kl - 1, -0.2, 0.2))
        self.value *= 1 + proportional_error * num_steps / self.horizon
        return self.value
