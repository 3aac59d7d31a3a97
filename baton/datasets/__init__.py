"""Prompt data: file datasets, the arithmetic task, resumable sampling, collation."""

from baton.datasets.arithmetic import arithmetic_splits
from baton.datasets.prompts import PromptDataset, PromptSampler, collate_prompts, collate_sft

__all__ = ["PromptDataset", "PromptSampler", "arithmetic_splits", "collate_prompts", "collate_sft"]
