"""DAPO's soft overlong penalty (verl's `reward_model.overlong_buffer`): a response that runs into the last
`buffer_len` tokens before the length limit loses reward in proportion to how far it runs in."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # not imported at run time: the scoring processes import baton.rewards without torch
    import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_len: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """[rows] float32 penalty, added to the reward: `min(-(length - (max_response_len - buffer_len)) / buffer_len *
    penalty_factor, 0)`; 0 up to `max_response_len - buffer_len` tokens, -penalty_factor at the limit."""
    if not 0 < buffer_len < max_response_len:
        raise ValueError(f"the overlong buffer needs 0 < buffer_len < max_response_len, got buffer_len={buffer_len} "
                         f"and max_response_len={max_response_len}")
    exceed = response_lengths.float() - (max_response_len - buffer_len)  # [rows]
    return (-exceed / buffer_len * penalty_factor).clamp(max=0.0)
