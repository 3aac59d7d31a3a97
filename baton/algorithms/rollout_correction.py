"""Off-policy corrections for samples drawn by an older (or numerically different) rollout policy: per-token loss
weights from the proximal log-probs (the actor's, recomputed before the update) and the behaviour log-probs (the
rollout engine's). Name → `fn(old_log_probs, rollout_log_probs, response_mask, **settings) -> (weights, metrics)`.

`weights` [batch, response_len] carry no gradient and are 0 off the mask; a policy loss multiplies its per-token loss
by them before aggregation (`compute_policy_loss(..., token_weights=weights)`). Each correction registers the config
class of its settings (`CapConfig`, `MaskConfig`), whose fields it is called with. Truncation ("token_tis", "seq_tis")
caps a weight at `rollout_is_cap`; rejection ("token_mask", "seq_mask", "geo_mask") gives weight 0 to the tokens or
sequences whose ratio lies outside [rollout_mask_low, rollout_mask_high] and 1 to the rest; "decoupled" is AReaL's
decoupled PPO behaviour weight. A rejected token keeps its place in the loss's normaliser (its loss is 0): the
strategy counts the batch's units from `response_mask` before the loss runs, so the normaliser cannot shrink with
the rejections. verl drops rejected tokens from `response_mask` instead, which divides by the kept units only.

Metrics are (sum, count) pairs, so they add up over micro-batches and workers (see `baton.strategy.base.LossFn`):
`rollout_corr/is_weight/mean` over the weight's own unit (tokens; sequences for the sequence modes), and the share of
those units capped (`rollout_corr/clipped_frac`) or given weight 0 (`rollout_corr/masked_frac`). The token ratio's
range is `rollout/is_ratio/min` and `max` (the RLVR pipeline's `logprob_gap`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from baton.algorithms.aggregation import count_loss_units
from baton.algorithms.settings import NoSettings, as_kwargs
from baton.algorithms.utils import masked, masked_mean, masked_sum
from baton.config.registry import Registry

RolloutCorrectionFn = Callable[..., tuple[torch.Tensor, dict[str, tuple[float, float]]]]
_MAX_LOG_RATIO = 20.0  # exp(±20) stays finite in float32


@dataclass(frozen=True)
class RolloutCorrectionSpec:
    """A rollout correction: its function and the config class of its settings (a frozen dataclass whose fields `fn`
    takes as keyword arguments)."""

    fn: RolloutCorrectionFn
    config: type = NoSettings


ROLLOUT_CORRECTIONS: Registry[RolloutCorrectionSpec | RolloutCorrectionFn] = Registry("rollout correction")


def register_rollout_correction(name: str, config: type = NoSettings):
    """Decorator: make a rollout correction available by name, with the config class of its settings."""

    def decorator(fn: RolloutCorrectionFn) -> RolloutCorrectionFn:
        ROLLOUT_CORRECTIONS[name] = RolloutCorrectionSpec(fn, config)
        return fn

    return decorator


def rollout_correction_spec(name: str) -> RolloutCorrectionSpec:
    """The spec of correction `name`: a registered name, or an import path to a `RolloutCorrectionSpec`, to a
    registered function (its registration's spec) or to a plain function (no settings)."""
    obj = ROLLOUT_CORRECTIONS.get(name)
    if isinstance(obj, RolloutCorrectionSpec):
        return obj
    registered = (ROLLOUT_CORRECTIONS.get(n) for n in ROLLOUT_CORRECTIONS)
    return next((s for s in registered if isinstance(s, RolloutCorrectionSpec) and s.fn is obj),
                RolloutCorrectionSpec(obj))


def get_rollout_correction(name: str) -> RolloutCorrectionFn:
    """A registered rollout correction's function, or one given by import path "package.module:function"."""
    return rollout_correction_spec(name).fn


def compute_rollout_correction(
    name: str,
    old_log_probs: torch.Tensor,  # [batch, response_len], proximal policy: the actor's before the update
    rollout_log_probs: torch.Tensor,  # [batch, response_len], behaviour policy: the rollout engine's
    response_mask: torch.Tensor,  # [batch, response_len]
    settings: Any = None,
) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Run correction `name` with `settings`, an instance of its config class (None: that class's defaults), whose
    fields are its keyword arguments; the weights are detached."""
    spec = rollout_correction_spec(name)
    settings = spec.config() if settings is None else settings
    if type(settings) is not spec.config:
        raise TypeError(f"rollout correction {name!r} takes settings of type {spec.config.__name__}, "
                        f"not {type(settings).__name__}")
    with torch.no_grad():
        weights, metrics = spec.fn(old_log_probs.detach(), rollout_log_probs.detach(), response_mask,
                                   **as_kwargs(settings))
    return weights.detach(), metrics


# ---- the built-in corrections' settings (baton's names) -------------------------------------------------------


@dataclass(frozen=True)
class CapConfig:
    """The weight cap `rollout_is_cap` of truncation (token_tis, seq_tis) or of AReaL's drop (decoupled); None: no
    cap."""

    rollout_is_cap: float | None = 2.0

    def __post_init__(self):
        if self.rollout_is_cap is not None and self.rollout_is_cap < 1.0:
            raise ValueError(f"rollout_is_cap={self.rollout_is_cap} is below 1, so even on-policy tokens (weight 1) "
                             "would be capped or dropped; use 2.0 (verl) to 10.0, or null for no cap")


@dataclass(frozen=True)
class MaskConfig:
    """Rejection's bounds: a ratio outside [rollout_mask_low, rollout_mask_high] gets weight 0 (token_mask, seq_mask,
    geo_mask)."""

    rollout_mask_low: float = 0.5
    rollout_mask_high: float = 2.0

    def __post_init__(self):
        low, high = self.rollout_mask_low, self.rollout_mask_high
        if not 0.0 <= low <= 1.0 <= high or low == high:
            raise ValueError(f"rollout_mask_low={low} and rollout_mask_high={high} must satisfy 0 <= low <= 1 <= "
                             "high, low < high, so that on-policy samples (ratio 1) are kept; e.g. 0.5 and 2.0")


def _token_log_ratio(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                     response_mask: torch.Tensor) -> torch.Tensor:
    """log(proximal / behaviour) per token, 0 off the mask."""
    return masked(old_log_probs - rollout_log_probs, response_mask)


def _seq_ratio(log_ratio: torch.Tensor, response_mask: torch.Tensor, geometric: bool) -> torch.Tensor:
    """[batch]: exp of the sequence's summed (or, `geometric`, mean) token log ratio, clamped to ±20 first."""
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1) if geometric else masked_sum(log_ratio, response_mask,
                                                                                               dim=-1)
    return seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()


def _token_metrics(weights: torch.Tensor, flagged: torch.Tensor, response_mask: torch.Tensor,
                   flag_name: str) -> dict[str, tuple[float, float]]:
    """Mean weight and share of `flagged` tokens, over the valid tokens."""
    tokens = float(response_mask.bool().sum())
    return {"rollout_corr/is_weight/mean": (float(masked_sum(weights, response_mask)), tokens),
            f"rollout_corr/{flag_name}": (float(masked_sum(flagged.float(), response_mask)), tokens)}


def _seq_metrics(seq_weights: torch.Tensor, flagged: torch.Tensor, response_mask: torch.Tensor,
                 flag_name: str) -> dict[str, tuple[float, float]]:
    """Mean weight and share of `flagged` sequences, over the rows with a valid token."""
    real = response_mask.bool().any(-1)  # [batch]
    sequences = float(count_loss_units(response_mask, "sequence"))
    return {"rollout_corr/is_weight/mean": (float(seq_weights[real].sum()), sequences),
            f"rollout_corr/{flag_name}": (float(flagged[real].float().sum()), sequences)}


def _per_token(seq_values: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """[batch] → [batch, response_len], 0 off the mask."""
    return masked(seq_values.unsqueeze(-1).expand(response_mask.shape), response_mask)


@register_rollout_correction("none")
def no_correction(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor
                  ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Weight 1 on every token: the loss trusts the proximal log-probs as the sampling policy's. No metrics."""
    return response_mask.bool().to(old_log_probs.dtype), {}


@register_rollout_correction("token_tis", CapConfig)
def token_tis(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
              rollout_is_cap: float | None = 2.0) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Truncated importance sampling per token (verl rollout_is "token"): w_t = min(exp(old_t - rollout_t), cap);
    None: no cap. `clipped_frac`: the share of tokens whose ratio exceeds the cap."""
    ratio = masked(_token_log_ratio(old_log_probs, rollout_log_probs, response_mask)
                   .clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp(), response_mask)
    weights = ratio if rollout_is_cap is None else ratio.clamp(max=rollout_is_cap)
    return weights, _token_metrics(weights, ratio != weights, response_mask, "clipped_frac")


@register_rollout_correction("seq_tis", CapConfig)
def seq_tis(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
            rollout_is_cap: float | None = 2.0) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Truncated importance sampling per sequence (verl rollout_is "sequence"): one weight per sequence,
    w = min(exp(sum_t (old_t - rollout_t)), cap), on each of its tokens; None: no cap. `clipped_frac`: the share of
    sequences whose ratio exceeds the cap."""
    log_ratio = _token_log_ratio(old_log_probs, rollout_log_probs, response_mask)
    ratio = _seq_ratio(log_ratio, response_mask, geometric=False)  # [batch]
    seq_weights = ratio if rollout_is_cap is None else ratio.clamp(max=rollout_is_cap)
    return _per_token(seq_weights, response_mask), _seq_metrics(seq_weights, ratio != seq_weights, response_mask,
                                                                "clipped_frac")


def _outside(ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return (ratio < low) | (ratio > high)


@register_rollout_correction("token_mask", MaskConfig)
def token_mask(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
               rollout_mask_low: float = 0.5, rollout_mask_high: float = 2.0
               ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Rejection per token (verl rollout_rs "token"): weight 0 on the tokens whose ratio exp(old_t - rollout_t) lies
    outside [low, high], 1 on the rest. `masked_frac`: the share of tokens rejected."""
    ratio = _token_log_ratio(old_log_probs, rollout_log_probs, response_mask).clamp(
        -_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    rejected = _outside(ratio, rollout_mask_low, rollout_mask_high) & response_mask.bool()
    weights = masked((~rejected).to(old_log_probs.dtype), response_mask)
    return weights, _token_metrics(weights, rejected, response_mask, "masked_frac")


def _seq_mask(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor, low: float,
              high: float, geometric: bool) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    ratio = _seq_ratio(_token_log_ratio(old_log_probs, rollout_log_probs, response_mask), response_mask, geometric)
    rejected = _outside(ratio, low, high)  # [batch]
    seq_weights = (~rejected).to(old_log_probs.dtype)
    return _per_token(seq_weights, response_mask), _seq_metrics(seq_weights, rejected, response_mask, "masked_frac")


@register_rollout_correction("seq_mask", MaskConfig)
def seq_mask(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
             rollout_mask_low: float = 0.5, rollout_mask_high: float = 2.0
             ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Rejection per sequence (verl rollout_rs "sequence"): weight 0 on every token of a sequence whose ratio
    exp(sum_t (old_t - rollout_t)) lies outside [low, high]. `masked_frac`: the share of sequences rejected."""
    return _seq_mask(old_log_probs, rollout_log_probs, response_mask, rollout_mask_low, rollout_mask_high,
                     geometric=False)


@register_rollout_correction("geo_mask", MaskConfig)
def geo_mask(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
             rollout_mask_low: float = 0.5, rollout_mask_high: float = 2.0
             ) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Rejection per sequence by the geometric mean of its token ratios (verl rollout_rs "geometric"):
    exp(mean_t (old_t - rollout_t)) outside [low, high] gives the whole sequence weight 0. Unlike "seq_mask" the
    bound does not tighten with the response length. `masked_frac`: the share of sequences rejected."""
    return _seq_mask(old_log_probs, rollout_log_probs, response_mask, rollout_mask_low, rollout_mask_high,
                     geometric=True)


@register_rollout_correction("decoupled", CapConfig)
def decoupled(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, response_mask: torch.Tensor,
              rollout_is_cap: float | None = None) -> tuple[torch.Tensor, dict[str, tuple[float, float]]]:
    """Decoupled PPO's behaviour weight (AReaL, arXiv 2505.24298): w_t = exp(old_t - rollout_t), the proximal over the
    behaviour policy, so that with policy_loss "vanilla" the loss is w_t times PPO's clipped surrogate of
    exp(log_probs - old_log_probs). As AReaL's `behav_imp_weight_cap`, a token whose weight exceeds `rollout_is_cap`
    gets weight 0 (it is not truncated); None: no cap. `masked_frac`: the share of tokens dropped so."""
    ratio = masked(_token_log_ratio(old_log_probs, rollout_log_probs, response_mask)
                   .clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp(), response_mask)
    dropped = ratio > (float("inf") if rollout_is_cap is None else rollout_is_cap)
    weights = torch.where(dropped, torch.zeros_like(ratio), ratio)
    return weights, _token_metrics(weights, dropped, response_mask, "masked_frac")
