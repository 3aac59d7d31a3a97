"""Advantage estimators: name → `fn(...) -> (advantages, returns)`, both [batch, response_len] and 0 off the mask.

Each estimator declares what the pipeline must provide (`estimator_needs(name)`): a critic's
values, groups of samples per prompt, or the reward of a baseline (greedy) rollout.

Semantics follow verl's `core_algos` (GAE, GRPO, GRPO pass@k, GDPO, RLOO, OPO, GPG, ReMax,
REINFORCE++ and its group-baseline form),
with one deliberate difference: a sequence's score is the sum of its rewards over the response
mask only, so nothing under the mask (padding) reaches any result.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from baton.algorithms.utils import group_ids, masked, masked_whiten
from baton.config.registry import Registry

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
GroupIndex = Sequence | np.ndarray | torch.Tensor


@dataclass(frozen=True)
class EstimatorNeeds:
    """What an advantage estimator needs from the pipeline beyond rewards and the response mask."""

    critic: bool = False  # `values` from a critic model
    groups: bool = False  # `index`, with several samples per prompt (rollout n >= 2) to be useful
    baseline_rollout: bool = False  # `reward_baselines` [batch]: the reward of a greedy rollout per prompt
    reward_components: bool = False  # `reward_components` [batch, k]: the reward function's fields (gdpo_reward_keys)


@dataclass(frozen=True)
class AdvantageConfig:
    """The advantage estimators' settings, by verl's names (the `algorithm.*` keys of the same names): the discount
    `gamma` and GAE's `lam` (gae, reinforce_plus_plus), `norm_adv_by_std` (the group estimators divide by the group's
    std; false is Dr.GRPO), and, for an estimator that takes reward components (gdpo), the reward function's dict
    fields that are its components (`gdpo_reward_keys`; None: the reward is the one component) and their weights
    (`gdpo_reward_weights`; None: 1 each)."""

    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    gdpo_reward_keys: list[str] | None = None
    gdpo_reward_weights: list[float] | None = None

    def __post_init__(self):
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must lie in [0, 1]; the usual value is 1.0")
        keys, weights = self.gdpo_reward_keys, self.gdpo_reward_weights
        if weights is not None and keys is None:
            raise ValueError("gdpo_reward_weights weighs the reward components named by gdpo_reward_keys, which is "
                             "unset; set it too, or unset the weights")
        if keys is not None and not keys:
            raise ValueError("gdpo_reward_keys is empty; list the reward function's fields that are the reward "
                             "components, or unset it")
        if keys is not None and weights is not None and len(weights) != len(keys):
            raise ValueError(f"gdpo_reward_weights has {len(weights)} entries for the {len(keys)} gdpo_reward_keys "
                             f"{keys}; give one weight per key")


ADV_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator")
_NEEDS: dict[AdvantageFn, EstimatorNeeds] = {}  # by function: an estimator named by its import path finds its own


def register_adv_estimator(name: str, needs: EstimatorNeeds = EstimatorNeeds()):
    """Decorator: make an advantage estimator available by name, with what it needs. A config may then name it, or
    give its import path ("package.module:function"): either way `estimator_needs` finds the needs declared here."""

    def decorator(fn: AdvantageFn) -> AdvantageFn:
        ADV_ESTIMATORS[name] = fn
        _NEEDS[fn] = needs
        return fn

    return decorator


def estimator_needs(name: str) -> EstimatorNeeds:
    """What estimator `name` (a registered name or an import path) needs: as registered; none for a function that was
    never registered."""
    return _NEEDS.get(get_adv_estimator(name), EstimatorNeeds())


def get_adv_estimator(name: str) -> AdvantageFn:
    return ADV_ESTIMATORS.get(name)


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


@register_adv_estimator("gae", EstimatorNeeds(critic=True))
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


@register_adv_estimator("grpo", EstimatorNeeds(groups=True))
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
    seq_adv = _group_normalised(_sequence_scores(token_level_rewards, response_mask), index, norm_adv_by_std, epsilon)
    advantages = _broadcast(seq_adv, response_mask)
    return advantages, advantages


def _group_normalised(scores: torch.Tensor, index: GroupIndex, norm_adv_by_std: bool, epsilon: float) -> torch.Tensor:
    """GRPO's per-sequence advantage [batch]: (score - group mean), over (group std + epsilon) if asked."""
    mean, std, _ = _group_stats(scores, index)
    return (scores - mean) / (std + epsilon) if norm_adv_by_std else scores - mean


@register_adv_estimator("rloo", EstimatorNeeds(groups=True))
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


@register_adv_estimator("reinforce_plus_plus_baseline", EstimatorNeeds(groups=True))
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


@register_adv_estimator("grpo_passk", EstimatorNeeds(groups=True))
@torch.no_grad()
def grpo_passk(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    index: GroupIndex,  # [batch]
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO (arXiv 2503.19595, verl): in each group only the best sample gets an advantage,
    best score - second-best score, divided by (group std + epsilon) when `norm_adv_by_std`; all
    others get 0. Among tied best scores the first in batch order is the best (verl leaves the
    choice to `torch.topk`); the advantage is then 0 anyway. Every group needs >= 2 samples.
    returns = advantages."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    group, num_groups = group_ids(index, scores.shape[0])
    seq_adv = torch.zeros_like(scores)
    for g in range(num_groups):
        rows = (group == g).nonzero().squeeze(-1).to(scores.device)
        if rows.numel() < 2:
            raise ValueError(
                f"grpo_passk needs at least 2 samples per prompt, group {g} has {rows.numel()}; set rollout n >= 2"
            )
        group_scores = scores[rows]
        best = int(group_scores.argmax())
        second = group_scores[torch.arange(rows.numel(), device=scores.device) != best].max()
        advantage = group_scores[best] - second
        seq_adv[rows[best]] = advantage / (group_scores.std() + epsilon) if norm_adv_by_std else advantage
    advantages = _broadcast(seq_adv, response_mask)
    return advantages, advantages


@register_adv_estimator("opo", EstimatorNeeds(groups=True))
@torch.no_grad()
def opo(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    index: GroupIndex,  # [batch]
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy RL with the optimal baseline (arXiv 2505.23585, verl): score minus its group's
    length-weighted mean score, Σ len_j·score_j / Σ len_j with len = valid response tokens. A group
    of one (or of empty responses only) has baseline 0. returns = advantages."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    lengths = response_mask.bool().to(scores.dtype).sum(-1)  # [batch]
    group, num_groups = group_ids(index, scores.shape[0])
    group = group.to(scores.device)
    size = torch.bincount(group, minlength=num_groups)
    weighted = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(0, group, lengths * scores)
    total_len = torch.zeros_like(weighted).index_add_(0, group, lengths)
    baseline = torch.where((size > 1) & (total_len > 0), weighted / total_len.clamp(min=1), torch.zeros_like(weighted))
    advantages = _broadcast(scores - baseline[group], response_mask)
    return advantages, advantages


@register_adv_estimator("gpg", EstimatorNeeds(groups=True))
@torch.no_grad()
def gpg(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    index: GroupIndex,  # [batch]
    f_norm: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient (arXiv 2504.02546, verl): α·(score - group mean) / f_norm, where
    α = batch size / number of samples with a non-zero score (1 of them at least), which scales up
    batches where few samples are rewarded. A group of one has mean 0. returns = advantages."""
    scores = _sequence_scores(token_level_rewards, response_mask)
    mean, _, _ = _group_stats(scores, index)
    alpha = scores.shape[0] / max(int(torch.count_nonzero(scores)), 1)
    advantages = _broadcast(alpha * (scores - mean) / f_norm, response_mask)
    return advantages, advantages


@register_adv_estimator("remax", EstimatorNeeds(baseline_rollout=True))
@torch.no_grad()
def remax(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    reward_baselines: torch.Tensor,  # [batch], the reward of the greedy response to the same prompt
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (arXiv 2310.10505, verl): returns are the undiscounted reward-to-go over the valid
    tokens; advantages are returns minus the row's baseline reward."""
    if reward_baselines.shape != token_level_rewards.shape[:1]:
        raise ValueError(
            f"reward_baselines has shape {tuple(reward_baselines.shape)}, expected [{token_level_rewards.shape[0]}]: "
            "one greedy-rollout reward per row"
        )
    rewards = masked(token_level_rewards, response_mask)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    returns = masked(returns, response_mask)
    advantages = _broadcast(reward_baselines.to(returns.dtype), response_mask)
    return masked(returns - advantages, response_mask), returns


@register_adv_estimator("gdpo", EstimatorNeeds(groups=True, reward_components=True))
@torch.no_grad()
def gdpo(
    token_level_rewards: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    index: GroupIndex,  # [batch]
    reward_components: torch.Tensor | None = None,  # [batch, num_components], one score per reward term
    reward_weights: Sequence[float] | None = None,  # [num_components], default all 1
    norm_adv_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO (arXiv 2601.05242, verl's "gdpo"): each reward component is normalised within its group
    as GRPO does, the results are summed with `reward_weights`, broadcast to the tokens and
    whitened over the batch's valid tokens. Without `reward_components` the one component is the
    sequence score (GRPO followed by whitening). As in verl, the RLVR pipeline takes the components
    from the fields of a dict reward named by `algorithm.gdpo_reward_keys`.
    returns = advantages."""
    if reward_components is None:
        reward_components = _sequence_scores(token_level_rewards, response_mask).unsqueeze(-1)
    if reward_components.dim() != 2 or reward_components.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"reward_components has shape {tuple(reward_components.shape)}, expected [{response_mask.shape[0]}, "
            "num_components]: one score per row and reward component"
        )
    num_components = reward_components.shape[1]
    weights = [1.0] * num_components if reward_weights is None else list(reward_weights)
    if len(weights) != num_components:
        raise ValueError(f"reward_weights has {len(weights)} entries for {num_components} reward components")
    components = reward_components.to(response_mask.device, torch.float32)
    seq_adv = sum(w * _group_normalised(components[:, k], index, norm_adv_by_std, epsilon)
                  for k, w in enumerate(weights))
    advantages = masked_whiten(_broadcast(seq_adv, response_mask), response_mask)
    return advantages, advantages
