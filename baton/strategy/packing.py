"""Packing a micro-batch: its rows' real tokens only, several rows to a sequence, attention kept within each row.

A batch of reasoning traces padded to its longest row is mostly padding. Packed, each row's real tokens (in their
column order, with their own position ids) are laid one after another into bins as long as the longest row
(first fit, longest rows first), and the model runs on the bins: a `[bins, 1, length, length]` mask lets a token
attend only to the tokens before it in its own row, so each row's hidden states are those of its padded pass up to
float rounding. The hidden states are then put back at the rows' padded columns (zeros at padding). Bins of
`SEPARATE_BINS_FROM` tokens or more (long traces) run one pass each at their own fill, so no position is padding;
shorter ones run as one batch, where a call per bin would cost more than the padding it saves.

Why a mask and not position ids alone: with sdpa or eager attention on CPU, restarting the position ids at each
row does not keep rows apart (their keys stay visible; measured: logit differences of ~0.5). A boolean mask
(sdpa) or an additive float mask (eager) does (differences ~2e-7). The mask costs a bit per pair of positions in a
bin, `bins × length²`, which the bins' length (the longest row) bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The attention implementations whose masks packing builds: a boolean mask (sdpa), an additive float mask (eager).
PACKABLE_ATTENTION = ("sdpa", "eager")
SEPARATE_BINS_FROM = 1024  # tokens: bins this long run a pass each (`Packing.separate`)


def attention_implementation(model) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_attn_implementation", None) or getattr(config, "attn_implementation", None))


def resolve_packing(packing: bool | None, model) -> bool:
    """Whether a model's passes are packed: `packing` as configured (None: where its attention allows)."""
    implementation = attention_implementation(model)
    if packing is None or packing is False:
        return packing is None and implementation in PACKABLE_ATTENTION
    if implementation not in PACKABLE_ATTENTION:
        raise ValueError(f"packing: true needs the model's attention to be one of {list(PACKABLE_ATTENTION)}, which "
                         f"take the mask that keeps packed rows apart; this model's is {implementation!r}; set "
                         "packing: false (or null, which packs only where it can)")
    return True


@dataclass
class Packing:
    """Where each real token of a `[rows, seq]` micro-batch sits in the packed `[bins, length]` one."""

    rows: torch.Tensor  # [tokens]: each real token's row and column in the padded layout, row-major order
    columns: torch.Tensor
    bins: torch.Tensor  # [tokens]: and its bin and slot in the packed layout
    slots: torch.Tensor
    num_bins: int
    length: int
    fills: list[int]  # each bin's used slots, from its first
    separate: bool  # one pass per bin at its own fill (`plan_packing`), else one batched pass

    @property
    def cost(self) -> int:
        """Token positions the packed pass runs."""
        return sum(self.fills) if self.separate else self.num_bins * self.length


def plan_packing(attention_mask: torch.Tensor, one_pass: bool = False) -> Packing:
    """Bins as long as the longest row, filled first fit with the longest rows first. Bins of `SEPARATE_BINS_FROM`
    tokens or more run one pass each at their own fill (no padding at all), shorter ones one batched pass, where a
    pass per bin would cost more in calls than the padding it saves; `one_pass`: always one batched pass."""
    real = attention_mask.bool()
    lengths = real.sum(-1).tolist()
    length = max(max(lengths, default=0), 1)
    free: list[int] = []  # room left in each bin
    start_of_row = [0] * len(lengths)
    bin_of_row = [0] * len(lengths)
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        b = next((i for i, room in enumerate(free) if room >= lengths[row]), len(free))
        if b == len(free):
            free.append(length)
        bin_of_row[row], start_of_row[row] = b, length - free[b]
        free[b] -= lengths[row]
    rows, columns = torch.nonzero(real, as_tuple=True)
    device = attention_mask.device
    offset_in_row = real.long().cumsum(-1)[rows, columns] - 1
    bins = torch.tensor(bin_of_row, device=device, dtype=torch.long)[rows]
    slots = torch.tensor(start_of_row, device=device, dtype=torch.long)[rows] + offset_in_row
    return Packing(rows, columns, bins, slots, max(len(free), 1), length, [length - room for room in free] or [0],
                   separate=length >= SEPARATE_BINS_FROM and not one_pass)


def packed_mask(packing: Packing, dtype: torch.dtype | None) -> torch.Tensor:
    """`[bins, 1, length, length]`: True (dtype None, for sdpa) or 0 (an additive float mask of `dtype`, for eager)
    where a query slot may attend to a key slot: an earlier or the same slot of its own row. An empty slot attends to
    itself and the empty slots before it, so no query sees nothing (which would make NaNs)."""
    return _mask(_segments(packing), dtype)


def _segments(packing: Packing) -> torch.Tensor:
    """`[bins, length]`: each slot's row, -1 where empty."""
    segment = torch.full((packing.num_bins, packing.length), -1, dtype=torch.long, device=packing.rows.device)
    segment[packing.bins, packing.slots] = packing.rows
    return segment


def _mask(segment: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    length = segment.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segment.device).tril()
    allowed = ((segment[:, :, None] == segment[:, None, :]) & causal)[:, None]
    if dtype is None:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def packed_response_hidden_states(decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                  position_ids: torch.Tensor, response_len: int, packing: Packing) -> torch.Tensor:
    """The hidden states that predict each response token, `[rows, response_len, hidden]`, from the packed bins
    (one batched pass, or one pass per bin: `Packing.separate`); zeros where the padded layout has padding."""
    shape = (packing.num_bins, packing.length)
    packed_ids = input_ids.new_zeros(shape)
    packed_ids[packing.bins, packing.slots] = input_ids[packing.rows, packing.columns]
    packed_positions = position_ids.new_zeros(shape)
    packed_positions[packing.bins, packing.slots] = position_ids[packing.rows, packing.columns]
    segment = _segments(packing)
    mask_dtype = decoder.dtype if attention_implementation(decoder) == "eager" else None
    if packing.separate:
        hidden = torch.cat([
            decoder(input_ids=packed_ids[b : b + 1, :fill], position_ids=packed_positions[b : b + 1, :fill],
                    attention_mask=_mask(segment[b : b + 1, :fill], mask_dtype), use_cache=False).last_hidden_state[0]
            for b, fill in enumerate(packing.fills)])
        starts = torch.tensor([0, *packing.fills[:-1]], device=input_ids.device).cumsum(0)
        index = starts[packing.bins] + packing.slots  # each token's row in `hidden` [sum of fills, hidden]
    else:
        hidden = decoder(input_ids=packed_ids, attention_mask=_mask(segment, mask_dtype), position_ids=packed_positions,
                         use_cache=False).last_hidden_state.flatten(0, 1)  # [bins * length, hidden]
        index = packing.bins * packing.length + packing.slots
    # The padded pass's columns seq - response_len - 1 .. seq - 2 predict the response tokens.
    first = input_ids.shape[1] - response_len - 1
    wanted = (packing.columns >= first) & (packing.columns < first + response_len)
    out = hidden.new_zeros(input_ids.shape[0], response_len, hidden.shape[-1])
    return out.index_put((packing.rows[wanted], packing.columns[wanted] - first), hidden[index[wanted]])
