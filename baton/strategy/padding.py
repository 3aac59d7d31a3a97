"""Dropping a micro-batch's padding columns before the model runs on it.

A batch is padded to its longest prompt on the left and its longest response on the right, so a micro-batch
of short rows cut from a batch with one long row carries columns that are padding in every row. The model's
outputs at the real tokens do not depend on them (the padded keys are masked out of attention, and a causal
model's position never sees the columns after it), so the strategy drops them and runs on the rest: a
micro-batch of 3-token responses in a batch padded to 8 costs a 3-token forward and backward.

The columns are found by width: a tensor column as wide as `input_ids` (prompt + response) is a sequence
column, trimmed on both sides; one as wide as `responses` is a response column ([rows, len] or [rows, len, k]),
trimmed on the right. Where the prompt width equals the response width the two cannot be told apart from a
prompt-width column, and only the sequence's left padding is dropped.
"""

from __future__ import annotations

import torch

from baton.data import DataProto


def trim_padding(batch: DataProto) -> tuple[DataProto, int]:
    """(the batch without the columns that are padding in every row, the response columns dropped on the right).

    Needs `input_ids`, `attention_mask` and `responses`; a batch without them, or with nothing to drop, comes
    back as it is. At least one response column is kept.
    """
    data = batch.batch
    if len(batch) == 0 or not all(k in data for k in ("input_ids", "attention_mask", "responses")):
        return batch, 0
    mask = data["attention_mask"]
    seq_len, resp_len = data["input_ids"].shape[1], data["responses"].shape[1]
    prompt_len = seq_len - resp_len
    if prompt_len < 0 or mask.shape[1] != seq_len:
        return batch, 0
    real = mask.bool().any(dim=0)  # [seq_len]: a column with a real token in some row
    # The last prompt column stays: its position predicts the first response token.
    lead = min(_count_leading_false(real[:prompt_len]), max(prompt_len - 1, 0))
    tail = min(_count_leading_false(real[prompt_len:].flip(0)), resp_len - 1) if prompt_len != resp_len else 0
    if lead == 0 and tail == 0:
        return batch, 0
    columns = {}
    for key, value in data.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq_len:
            value = value[:, lead : seq_len - tail]
        elif isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == resp_len and tail:
            value = value[:, : resp_len - tail]
        columns[key] = value
    return DataProto(columns, dict(batch.non_tensor_batch), dict(batch.meta_info)), tail


def pad_responses(outputs: dict[str, torch.Tensor], tail: int) -> dict[str, torch.Tensor]:
    """The model's per-response-token outputs ([rows, len, ...]) of a trimmed micro-batch padded back on the right
    with `tail` zero columns, to the untrimmed batch's response width."""
    if not tail:
        return outputs
    padded = {}
    for key, value in outputs.items():
        shape = (value.shape[0], tail, *value.shape[2:])
        padded[key] = torch.cat([value, value.new_zeros(shape)], dim=1)
    return padded


def _count_leading_false(flags: torch.Tensor) -> int:
    if flags.numel() == 0:
        return 0
    hits = torch.nonzero(flags)
    return int(hits[0, 0]) if len(hits) else flags.numel()
