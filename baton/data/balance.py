"""Balancing a batch's tokens across data-parallel ranks (verl's `balance_batch`).

A data-parallel update splits its batch into consecutive equal pieces, one per rank, and every rank waits for the
slowest at the gradient all-reduce. Reasoning traces vary in length by 10x or more, so a piece of long ones can take
several times as long as a piece of short ones. Reordered first, the pieces hold about equal numbers of real tokens;
a loss summed over the batch's units is the same in any order, so the update is the same up to float rounding.
"""

from __future__ import annotations

import torch

from baton.data.proto import DataProto


def balanced_order(lengths: list[int], num_parts: int) -> list[int]:
    """Row indices such that consecutive equal pieces (len(lengths) / num_parts rows each) hold about equal sums of
    `lengths`: longest rows first, each to the piece with the least so far among those with room. Each piece keeps
    its rows in their first order."""
    size = len(lengths) // num_parts
    totals, parts = [0] * num_parts, [[] for _ in range(num_parts)]
    for row in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        part = min((p for p in range(num_parts) if len(parts[p]) < size), key=lambda p: (totals[p], p))
        parts[part].append(row)
        totals[part] += lengths[row]
    return [row for part in parts for row in sorted(part)]


def balance_by_tokens(batch: DataProto, num_parts: int) -> DataProto:
    """The batch reordered so that `batch.chunk(num_parts)` gives pieces of about equal real tokens
    (`attention_mask`); as it is with one part, without an attention mask, or when the rows do not divide evenly
    (the dispatcher would pad it, moving the pieces' boundaries)."""
    if num_parts <= 1 or len(batch) % num_parts or "attention_mask" not in batch.batch:
        return batch
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    order = balanced_order(lengths, num_parts)
    if order == list(range(len(batch))):
        return batch
    return batch[torch.tensor(order)]
