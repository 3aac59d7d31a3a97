"""Masked statistics over response tokens: mean, variance, whitening, and group ids for group baselines.

Every function here reads only the positions where the mask is set: whatever sits under a zero of
the mask (padding, prompt or observation tokens), NaN and inf included, never changes a result.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator, Sequence

import numpy as np
import torch

# The process group whose ranks' rows `masked_whiten` treats as one batch (None outside `batch_statistics_over`).
_BATCH_GROUP: contextvars.ContextVar = contextvars.ContextVar("batch_group", default=None)
_WORLD = object()


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` with zeros where `mask` is 0 (a `where`, so NaN or inf under the mask cannot leak into sums or gradients)."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return masked(x, mask).sum() if dim is None else masked(x, mask).sum(dim)


def masked_count(mask: torch.Tensor, dim: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Number of set mask positions (over everything, or along `dim`)."""
    ones = mask.bool().to(dtype)
    return ones.sum() if dim is None else ones.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over the set mask positions, over everything or along `dim`; 0 where nothing is set."""
    count = masked_count(mask, dim, dtype=x.dtype)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `x` over all set mask positions (Bessel-corrected when `unbiased`, as verl)."""
    count = masked_count(mask, dtype=x.dtype)
    needed = 2 if unbiased else 1
    if count < needed:
        raise ValueError(
            f"masked_var needs at least {needed} unmasked element(s), got {int(count)}; "
            "pass a batch with more response tokens" + (" or unbiased=False" if unbiased else "")
        )
    mean = masked_mean(x, mask)
    var = masked_sum((x - mean) ** 2, mask) / count
    return var * count / (count - 1) if unbiased else var


@contextlib.contextmanager
def batch_statistics_over(group=None) -> Iterator[None]:
    """Within it, `masked_whiten` takes its mean and variance over the rows of every rank of `group` (a
    torch.distributed process group; None: the world), as if the ranks' shards were one batch: how a per-rank
    worker whitens PPO's advantages as the single controller does over the whole batch. Every rank must make the
    same calls (each is an all-reduce)."""
    token = _BATCH_GROUP.set(_WORLD if group is None else group)
    try:
        yield
    finally:
        _BATCH_GROUP.reset(token)


def _global_mean_var(x: torch.Tensor, mask: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mean and unbiased variance over the rows of every rank of `group`."""
    import torch.distributed as dist

    group = None if group is _WORLD else group
    totals = torch.stack([masked_sum(x, mask), masked_count(mask, dtype=x.dtype)])
    dist.all_reduce(totals, group=group)
    total, count = totals[0], totals[1]
    if count < 2:  # every rank sees the same count: all raise together, none waits in the next all-reduce
        raise ValueError(f"masked_var needs at least 2 unmasked elements over the ranks, got {int(count)}; pass a "
                         "batch with more response tokens")
    mean = total / count
    squares = masked_sum((x - mean) ** 2, mask)
    dist.all_reduce(squares, group=group)
    return mean, squares / (count - 1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, epsilon: float = 1e-8) -> torch.Tensor:
    """(x - mean) / sqrt(var + epsilon) over the set positions, with the mean added back unless
    `shift_mean`; 0 where the mask is 0. Same shape as `x`. Inside `batch_statistics_over`, the mean and
    variance are over every rank's rows."""
    group = _BATCH_GROUP.get()
    if group is not None:
        mean, var = _global_mean_var(x, mask, group)
    else:
        mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return masked(whitened, mask)


def group_ids(index: Sequence | np.ndarray | torch.Tensor, batch_size: int) -> tuple[torch.Tensor, int]:
    """Dense group numbers [batch] (0, 1, ... in order of first appearance) for any hashable ids,
    and the number of groups."""
    ids = index.tolist() if hasattr(index, "tolist") else list(index)
    if len(ids) != batch_size:
        raise ValueError(
            f"index has {len(ids)} group ids but the batch has {batch_size} rows; "
            "pass one id per row (e.g. the prompt uid)"
        )
    first_seen: dict = {}
    dense = [first_seen.setdefault(i, len(first_seen)) for i in ids]
    return torch.tensor(dense, dtype=torch.long), len(first_seen)
