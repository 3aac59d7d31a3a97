"""Prompt data: file datasets checked when loaded (verl's layout included), chat prompts, the arithmetic task,
resumable sampling, collation."""

from baton.datasets.arithmetic import arithmetic_splits
from baton.datasets.files import DataError
from baton.datasets.prompts import (
    CHAT_ROLES,
    OVERLONG_PROMPTS,
    RAW_PROMPT,
    RESERVED_FIELDS,
    PromptDataset,
    PromptSampler,
    collate_prompts,
    collate_sft,
)

__all__ = ["CHAT_ROLES", "OVERLONG_PROMPTS", "RAW_PROMPT", "RESERVED_FIELDS", "DataError", "PromptDataset",
           "PromptSampler", "arithmetic_splits", "collate_prompts", "collate_sft"]
