"""Prompt datasets: examples from jsonl/parquet files or lists, seeded shuffling with a resumable position,
and collation into left-padded `DataProto` batches."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from baton.data import DataProto


class PromptDataset:
    """Examples with a prompt and a ground-truth answer; any other fields ride along to the reward.

    Each example is a dict; `prompt_key` and `answer_key` name its prompt and answer fields.
    """

    def __init__(self, examples: Sequence[dict[str, Any]], prompt_key: str = "prompt", answer_key: str = "answer"):
        for i, example in enumerate(examples):
            for key in (prompt_key, answer_key):
                if key not in example:
                    raise ValueError(f"example {i} has no {key!r} field (fields: {sorted(example)}); "
                                     f"set prompt_key/answer_key to the names your data uses")
        self.examples = list(examples)
        self.prompt_key, self.answer_key = prompt_key, answer_key

    @classmethod
    def from_file(cls, path: str, prompt_key: str = "prompt", answer_key: str = "answer") -> "PromptDataset":
        """Read a `.jsonl` (one JSON object per line) or `.parquet` file."""
        if not os.path.isfile(path):
            raise FileNotFoundError(f"prompt file {path} does not exist")
        if path.endswith(".jsonl"):
            with open(path) as f:
                examples = [json.loads(line) for line in f if line.strip()]
        elif path.endswith(".parquet"):
            try:
                import pyarrow.parquet as pq
            except ImportError:
                raise ImportError("reading parquet needs pyarrow: pip install pyarrow") from None
            examples = pq.read_table(path).to_pylist()
        else:
            raise ValueError(f"{path}: prompt files must end in .jsonl or .parquet")
        return cls(examples, prompt_key, answer_key)

    def one_response_per_row(self, key: str) -> "PromptDataset":
        """Field `key` may hold a list of responses to one prompt (several demonstrations): a dataset with
        one row per response, the list replaced by that response. Rows holding a single value stay as they are."""
        def rows(example: dict[str, Any]) -> list[dict[str, Any]]:
            value = example.get(key)
            return [{**example, key: r} for r in value] if isinstance(value, (list, tuple)) else [example]

        if not any(isinstance(e.get(key), (list, tuple)) for e in self.examples):
            return self
        return PromptDataset([row for example in self.examples for row in rows(example)], self.prompt_key, self.answer_key)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.examples[index]


@dataclass
class PromptSampler:
    """Seeded order over a dataset, epoch after epoch, with a position that checkpoints can save.

    Epoch e visits the examples in the permutation drawn from `seed + e` (or in file order when
    `shuffle` is off). `state_dict()` / `load_state_dict()` resume exactly where a run stopped.
    """

    num_examples: int
    seed: int = 0
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_examples)
        return np.random.default_rng(self.seed + self.epoch).permutation(self.num_examples)

    def next_indices(self, count: int) -> list[int]:
        if self.num_examples == 0:
            raise ValueError("cannot sample from an empty dataset")
        out = []
        while len(out) < count:
            order = self._order()
            take = min(count - len(out), self.num_examples - self.position)
            out.extend(int(i) for i in order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_examples:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"sampler state was saved with seed {state['seed']}, this run uses seed {self.seed}")
        self.epoch, self.position = state["epoch"], state["position"]


def collate_prompts(dataset: PromptDataset, indices: Sequence[int], tokenizer, max_prompt_len: int | None = None,
                    uid_offset: int = 0) -> DataProto:
    """Left-padded `input_ids` / `attention_mask` [rows, prompt_len] plus non-tensor `prompt`,
    `ground_truth`, `uid` (one id per prompt, for group-based advantages) and every other field."""
    examples = [dataset[i] for i in indices]
    prompts = [str(e[dataset.prompt_key]) for e in examples]
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
    if max_prompt_len is not None and input_ids.shape[1] > max_prompt_len:
        raise ValueError(f"a prompt has {input_ids.shape[1]} tokens, more than max_prompt_len={max_prompt_len}; "
                         "raise max_prompt_len or filter long prompts from the data")
    non_tensors: dict[str, Any] = {
        "prompt": prompts,
        "ground_truth": [str(e[dataset.answer_key]) for e in examples],
        "uid": np.arange(uid_offset, uid_offset + len(examples)),
    }
    extra = {k for e in examples for k in e} - {dataset.prompt_key, dataset.answer_key}
    for key in sorted(extra):
        non_tensors[key] = [e.get(key) for e in examples]
    return DataProto.from_dict({"input_ids": input_ids.long(), "attention_mask": attention_mask.long()}, non_tensors)


def collate_sft(dataset: PromptDataset, indices: Sequence[int], tokenizer, max_prompt_len: int | None = None,
                response_key: str | None = None) -> DataProto:
    """Supervised pairs in the generate() layout: prompts left-padded, then `responses` = the
    `response_key` field (default: the answer) + eos right-padded, with `response_mask` on it and
    the eos (what the SFT loss covers)."""
    prompts = collate_prompts(dataset, indices, tokenizer, max_prompt_len)
    key = response_key or dataset.answer_key
    missing = [i for i in indices if key not in dataset[i]]
    if missing:
        raise ValueError(f"example {missing[0]} has no {key!r} field to train on (fields: {sorted(dataset[missing[0]])}); "
                         "set data.response_key to the field holding the target response")
    answers = [tokenizer(str(dataset[i][key]), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
               for i in indices]
    response_len = max(len(a) for a in answers)
    responses = torch.full((len(answers), response_len), tokenizer.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(len(answers), response_len, dtype=torch.long)
    for row, answer in enumerate(answers):
        responses[row, : len(answer)] = torch.tensor(answer)
        response_mask[row, : len(answer)] = 1
    prompt_ids, prompt_mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    prompts.batch.update(
        prompts=prompt_ids, responses=responses, response_mask=response_mask,
        input_ids=torch.cat([prompt_ids, responses], dim=1), attention_mask=attention_mask,
        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0),
    )
    return prompts


__all__ = ["PromptDataset", "PromptSampler", "collate_prompts", "collate_sft"]
