"""Prompt data: file datasets checked when loaded, the arithmetic task, resumable sampling, collation."""

from baton.datasets.arithmetic import arithmetic_splits
from baton.datasets.files import DataError
from baton.datasets.prompts import (
    OVERLONG_PROMPTS,
    RESERVED_FIELDS,
    PromptDataset,
    PromptSampler,
    collate_prompts,
    collate_sft,
)

__all__ = ["OVERLONG_PROMPTS", "RESERVED_FIELDS", "DataError", "PromptDataset", "PromptSampler", "arithmetic_splits",
           "collate_prompts", "collate_sft"]
