"""Advantage estimators: name → `fn(...) -> (advantages, returns)`, both [batch, response_len] and 0 off the mask.

Semantics follow verl's `core_algos` (GAE, GRPO, RLOO, REINFORCE++ and its group-baseline form),
with one deliberate difference: a sequence's score is the sum of its rewards over the response
mask only, so nothing under the mask (padding) reaches any result.
"""

from __future__ import annotations

import inspect
from typing import Callable, Sequence

import numpy as np
import torch

from baton.algorithms.utils import group_ids, masked, masked_whiten

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: dict[str, AdvantageFn] = {}
GroupIndex = Sequence | np.ndarray | torch.Tensor


def register_adv_estimator(name: str):
    """Decorator: make an advantage estimator available by name."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        if name in ADV_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADV_ESTIMATORS[name] = fn
        return fn

    return decorator


def get_adv_estimator(name: str) -> AdvantageFn:
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


def compute_advantages(estimator: str, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Run a registered estimator with the inputs its signature names, so a pipeline can pass
    everything it has (`token_level_rewards`, `response_mask`, `values`, `index`, `gamma`, ...)
    without branching on the estimator. Inputs the estimator does not take are ignored."""
    fn = get_adv_estimator(estimator)
    params = inspect.signature(fn).parameters
    missing = [n for n, p in params.items() if p.default is inspect.Parameter.empty and n not in inputs]
    if missing:
        raise ValueError(f"advantage estimator {estimator!r} needs {missing}; pass them to compute_advantages")
    return fn(**{n: v for n, v in inputs.items() if n in params})


def _sequence_scores(token_level_rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    return masked(token_level_rewards, response_mask).sum(-1)  # [batch]


def _group_stats(scores: torch.Tensor, index: GroupIndex) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row group mean, unbiased std and size, each [batch]. Singleton groups get mean 0 and std 1
    (verl), so their score passes through unchanged."""
    group, num_groups = group_ids(index, scores.shape[0])
    group = group.to(scores.device)
    size = torch.bincount(group, minlength=num_groups).to(scores.dtype)  # [groups]
    mean = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, group, scores) / size
    sq_dev = torch.zeros_like(mean).index_add_(0, group, (scores - mean[group]) ** 2)
    std = (sq_dev / (size - 1).clamp(min=1)).sqrt()
    singleton = size == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    return mean[group], std[group], size[group]


def _broadcast(seq_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[batch] → [batch, response_len], 0 off the mask."""
    return masked(seq_values.unsqueeze(-1).expand(response_mask.shape), response_mask)


@register_adv_estimator("gae")
@torch.no_grad()
def gae(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    values: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation, iterating backwards over the response.

    Positions off the mask are skipped: the next value and the running advantage carry across
    them undiscounted (verl), and the value after the last token is 0. returns = advantages +
    values, taken before the advantages are whitened (masked mean/std over the batch) when `whiten`.
    """
    rewards, values = masked(token_level_rewards, response_mask), masked(values, response_mask)
    valid = response_mask.bool()
    next_value = torch.zeros_like(values[:, 0])  # [batch]
    running = torch.zeros_like(values[:, 0])  # [batch]
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        running = torch.where(valid[:, t], delta + gamma * lam * running, running)
        advantages[:, t] = running
    advantages = masked(advantages, response_mask)
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@register_adv_estimator("grpo")
@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    index: GroupIndex,  # [batch] group ids, e.g. prompt uids
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(score - group mean) / (group std + epsilon), std unbiased; without the division when
    not `norm_adv_by_std` (Dr. GRPO). A group of one keeps its score. returns = advantages."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, std, _ = _group_stats(scores, index)
    seq_adv = (scores - mean) / (std + epsilon) if norm_adv_by_std else scores - mean
    advantages = _broadcast(seq_adv, response_mask)
    return advantages, advantages


@register_adv_estimator("rloo")
@torch.no_grad()
def rloo(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    index: GroupIndex,  # [batch]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score minus the mean of the other samples of its group, i.e. (score - group mean)·n/(n-1).
    A group of one keeps its score (verl). returns = advantages."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, size = _group_stats(scores, index)
    seq_adv = torch.where(size > 1, (scores - mean) * size / (size - 1).clamp(min=1), scores)
    advantages = _broadcast(seq_adv, response_mask)
    return advantages, advantages


@register_adv_estimator("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Discounted return-to-go per token (returns), whitened over the batch's valid tokens (advantages).
    Positions off the mask are skipped without discounting, as in `gae`."""
    rewards = masked(token_level_rewards, response_mask)
    valid = response_mask.bool()
    running = torch.zeros_like(rewards[:, 0])  # [batch]
    returns = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = running
    returns = masked(returns, response_mask)
    return masked_whiten(returns, response_mask), returns


@register_adv_estimator("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    index: GroupIndex,  # [batch]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score minus its group's mean (0 for a group of one), broadcast to the tokens, then whitened
    over the batch's valid tokens. returns = advantages."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, _ = _group_stats(scores, index)
    advantages = masked_whiten(_broadcast(scores - mean, response_mask), response_mask)
    return advantages, advantages
