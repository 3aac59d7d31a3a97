"""Preference pairs (prompt, chosen, rejected) from jsonl/parquet files or lists, checked when loaded, and their
collation: a pair's chosen and rejected rows side by side, so that no split of a batch into even parts parts them."""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import torch

from baton.data import DataProto
from baton.datasets.files import DataError, read_rows
from baton.datasets.prompts import PromptDataset, _describe, _messages_problem, collate_sft

COMPLETION = "completion"  # the field of a pair's rows (`PreferenceDataset.to_rows`) that holds its response
PAIR_INDEX, IS_CHOSEN = "pair_index", "is_chosen"  # the batch columns that say which pair and side each row is


class PreferenceDataset:
    """Preference pairs: a prompt and two responses to it, `chosen` (preferred) and `rejected`.

    Each example is a dict. Its prompt is a non-empty string or chat messages (a list of {"role", "content"}
    objects); its chosen and rejected responses are non-empty strings, or (with a chat prompt) chat messages that
    follow the prompt's, as TRL's conversational preference data has them (e.g. [{"role": "assistant", "content":
    "42"}]). Other fields are kept but not used. The constructor checks every row and raises DataError naming the
    first bad one and the fix. `source`, `positions` and `unit` name rows in errors as `PromptDataset`'s do.
    """

    def __init__(self, examples: Sequence[Any], prompt_key: str = "prompt", chosen_key: str = "chosen",
                 rejected_key: str = "rejected", *, source: str | None = None, positions: Sequence[int] | None = None,
                 unit: str = "row"):
        self.prompt_key, self.chosen_key, self.rejected_key = prompt_key, chosen_key, rejected_key
        self.source, self.unit = source, unit
        self.positions = np.arange(len(examples)) if positions is None else np.asarray(positions, dtype=np.int64)
        assert len(self.positions) == len(examples), "one position per example"
        for index, example in enumerate(examples):
            problem = self._problem(example)
            if problem is not None:
                raise DataError(f"{self.where(index)}: {problem}")
        self.examples = list(examples)

    @classmethod
    def from_file(cls, path: str, prompt_key: str = "prompt", chosen_key: str = "chosen",
                  rejected_key: str = "rejected") -> "PreferenceDataset":
        """Read and check a `.jsonl` (one JSON object per line) or `.parquet` file of pairs."""
        example = {key: "..." for key in (prompt_key, chosen_key, rejected_key)}
        rows, positions, unit = read_rows(path, example)
        if not rows:
            raise DataError(f"{path}: the file has no rows; a preference file needs at least one, such as "
                            f"{json.dumps(example)}")
        return cls(rows, prompt_key, chosen_key, rejected_key, source=path, positions=positions, unit=unit)

    def where(self, index: int) -> str:
        position = int(self.positions[index])
        return f"{self.source}, {self.unit} {position}" if self.source else f"example {position}"

    def _problem(self, example: Any) -> str | None:
        """What is wrong with `example`, or None."""
        keys = (self.prompt_key, self.chosen_key, self.rejected_key)
        if not isinstance(example, dict):
            return ("a row must be a JSON object such as " + "{" + ", ".join(f'"{k}": "..."' for k in keys)
                    + "}, not " + _describe(example))
        for key, knob in zip(keys, ("prompt_key", "chosen_key", "rejected_key")):
            if key not in example:
                return f"no {key!r} field (fields: {sorted(example)}); set pairs.{knob} to the field that holds it"
        prompt = example[self.prompt_key]
        if isinstance(prompt, (list, tuple)):
            problem = _messages_problem(prompt)
            if problem is not None:
                return f"the prompt {self.prompt_key!r} is a list, so chat messages, but {problem}"
        elif not isinstance(prompt, str) or not prompt.strip():
            return (f"the prompt {self.prompt_key!r} is {_describe(prompt)}; it must be a non-empty string or a list "
                    'of chat messages such as [{"role": "user", "content": "..."}]')
        for key in keys[1:]:
            response = example[key]
            if isinstance(response, (list, tuple)):
                if not isinstance(prompt, (list, tuple)):
                    return (f"the response {key!r} is chat messages but the prompt is text; give the prompt as chat "
                            f"messages too, or {key!r} as text")
                problem = _messages_problem(response)
                if problem is not None:
                    return f"the response {key!r} is a list, so chat messages, but {problem}"
            elif not isinstance(response, str) or not response:
                return (f"the response {key!r} is {_describe(response)}; it must be a non-empty string or a list of "
                        'chat messages such as [{"role": "assistant", "content": "..."}]')
        if example[self.chosen_key] == example[self.rejected_key]:
            return (f"{self.chosen_key!r} and {self.rejected_key!r} are the same, so the pair prefers nothing; "
                    "drop the row or fix one of them")
        return None

    def to_rows(self, tokenizer, max_prompt_len: int, max_response_len: int) -> PromptDataset:
        """The pairs as text rows, each pair's chosen (row 2i) then its rejected (row 2i + 1), the response in the
        field COMPLETION: what `collate_pairs` collates. Chat messages are rendered with `tokenizer`'s chat
        template: the prompt with the generation prompt, a response as the rest of the rendered conversation.
        DataError naming the row for a prompt over `max_prompt_len` tokens or a response (with its eos) over
        `max_response_len`, or chat messages and a tokenizer without a chat template."""
        rows = []
        for index, example in enumerate(self.examples):
            prompt = example[self.prompt_key]
            prompt_text = prompt if isinstance(prompt, str) else self._render(tokenizer, index, prompt, None)
            for key in (self.chosen_key, self.rejected_key):
                response = example[key]
                text = response if isinstance(response, str) else self._render(tokenizer, index, prompt, response)
                rows.append({"prompt": prompt_text, COMPLETION: text})
        dataset = PromptDataset(rows, "prompt", None, COMPLETION, source=self.source,
                                positions=np.repeat(self.positions, 2), unit=self.unit)
        dataset = dataset.check_prompt_lengths(tokenizer, max_prompt_len)
        lengths = [len(ids) + 1 for ids in tokenizer([r[COMPLETION] for r in rows], add_special_tokens=False)["input_ids"]]
        longer = [row for row, length in enumerate(lengths) if length > max_response_len]
        if longer:
            row = longer[0]
            key = self.chosen_key if row % 2 == 0 else self.rejected_key
            raise DataError(f"{self.where(row // 2)}: the response {key!r} has {lengths[row]} tokens with its eos, more "
                            f"than pairs.max_response_len={max_response_len} ({len(longer)} of {len(rows)} responses "
                            "are longer); raise pairs.max_response_len or shorten those responses")
        return dataset

    def _render(self, tokenizer, index: int, prompt: list, response: list | None) -> str:
        """The chat prompt's text (response None), or the text `response`'s messages add to it."""
        import jinja2  # transformers renders chat templates with it

        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"{self.where(index)}: the row holds chat messages, but the tokenizer in "
                            f"{tokenizer.name_or_path} has no chat template to render them with; use the tokenizer of "
                            "a chat (instruct) model, add a template to that directory (a chat_template.jinja file), "
                            "or store the prompt, chosen and rejected as text")
        try:
            prompt_text = tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
            if response is None:
                return prompt_text
            full = tokenizer.apply_chat_template([*prompt, *response], tokenize=False)
        except jinja2.TemplateError as e:
            raise DataError(f"{self.where(index)}: the chat template of the tokenizer in {tokenizer.name_or_path} "
                            f"fails on the row's messages: {e}") from e
        if not full.startswith(prompt_text) or len(full) == len(prompt_text):
            raise DataError(f"{self.where(index)}: the chat template renders the prompt and a response as a text that "
                            "does not extend the prompt's, so the response's tokens cannot be told apart; store the "
                            "prompt, chosen and rejected as text")
        return full[len(prompt_text):]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.examples[index]


def collate_pairs(rows: PromptDataset, pair_indices: Sequence[int], tokenizer, max_prompt_len: int | None = None
                  ) -> DataProto:
    """Pairs `pair_indices` of `rows` (`PreferenceDataset.to_rows`) in the generate() layout (`collate_sft`), two
    rows per pair, chosen then rejected, plus `pair_index` [rows] (the pair's index) and `is_chosen` [rows] (1 on
    the chosen row). Every split of the batch into parts of an even number of rows keeps each pair in one part."""
    row_indices = [row for pair in pair_indices for row in (2 * pair, 2 * pair + 1)]
    batch = collate_sft(rows, row_indices, tokenizer, max_prompt_len, COMPLETION)
    batch.batch[PAIR_INDEX] = torch.tensor(list(pair_indices), dtype=torch.long).repeat_interleave(2)
    batch.batch[IS_CHOSEN] = torch.tensor([1, 0], dtype=torch.long).repeat(len(pair_indices))
    return batch


def check_pairs_together(batch: DataProto) -> None:
    """ValueError unless `batch` (a micro-batch) holds whole pairs as `collate_pairs` lays them out."""
    pair, chosen = batch.batch[PAIR_INDEX], batch.batch[IS_CHOSEN]
    if len(batch) % 2 or not (torch.equal(pair[0::2], pair[1::2]) and bool((chosen[0::2] == 1).all())
                              and bool((chosen[1::2] == 0).all())):
        raise ValueError(f"a micro-batch of {len(batch)} rows holds part of a preference pair (pairs "
                         f"{sorted(set(pair.tolist()))}); each pair's chosen and rejected rows must train together: "
                         "give the actor an even micro_batch_size_per_worker and no max_tokens_per_microbatch")


__all__ = ["COMPLETION", "IS_CHOSEN", "PAIR_INDEX", "PreferenceDataset", "check_pairs_together", "collate_pairs"]
