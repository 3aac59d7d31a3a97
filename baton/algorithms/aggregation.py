"""Loss aggregation: a [batch, response_len] loss matrix to a scalar, as a mean or as a sum plus its unit.

Distributed training normalises by a global count, not a per-worker one: a strategy's loss
function returns `agg_loss_sum(...)[0]` and the strategy divides by the number of `loss_unit(mode)`
units in the whole step (all workers, all micro-batches). With one worker and no micro-batching
that equals `agg_loss`: `agg_loss(m, mask, mode) == agg_loss_sum(m, mask, mode)[0] / num_loss_units(mask, mode)`.
A loss already aggregated with `agg_loss` becomes that sum again by multiplying with `num_loss_units`.
"""

from __future__ import annotations

import torch

from baton.algorithms.utils import masked_count, masked_mean, masked_sum

# mode → what one unit of the normaliser is
LOSS_AGG_UNITS: dict[str, str] = {
    "token-mean": "token",  # sum over all valid tokens / number of valid tokens
    "seq-mean-token-sum": "sequence",  # per-sequence token sum, averaged over sequences
    "seq-mean-token-mean": "sequence",  # per-sequence token mean, averaged over sequences
}


def loss_unit(mode: str) -> str:
    """The unit `agg_loss_sum`'s sum is divided by a count of: "token" or "sequence"."""
    if mode not in LOSS_AGG_UNITS:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {sorted(LOSS_AGG_UNITS)}")
    return LOSS_AGG_UNITS[mode]


def num_loss_units(response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This batch's count of `loss_unit(mode)`: valid tokens, or rows (every row counts, as in verl)."""
    if loss_unit(mode) == "token":
        return masked_count(response_mask)
    return torch.tensor(float(response_mask.shape[0]), device=response_mask.device)


def agg_loss_sum(loss_mat: torch.Tensor, response_mask: torch.Tensor, mode: str) -> tuple[torch.Tensor, str]:
    """(scalar sum, unit): the masked token sum ("token"), the sum of per-sequence token sums or of
    per-sequence token means ("sequence"). A sequence with no valid token contributes 0."""
    unit = loss_unit(mode)
    if mode == "seq-mean-token-mean":
        return masked_mean(loss_mat, response_mask, dim=-1).sum(), unit
    return masked_sum(loss_mat, response_mask), unit


def agg_loss(loss_mat: torch.Tensor, response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Scalar loss: `agg_loss_sum` divided by this batch's own unit count (0 when the count is 0)."""
    loss_sum, _ = agg_loss_sum(loss_mat, response_mask, mode)
    return loss_sum / num_loss_units(response_mask, mode).to(loss_sum.dtype).clamp(min=1)
