"""The prompt data of a `data:` config, loaded and checked: the arithmetic split, or the configured files."""

from __future__ import annotations

from baton.config.paths import find_file
from baton.datasets.arithmetic import arithmetic_splits
from baton.datasets.config import DataConfig
from baton.datasets.files import DataError
from baton.datasets.prompts import PromptDataset
from baton.models import load_tokenizer
from baton.rewards.routing import BATCH_COLUMNS, RewardRoutes, check_reward_signatures


def load_datasets(config: DataConfig, tokenizer_path: str | None, rewards: RewardRoutes | None = None,
                  reward_columns=BATCH_COLUMNS):
    """(train, val, tokenizer): the arithmetic task's fixed split, or the configured files.

    Every row is checked here (see `PromptDataset`), chat prompts are rendered with the tokenizer's chat template,
    and every prompt's length in tokens (the rendered text's) is checked against `data.max_prompt_len`
    (`data.overlong_prompts`); with `rewards` (the run's reward_fn and reward_kwargs), no field may be named like a
    setting of theirs (`PromptDataset.check_reward_settings`); bad data raises DataError naming the file and row.
    With `rewards`, each function's signature is checked against the names that will reach it, `reward_columns` (the
    batch's own) and the data's other fields (`check_reward_signatures`): a DataError saying what it gets and the fix.
    """
    tokenizer = load_tokenizer(tokenizer_path)
    if config.task == "arithmetic":
        train, val = arithmetic_splits(config.max_operand, config.ops, config.num_val_examples, config.seed,
                                       config.teacher_error)
        train, val = (data.check_prompt_lengths(tokenizer, config.max_prompt_len, config.overlong_prompts)
                      for data in (train, val))
    else:
        train = load_prompt_file(config, config.train_path, tokenizer, rewards)
        val = load_prompt_file(config, config.val_path, tokenizer, rewards) if config.val_path else None
    if rewards is not None:
        fields = {field for data in (train, val) if data is not None for field in data.extra_fields}
        try:
            check_reward_signatures(rewards, fields, prompt_key=config.prompt_key, answer_key=config.answer_key,
                                    batch_columns=reward_columns)
        except ValueError as e:
            raise DataError(f"reward_fn: {e}") from None
    return train, val, tokenizer


def load_prompt_file(config: DataConfig, path: str, tokenizer, rewards: RewardRoutes | None = None) -> PromptDataset:
    """The prompt file `path` with `config`'s keys, checked (against `rewards`' settings too, see `load_datasets`),
    its chat prompts rendered by `tokenizer`'s chat template (`PromptDataset.render_chat`), its over-long prompts
    handled by `data.overlong_prompts`. A relative path not found in the working directory is read from the config
    file's directory."""
    dataset = PromptDataset.from_file(find_file(path), config.prompt_key, config.answer_key, config.response_key)
    if rewards is not None:
        dataset = dataset.check_reward_settings(rewards)
    dataset = dataset.render_chat(tokenizer)
    return dataset.check_prompt_lengths(tokenizer, config.max_prompt_len, config.overlong_prompts)
