"""Policy losses, each registered with the typed config of its settings, the clipped value loss and the entropy term.

A policy loss is `fn(log_probs, old_log_probs, advantages, response_mask, *, loss_agg_mode, loss_scale_factor,
[token_weights], **settings) -> (loss, metrics)`, where `settings` are the fields of the config class it registered
(`register_policy_loss(name, config=...)`): `compute_policy_loss` calls it with exactly those. Each returns
`agg_loss` of its per-token loss; inside a strategy loss function that wants the sum form, multiply by
`num_loss_units(response_mask, loss_agg_mode)` (see `aggregation`). Metrics are Python floats computed over the valid
tokens. Names follow verl's `policy_loss.loss_mode`: "vanilla" (PPO clip), "gspo", "cispo", "gpg", "clip_cov",
"kl_cov". Every loss honours the `loss_agg_mode` it is given, so the strategy's normaliser (`loss_unit(loss_agg_mode)`)
always matches, and `token_weights` [batch, response_len] (no gradient; e.g. `rollout_correction`'s importance
weights), which multiply its per-token loss before aggregation without changing the normaliser; a loss registered
with `token_weights=False` is never given them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from baton.algorithms.aggregation import agg_loss
from baton.algorithms.settings import NoSettings, as_kwargs
from baton.algorithms.utils import masked, masked_mean
from baton.config.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class PolicyLossSpec:
    """A policy loss: its function, the config class of its settings (a frozen dataclass whose fields `fn` takes as
    keyword arguments), and whether it takes `token_weights` (so a rollout correction can weigh it)."""

    fn: PolicyLossFn
    config: type = NoSettings
    token_weights: bool = True


POLICY_LOSSES: Registry[PolicyLossSpec | PolicyLossFn] = Registry("policy loss")


def register_policy_loss(name: str, config: type = NoSettings, token_weights: bool = True):
    """Decorator: make a policy loss available by name, with the config class of its settings and whether it takes
    `token_weights`. A config may then name it, or give its import path: either way `policy_loss_spec` finds what
    was declared here."""

    def decorator(fn: PolicyLossFn) -> PolicyLossFn:
        POLICY_LOSSES[name] = PolicyLossSpec(fn, config, token_weights)
        return fn

    return decorator


def policy_loss_spec(name: str) -> PolicyLossSpec:
    """The spec of policy loss `name`: a registered name, or an import path to a `PolicyLossSpec` (a user's loss with
    its own config class), to a registered function (its registration's spec) or to a plain function (no settings,
    takes token_weights)."""
    obj = POLICY_LOSSES.get(name)
    if isinstance(obj, PolicyLossSpec):
        return obj
    registered = (POLICY_LOSSES.get(n) for n in POLICY_LOSSES)
    return next((s for s in registered if isinstance(s, PolicyLossSpec) and s.fn is obj), PolicyLossSpec(obj))


def get_policy_loss(name: str) -> PolicyLossFn:
    """A registered policy loss's function, or one given by import path "package.module:function"."""
    return policy_loss_spec(name).fn


def compute_policy_loss(
    name: str,
    log_probs: torch.Tensor,  # [batch, response_len], current policy, carries the gradient
    old_log_probs: torch.Tensor,  # [batch, response_len]
    advantages: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    token_weights: torch.Tensor | None = None,  # [batch, response_len], no gradient; None: weight 1
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    settings: Any = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run policy loss `name` with `settings`, an instance of its config class (None: that class's defaults), whose
    fields are its keyword arguments. `token_weights` multiply the per-token loss; a loss registered without them
    refuses them."""
    spec = policy_loss_spec(name)
    settings = spec.config() if settings is None else settings
    if type(settings) is not spec.config:
        raise TypeError(f"policy loss {name!r} takes settings of type {spec.config.__name__}, "
                        f"not {type(settings).__name__}")
    kwargs = as_kwargs(settings)
    if token_weights is not None:
        if not spec.token_weights:
            raise ValueError(f"policy loss {name!r} takes no token_weights, so it cannot apply a rollout correction; "
                             "add a `token_weights` parameter that multiplies its per-token loss and register it with "
                             "token_weights=True")
        kwargs["token_weights"] = token_weights
    return spec.fn(log_probs, old_log_probs, advantages, response_mask, loss_agg_mode=loss_agg_mode,
                   loss_scale_factor=loss_scale_factor, **kwargs)


# ---- the built-in losses' settings (verl's names) ------------------------------------------------------------


@dataclass(frozen=True)
class ClipConfig:
    """PPO's ratio clip range [1 - clip_ratio_low, 1 + clip_ratio_high] (gspo, cispo); a larger high than low is
    DAPO's clip-higher."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    def __post_init__(self):
        if self.clip_ratio_low < 0 or self.clip_ratio_high < 0:
            raise ValueError(f"clip_ratio_low={self.clip_ratio_low} and clip_ratio_high={self.clip_ratio_high} must "
                             "be >= 0; the usual values are 0.2 and 0.2 (0.28 for DAPO's clip-higher)")


@dataclass(frozen=True)
class DualClipConfig(ClipConfig):
    """PPO's clip range and the dual clip's bound `clip_ratio_c` on negative advantages ("vanilla")."""

    clip_ratio_c: float = 3.0

    def __post_init__(self):
        super().__post_init__()
        if self.clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO (got {self.clip_ratio_c}); the usual "
                             "value is 3.0")


@dataclass(frozen=True)
class ClipCovConfig(ClipConfig):
    """Clip-Cov's clip range, and the share `clip_cov_ratio` of tokens detached among those whose covariance lies in
    (clip_cov_lb, clip_cov_ub)."""

    clip_cov_ratio: float = 2e-4
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0

    def __post_init__(self):
        super().__post_init__()
        if self.clip_cov_ratio <= 0:
            raise ValueError(f"clip_cov_ratio must be > 0 (got {self.clip_cov_ratio}); the usual value is 2e-4")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub={self.clip_cov_ub}; the usual "
                             "values are 1.0 and 5.0")


@dataclass(frozen=True)
class KLCovConfig:
    """KL-Cov's share `kl_cov_ratio` of tokens penalised (those of largest covariance) and the penalty's coefficient
    `ppo_kl_coef`."""

    kl_cov_ratio: float = 2e-4
    ppo_kl_coef: float = 1.0

    def __post_init__(self):
        if self.kl_cov_ratio <= 0:
            raise ValueError(f"kl_cov_ratio must be > 0 (got {self.kl_cov_ratio}); the usual value is 2e-4")


def _masked_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                      response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_probs, advantages, log ratio), each 0 off the mask; the log ratio clamped to ±20, which keeps exp finite."""
    log_probs, old_log_probs = masked(log_probs, response_mask), masked(old_log_probs, response_mask)
    return log_probs, masked(advantages, response_mask), (log_probs - old_log_probs).clamp(min=-20.0, max=20.0)


def _weighted(pg_losses: torch.Tensor, token_weights: torch.Tensor | None) -> torch.Tensor:
    """The per-token loss times `token_weights` (detached here, so they scale the gradient and never receive one)."""
    return pg_losses if token_weights is None else pg_losses * token_weights.detach()


def _clipped_surrogate(advantages: torch.Tensor, ratio: torch.Tensor, clip_ratio_low: float,
                       clip_ratio_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's two surrogate terms per token: -A·r and -A·clip(r, 1 - low, 1 + high)."""
    return -advantages * ratio, -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)


@register_policy_loss("vanilla", DualClipConfig)
def ppo_clip_loss(
    log_probs: torch.Tensor,  # [batch, response_len], current policy, carries the gradient
    old_log_probs: torch.Tensor,  # [batch, response_len], policy that sampled the data
    advantages: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with dual clip (verl's "vanilla"), r = exp(log_probs - old_log_probs):

        loss = max(-A·r, -A·clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))   when A >= 0
        loss = min(that, -A·clip_ratio_c)                                        when A < 0

    A larger `clip_ratio_high` than `clip_ratio_low` is DAPO's clip-higher. Metrics: `pg_clipfrac`
    (share of tokens where the ratio clip binds), `ppo_kl` (mean of old - new log-prob) and
    `pg_clipfrac_lower` (share where the dual clip binds).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1.0 for dual-clip PPO (got {clip_ratio_c}); the usual value is 3.0")
    log_probs, advantages, log_ratio = _masked_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    ratio = log_ratio.exp()
    losses, losses_clipped = _clipped_surrogate(advantages, ratio, clip_ratio_low, clip_ratio_high)
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
    return agg_loss(_weighted(pg_losses, token_weights), response_mask, loss_agg_mode, loss_scale_factor), metrics


@register_policy_loss("gspo", ClipConfig)
def gspo_loss(
    log_probs: torch.Tensor,  # [batch, response_len], current policy, carries the gradient
    old_log_probs: torch.Tensor,  # [batch, response_len]
    advantages: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (arXiv 2507.18071): PPO's clipped surrogate on the sequence-level ratio
    s = exp(mean over the valid tokens of (log_probs - old_log_probs)). Per token the ratio is
    sg(s)·π/sg(π), so its value is s and its gradient flows through each token's log-prob; the log
    ratio is capped at 10 and there is no dual clip, as in verl. This function's defaults are the paper's
    clip ranges; a configured run takes `ClipConfig`'s 0.2 and 0.2 unless set (verl takes them from the actor's
    clip_ratio settings, whose defaults those are; `examples/gspo.yaml` sets the paper's).

    Differs from verl: verl always aggregates with "seq-mean-token-mean" whatever `loss_agg_mode`
    says; here the given mode is used so that it matches the strategy's normaliser. Configure
    "seq-mean-token-mean" for verl's GSPO. The token log ratios are clamped to ±20 before the mean.
    Metrics: `pg_clipfrac`, `ppo_kl`, `pg_clipfrac_lower` (0).
    """
    log_probs, advantages, log_ratio = _masked_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # [batch]
    token_log_ratio = (log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=10.0)
    ratio = token_log_ratio.exp()
    losses, losses_clipped = _clipped_surrogate(advantages, ratio, clip_ratio_low, clip_ratio_high)
    pg_losses = torch.maximum(losses, losses_clipped)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": float(masked_mean((losses_clipped > losses).float(), response_mask)),
            "ppo_kl": float(masked_mean(-log_ratio, response_mask)),
            "pg_clipfrac_lower": 0.0,
        }
    return agg_loss(_weighted(pg_losses, token_weights), response_mask, loss_agg_mode, loss_scale_factor), metrics


@register_policy_loss("cispo", ClipConfig)
def cispo_loss(
    log_probs: torch.Tensor,  # [batch, response_len], current policy, carries the gradient
    old_log_probs: torch.Tensor,  # [batch, response_len]
    advantages: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585), as verl: loss = -sg(clip(r, 1 - low, 1 + high))·A·log π,
    so every token keeps a gradient (through log π) and the clipped importance weight only scales
    it. Metrics: `pg_clipfrac` (share of tokens whose weight is clipped), `ppo_kl`, `pg_clipfrac_lower` (0).
    """
    log_probs, advantages, log_ratio = _masked_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    ratio = log_ratio.exp()
    weight = ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg_losses = -weight * advantages * log_probs
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": float(masked_mean((ratio != weight).float(), response_mask)),
            "ppo_kl": float(masked_mean(-log_ratio, response_mask)),
            "pg_clipfrac_lower": 0.0,
        }
    return agg_loss(_weighted(pg_losses, token_weights), response_mask, loss_agg_mode, loss_scale_factor), metrics


@register_policy_loss("gpg")
def gpg_loss(
    log_probs: torch.Tensor,  # [batch, response_len], current policy, carries the gradient
    old_log_probs: torch.Tensor,  # [batch, response_len], unused: GPG has no importance ratio
    advantages: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GPG (arXiv 2504.02546), as verl: the plain policy gradient loss -A·log π, no ratio, no clip
    (pair it with the "gpg" advantage estimator). No metrics."""
    pg_losses = -masked(advantages, response_mask) * masked(log_probs, response_mask)
    return agg_loss(_weighted(pg_losses, token_weights), response_mask, loss_agg_mode, loss_scale_factor), {}


def _token_covariance(advantages: torch.Tensor, log_probs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(A - mean A)·(log π - mean log π) per token, means over the batch's valid tokens; no gradient."""
    log_probs = log_probs.detach()
    return (advantages - masked_mean(advantages, response_mask)) * (log_probs - masked_mean(log_probs, response_mask))


@register_policy_loss("clip_cov", ClipCovConfig)
def clip_cov_loss(
    log_probs: torch.Tensor,  # [batch, response_len], current policy, carries the gradient
    old_log_probs: torch.Tensor,  # [batch, response_len]
    advantages: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (arXiv 2505.22617, verl): PPO's clipped surrogate (no dual clip), except that up to
    max(1, int(clip_cov_ratio · valid tokens)) tokens, drawn at random among the valid tokens the
    ratio clip does not bind on and whose covariance (A - mean A)·(log π - mean log π) lies strictly
    inside (clip_cov_lb, clip_cov_ub), get no gradient (their loss is multiplied by 0).
    `generator` seeds the draw (verl uses the global RNG). Differs from verl: the log ratio is
    clamped to ±20 before exp, as in `ppo_clip_loss`. Metrics: `pg_clipfrac` (share of tokens
    detached this way), `ppo_kl`.
    """
    if clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0 (got {clip_cov_ratio}); the usual value is 2e-4")
    log_probs, advantages, log_ratio = _masked_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    ratio = log_ratio.exp()
    losses, losses_clipped = _clipped_surrogate(advantages, ratio, clip_ratio_low, clip_ratio_high)
    with torch.no_grad():
        valid = response_mask.bool()
        cov = _token_covariance(advantages, log_probs, response_mask)
        candidates = (valid & ~(losses_clipped > losses) & (cov > clip_cov_lb) & (cov < clip_cov_ub)).nonzero()
        num_detached = max(int(clip_cov_ratio * int(valid.sum())), 1)
        chosen = candidates[torch.randperm(len(candidates), generator=generator)[:num_detached].to(candidates.device)]
        keep = torch.ones_like(advantages)
        keep[chosen[:, 0], chosen[:, 1]] = 0.0
        metrics = {
            "pg_clipfrac": float(masked_mean((keep == 0).float(), response_mask)),
            "ppo_kl": float(masked_mean(-log_ratio, response_mask)),
        }
    pg_losses = torch.maximum(losses, losses_clipped) * keep
    return agg_loss(_weighted(pg_losses, token_weights), response_mask, loss_agg_mode, loss_scale_factor), metrics


@register_policy_loss("kl_cov", KLCovConfig)
def kl_cov_loss(
    log_probs: torch.Tensor,  # [batch, response_len], current policy, carries the gradient
    old_log_probs: torch.Tensor,  # [batch, response_len]
    advantages: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    kl_cov_ratio: float = 2e-4,
    ppo_kl_coef: float = 1.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (arXiv 2505.22617, verl): the unclipped surrogate -A·r, plus ppo_kl_coef·|log π - log π_old|
    on the max(1, int(kl_cov_ratio · valid tokens)) valid tokens of largest covariance
    (A - mean A)·(log π - mean log π). Differs from verl: the log ratio is clamped to ±20 before
    exp. Metric: `ppo_kl`, the mean |log π - log π_old| (as verl).
    """
    if kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0 (got {kl_cov_ratio}); the usual value is 2e-4")
    log_probs, advantages, log_ratio = _masked_log_ratio(log_probs, old_log_probs, advantages, response_mask)
    pg_losses = -advantages * log_ratio.exp()
    with torch.no_grad():
        valid = response_mask.bool()
        num_valid = int(valid.sum())
        penalised = torch.zeros_like(valid)
        if num_valid > 0:
            cov = _token_covariance(advantages, log_probs, response_mask).masked_fill(~valid, -float("inf"))
            top = cov.flatten().topk(max(int(num_valid * kl_cov_ratio), 1)).indices
            penalised.view(-1)[top] = True
        metrics = {"ppo_kl": float(masked_mean(log_ratio.abs(), response_mask))}
    pg_losses = torch.where(penalised, pg_losses + ppo_kl_coef * log_ratio.abs(), pg_losses)
    return agg_loss(_weighted(pg_losses, token_weights), response_mask, loss_agg_mode, loss_scale_factor), metrics


def value_loss(
    values: torch.Tensor,  # [batch, response_len], current critic, carries the gradient
    old_values: torch.Tensor,  # [batch, response_len], critic that produced the returns' baseline
    returns: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 · agg(max((v - R)², (clip(v, old - ε, old + ε) - R)²)) (verl); metric `vf_clipfrac`,
    the share of tokens where the clipped term is the larger."""
    values, old_values = masked(values, response_mask), masked(old_values, response_mask)
    returns = masked(returns, response_mask)
    clipped = torch.maximum(torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value)
    losses = (values - returns) ** 2
    losses_clipped = (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(losses, losses_clipped), response_mask, loss_agg_mode, loss_scale_factor)
    with torch.no_grad():
        metrics = {"vf_clipfrac": float(masked_mean((losses_clipped > losses).float(), response_mask))}
    return loss, metrics


def entropy_loss(
    entropy: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregated token entropy → scalar (positive). As a bonus it is
    subtracted: `loss = pg_loss - entropy_coeff * entropy_loss(entropy, mask, mode)`."""
    return agg_loss(masked(entropy, response_mask), response_mask, loss_agg_mode, loss_scale_factor)
