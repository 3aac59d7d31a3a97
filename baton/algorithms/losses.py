"""Policy losses (name → `fn(log_probs, old_log_probs, advantages, response_mask, loss_agg_mode, **params)
-> (loss, metrics)`), the clipped value loss and the entropy term.

Each returns `agg_loss` of its per-token loss; inside a strategy loss function that wants the
sum form, multiply by `num_loss_units(response_mask, loss_agg_mode)` (see `aggregation`).
Metrics are Python floats computed over the valid tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

from baton.algorithms.aggregation import agg_loss
from baton.algorithms.utils import masked, masked_mean

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}


def register_policy_loss(name: str):
    """Decorator: make a policy loss available by name."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered")
        POLICY_LOSSES[name] = fn
        return fn

    return decorator


def get_policy_loss(name: str) -> PolicyLossFn:
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


@register_policy_loss("ppo_clip")
def ppo_clip_loss(
    log_probs: torch.Tensor,  # [batch, response_len], current policy, carries the gradient
    old_log_probs: torch.Tensor,  # [batch, response_len], policy that sampled the data
    advantages: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip (verl semantics), r = exp(log_probs - old_log_probs):

        loss = max(-A·r, -A·clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))   when A >= 0
        loss = min(that, -A·clip_ratio_c)                                        when A < 0

    A larger `clip_ratio_high` than `clip_ratio_low` is DAPO's clip-higher. Metrics: `pg_clipfrac`
    (share of tokens where the ratio clip binds), `ppo_kl` (mean of old - new log-prob) and
    `pg_clipfrac_lower` (share where the dual clip binds).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO (got {clip_ratio_c}); the usual value is 3.0")
    log_probs, old_log_probs = masked(log_probs, response_mask), masked(old_log_probs, response_mask)
    advantages = masked(advantages, response_mask)
    log_ratio = (log_probs - old_log_probs).clamp(min=-20.0, max=20.0)  # keeps exp finite
    ratio = log_ratio.exp()
    losses = -advantages * ratio
    losses_clipped = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_losses = torch.maximum(losses, losses_clipped)
    dual_clip_losses = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_losses, dual_clip_losses), clip_losses)
    with torch.no_grad():
        dual_clipped = negative & (clip_losses > dual_clip_losses)
        metrics = {
            "pg_clipfrac": float(masked_mean((losses_clipped > losses).float(), response_mask)),
            "ppo_kl": float(masked_mean(-log_ratio, response_mask)),
            "pg_clipfrac_lower": float(masked_mean(dual_clipped.float(), response_mask)),
        }
    return agg_loss(pg_losses, response_mask, loss_agg_mode), metrics


def value_loss(
    values: torch.Tensor,  # [batch, response_len], current critic, carries the gradient
    old_values: torch.Tensor,  # [batch, response_len], critic that produced the returns' baseline
    returns: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 · agg(max((v - R)², (clip(v, old - ε, old + ε) - R)²)) (verl); metric `vf_clipfrac`,
    the share of tokens where the clipped term is the larger."""
    values, old_values = masked(values, response_mask), masked(old_values, response_mask)
    returns = masked(returns, response_mask)
    clipped = torch.maximum(torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value)
    losses = (values - returns) ** 2
    losses_clipped = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(losses, losses_clipped), response_mask, loss_agg_mode)
    with torch.no_grad():
        metrics = {"vf_clipfrac": float(masked_mean((losses_clipped > losses).float(), response_mask))}
    return loss, metrics


def entropy_loss(entropy: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean") -> torch.Tensor:
    """Aggregated token entropy [batch, response_len] → scalar (positive). As a bonus it is
    subtracted: `loss = pg_loss - entropy_coeff * entropy_loss(entropy, mask, mode)`."""
    return agg_loss(masked(entropy, response_mask), response_mask, loss_agg_mode)
