"""The pipelines' prompt data, from the data config."""

from __future__ import annotations

from baton.config.paths import find_file
from baton.datasets import PromptDataset, arithmetic_splits
from baton.models import load_tokenizer
from baton.pipelines.config import DataConfig


def load_datasets(config: DataConfig, tokenizer_path: str | None):
    """(train, val, tokenizer): the arithmetic task's fixed split, or the configured files."""
    tokenizer = load_tokenizer(tokenizer_path)
    if config.task == "arithmetic":
        train, val = arithmetic_splits(config.max_operand, config.ops, config.num_val_examples, config.seed,
                                       config.teacher_error)
    else:
        # A relative path not found in the working directory is read from the config file's directory.
        train = PromptDataset.from_file(find_file(config.train_path), config.prompt_key, config.answer_key)
        val = (PromptDataset.from_file(find_file(config.val_path), config.prompt_key, config.answer_key)
               if config.val_path else None)
    return train, val, tokenizer
