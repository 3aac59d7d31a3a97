"""The prompt data's settings (`data:`): the built-in arithmetic task, or jsonl/parquet files."""

from __future__ import annotations

import os
from dataclasses import dataclass

from baton.config.paths import find_file
from baton.datasets.prompts import OVERLONG_PROMPTS


@dataclass
class DataConfig:
    """Prompts: the built-in arithmetic task, or jsonl/parquet files (`train_path`, `val_path`)."""

    task: str = "arithmetic"  # "arithmetic" or "files"
    train_path: str | None = None
    val_path: str | None = None
    # A field name, or a dotted path into nested objects (verl: answer_key: reward_model.ground_truth); a top-level
    # field named with the dots wins. The prompt is text or chat messages [{"role", "content"}, ...], rendered by the
    # tokenizer's chat template when the data is loaded.
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # the ground truth the reward checks
    response_key: str | None = None  # the field SFT trains on; None: `sft_response_key`
    max_operand: int = 30
    ops: str = "+"
    num_val_examples: int = 200
    teacher_error: float = 0.0  # arithmetic: the share of the teacher's demonstrations of a carry that drop it
    max_prompt_len: int = 64
    # A prompt longer than max_prompt_len tokens when the data is loaded: "error" names it; "filter" drops it
    # (and says how many it dropped). verl's filter_overlong_prompts.
    overlong_prompts: str = "error"
    seed: int = 0

    def __post_init__(self):
        if self.task not in ("arithmetic", "files"):
            raise ValueError(f"data.task {self.task!r} is not one of 'arithmetic', 'files'")
        if self.overlong_prompts not in OVERLONG_PROMPTS:
            raise ValueError(f"data.overlong_prompts {self.overlong_prompts!r} is not one of {OVERLONG_PROMPTS}")
        if self.task == "files" and not self.train_path:
            raise ValueError("data.task 'files' needs data.train_path (a .jsonl or .parquet file)")
        # Found files are kept as absolute paths, so the run directory's config.yaml works from anywhere.
        self.train_path, self.val_path = _absolute_if_found(self.train_path), _absolute_if_found(self.val_path)

    @property
    def sft_response_key(self) -> str:
        """The field SFT trains on: `response_key`; unset, the arithmetic task's teacher demonstrations
        (`teacher_answers`, the answer itself when teacher_error is 0) or the files' `answer_key`."""
        return self.response_key or ("teacher_answers" if self.task == "arithmetic" else self.answer_key)


def _absolute_if_found(path: str | None) -> str | None:
    """`path` made absolute where `find_file` finds it (the working directory, else the config's); else as given."""
    try:
        return os.path.abspath(find_file(path)) if path else path
    except FileNotFoundError:
        return path  # reported when the data is loaded
