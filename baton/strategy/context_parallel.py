"""Context parallelism, DeepSpeed-Ulysses style: each sequence split by position over a group of cp ranks.

Every rank of the group gets the same rows and runs the decoder on its slice of the positions: the embedding, norms,
MLP and projections see only that slice, so a trace's activations are spread over the group. Attention needs every
position: an all-to-all turns [rows, heads, slice, dim] into [rows, heads / cp, every position, dim], attention runs
on that share of the heads with the whole causal and padding mask, and a second all-to-all turns it back. Each rank
puts the response positions it holds through the LM head (or value head), and the outputs, a few numbers per token,
are gathered (`gather_responses`), so the loss sees whole rows, the same on every rank of the group. The backward pass
of the gather keeps each rank's own positions' gradient, so a rank's parameter gradients are its positions' part
and the FSDP reduction over the group adds the parts up.

The model attends through `ulysses_attention` (registered with transformers as ATTENTION): it ignores the mask the
model builds for its slice and takes the whole one, set for the call by `context_parallel_hidden_states`.
"""

from __future__ import annotations

import contextvars

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

ATTENTION = "baton_ulysses"
_call: contextvars.ContextVar[tuple] = contextvars.ContextVar("baton_ulysses_call")  # (group, mask [rows, 1, S, S])


def check_context_parallel(config, cp: int) -> None:
    """ValueError, naming the size and the fix, for a model whose attention heads a `cp`-way split cannot divide."""
    heads = getattr(config, "num_attention_heads", None)
    if heads is None or heads % cp:
        raise ValueError(f"cp: {cp} does not divide this model's num_attention_heads ({heads}); choose a cp that does")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("cp > 1 takes models with full attention; this one uses a sliding window: train it with cp: 1")


def use_ulysses_attention(model: torch.nn.Module, cp: int) -> None:
    """Make `model` (an HF causal LM or token classifier) attend through `ulysses_attention`."""
    check_context_parallel(model.config, cp)
    AttentionInterface.register(ATTENTION, ulysses_attention)
    model.config._attn_implementation = ATTENTION


def context_parallel_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                   position_ids: torch.Tensor, response_len: int, group
                                   ) -> tuple[torch.Tensor, slice, list[int]]:
    """The hidden states that predict this rank's share of the response tokens, from one pass over the padded rows
    with the positions split over `group` (as `baton.strategy.logprobs.response_hidden_states` without prompt
    sharing or packing): ([rows, share, hidden], the share as a slice of the response positions, every rank's share
    size, for `gather_responses`)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, length = input_ids.shape
    size = -(-length // cp)  # positions per rank; the extra ones at the end are padding
    input_ids, attention_mask, position_ids = (F.pad(x, (0, size * cp - length)) for x in (input_ids, attention_mask,
                                                                                             position_ids))
    first = length - response_len - 1  # the position that predicts the first response token
    shares = [slice(min(max(r * size - first, 0), response_len), min(max((r + 1) * size - first, 0), response_len))
              for r in range(cp)]
    token = _call.set((group, _whole_mask(attention_mask)))
    try:
        own = slice(rank * size, (rank + 1) * size)
        local = model.get_decoder()(input_ids=input_ids[:, own], position_ids=position_ids[:, own],
                                    use_cache=False).last_hidden_state  # [rows, size, hidden]
    finally:
        _call.reset(token)
    share = shares[rank]
    offset = first - rank * size
    return local[:, share.start + offset : share.stop + offset], share, [s.stop - s.start for s in shares]


def gather_responses(part: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Every rank's share of the response positions, concatenated: [rows, sizes[rank], ...] → [rows, sum(sizes),
    ...], the same on every rank. Every rank computes the same loss from it, so the backward pass keeps each rank's
    own share of the gradient (no reduction): parameters then get each position's gradient on one rank only."""
    return _GatherResponses.apply(part, tuple(sizes), group)


def _whole_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """[rows, 1, S, S] bool: position i attends to j <= i where j is a real token, and always to itself, so that a
    padding position's row is never empty (an empty row's softmax is NaN, and NaN times a zero gradient is NaN)."""
    length = attention_mask.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=attention_mask.device).tril()
    mask = causal & attention_mask.bool()[:, None, :]
    return (mask | torch.eye(length, dtype=torch.bool, device=mask.device))[:, None]


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: query [rows, heads, slice, dim], key and value [rows, kv_heads, slice, dim]
    of this rank's positions → [rows, slice, heads, dim]."""
    group, mask = _call.get()
    cp = dist.get_world_size(group)
    groups = module.num_key_value_groups
    if key.shape[1] % cp:  # too few key/value heads to split: send each query head its own copy
        key, value, groups = repeat_kv(key, groups), repeat_kv(value, groups), 1
    query, key, value = (_positions_to_heads(x, cp, group) for x in (query, key, value))
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return _heads_to_positions(out, cp, group).transpose(1, 2).contiguous(), None


def _positions_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """[rows, heads, slice, dim] on each rank → [rows, heads / cp, cp · slice, dim]: rank r gets the r-th share of
    the heads at every position."""
    rows, heads, size, dim = x.shape
    x = x.reshape(rows, cp, heads // cp, size, dim).transpose(0, 1).contiguous()  # [cp, rows, heads / cp, slice, dim]
    x = _all_to_all(x, group)  # [cp (source rank), rows, heads / cp, slice, dim]
    return x.permute(1, 2, 0, 3, 4).reshape(rows, heads // cp, cp * size, dim)


def _heads_to_positions(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of `_positions_to_heads`: [rows, heads / cp, cp · slice, dim] → [rows, heads, slice, dim]."""
    rows, share, length, dim = x.shape
    x = x.reshape(rows, share, cp, length // cp, dim).permute(2, 0, 1, 3, 4).contiguous()  # [cp, rows, share, ...]
    x = _all_to_all(x, group)  # [cp (source rank: its share of heads), ...]
    return x.transpose(0, 1).reshape(rows, cp * share, length // cp, dim)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x [cp, ...]: x[r] goes to rank r; the result's [r] came from rank r. Differentiable (the backward pass is the
    reverse all-to-all)."""
    out = all_to_all_single_autograd(x, None, None, group)
    return out.wait() if hasattr(out, "wait") else out


class _GatherResponses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, part: torch.Tensor, sizes: tuple[int, ...], group) -> torch.Tensor:
        most = max(sizes)
        padded = F.pad(part, (0, 0) * (part.dim() - 2) + (0, most - part.shape[1])).contiguous()
        pieces = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(pieces, padded, group=group)
        rank = dist.get_rank(group)
        ctx.own = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
        return torch.cat([piece[:, :size] for piece, size in zip(pieces, sizes)], dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[:, ctx.own].contiguous(), None, None
