"""Loss aggregation: a [batch, response_len] loss matrix to a scalar, as a mean or as a sum plus its unit.

Distributed training normalises by a global count, not a per-worker one: a strategy's loss
function returns `agg_loss_sum(...)[0]` and the strategy divides by the number of `loss_unit(mode)`
units in the whole step (all workers, all micro-batches), counted with `count_loss_units`. With one
worker and no micro-batching that equals `agg_loss`:
`agg_loss(m, mask, mode) == agg_loss_sum(m, mask, mode)[0] / num_loss_units(mask, mode)`.
A loss already aggregated with `agg_loss` becomes that sum again by multiplying with `num_loss_units`.

Units: "token" (valid tokens), "sequence" (rows with at least one valid token; a fully masked row
is no sequence, as in verl) and "none" (the sum is the loss: the strategy divides by 1).
Every mode equals verl 0.9's `agg_loss` over the global batch: "token-sum" is the global token sum,
"seq-mean-token-sum-norm" the seq-mean of token sums divided by `loss_scale_factor` (Dr. GRPO).
"""

from __future__ import annotations

import torch

from baton.algorithms.utils import masked_count, masked_mean, masked_sum

# mode → what one unit of the normaliser is
LOSS_AGG_UNITS: dict[str, str] = {
    "token-mean": "token",  # sum over all valid tokens / number of valid tokens
    "token-sum": "none",  # sum over all valid tokens, not normalised
    "seq-mean-token-sum": "sequence",  # per-sequence token sum, averaged over sequences
    "seq-mean-token-mean": "sequence",  # per-sequence token mean, averaged over sequences
    "seq-mean-token-sum-norm": "sequence",  # per-sequence token sum / a constant, averaged over sequences (Dr. GRPO)
}
LOSS_UNITS = ("token", "sequence", "none")


def loss_unit(mode: str) -> str:
    """The unit `agg_loss_sum`'s sum is divided by a count of: "token", "sequence" or "none"."""
    if mode not in LOSS_AGG_UNITS:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {sorted(LOSS_AGG_UNITS)}")
    return LOSS_AGG_UNITS[mode]


def count_loss_units(response_mask: torch.Tensor, unit: str) -> torch.Tensor:
    """This batch's count of `unit`: valid tokens, rows with at least one valid token, or 0 for
    "none" (a strategy divides a "none" sum by 1, whatever the split of the batch)."""
    if unit == "token":
        return masked_count(response_mask)
    if unit == "sequence":
        return (masked_count(response_mask, dim=-1) > 0).float().sum()
    if unit == "none":
        return torch.zeros((), device=response_mask.device)
    raise ValueError(f"unknown loss unit {unit!r}; valid: {list(LOSS_UNITS)}")


def num_loss_units(response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This batch's divisor for `mode` on its own: `count_loss_units` of its unit, 1 for "none"."""
    unit = loss_unit(mode)
    if unit == "none":
        return torch.ones((), device=response_mask.device)
    return count_loss_units(response_mask, unit)


def agg_loss_sum(
    loss_mat: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    mode: str,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, str]:
    """(scalar sum, unit): the masked token sum ("token", "none"), or the sum over sequences of each
    sequence's token sum, token mean, or token sum / `loss_scale_factor` ("sequence"). A fully
    masked row contributes 0. `loss_scale_factor` is read only by "seq-mean-token-sum-norm"; it
    defaults to response_len, and a constant keeps the scale fixed as response lengths change."""
    unit = loss_unit(mode)
    if loss_scale_factor is not None and mode != "seq-mean-token-sum-norm":
        raise ValueError(f"loss_scale_factor applies only to loss_agg_mode 'seq-mean-token-sum-norm', not {mode!r}")
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, response_mask, dim=-1).sum(), unit
    if mode == "seq-mean-token-sum-norm":
        scale = float(response_mask.shape[-1]) if loss_scale_factor is None else float(loss_scale_factor)
        if scale <= 0:
            raise ValueError(f"loss_scale_factor must be > 0 (got {loss_scale_factor}); e.g. the max response length")
        return masked_sum(loss_mat, response_mask) / scale, unit
    return masked_sum(loss_mat, response_mask), unit


def agg_loss(
    loss_mat: torch.Tensor,  # [batch, response_len]
    response_mask: torch.Tensor,  # [batch, response_len]
    mode: str,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Scalar loss: `agg_loss_sum` divided by this batch's own `num_loss_units` (0 when the count is 0)."""
    loss_sum, _ = agg_loss_sum(loss_mat, response_mask, mode, loss_scale_factor)
    return loss_sum / num_loss_units(response_mask, mode).to(loss_sum.dtype).clamp(min=1)
