"""Prompt datasets: examples from jsonl/parquet files or lists, checked when loaded; seeded shuffling with a
resumable position; collation into left-padded `DataProto` batches."""

from __future__ import annotations

import math
import numbers
import reprlib
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from baton.data import DataProto
from baton.datasets.files import DataError, read_rows

# The columns baton writes into a batch beside a dataset's own fields, and the reward function's arguments: a data
# field of one of these names would overwrite baton's column (or clash with the argument), so it is an error when
# the data is loaded. Every other field rides along to the reward function as a keyword argument.
_TENSOR_COLUMNS = ("input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask",
                   "rollout_log_probs", "log_probs", "entropy", "old_log_probs", "ref_log_probs", "values", "scores",
                   "token_level_scores", "token_level_rewards", "advantages", "returns")
RESERVED_FIELDS: dict[str, str] = {
    "prompt": "writes the prompt text (the data.prompt_key field) to the batch column 'prompt'",
    "ground_truth": "writes the answer (the data.answer_key field) to the batch column 'ground_truth' and passes it "
                    "to the reward function as its second argument",
    "response": "passes the decoded response to the reward function as its first argument, 'response'",
    "uid": "writes each prompt's group id to the batch column 'uid' (GRPO compares the samples of one uid)",
    "finish_reason": "writes 'stop' or 'length' for each response to the batch column 'finish_reason'",
    "response_text": "writes the decoded response to the batch column 'response_text'",
    **{name: f"keeps the tensor {name!r} in its batches" for name in _TENSOR_COLUMNS},
}
OVERLONG_PROMPTS = ("error", "filter")  # data.overlong_prompts: what loading does with a prompt over max_prompt_len
_TOKENIZE_CHUNK = 1024  # prompts tokenised at once when checking lengths
_SHORT = reprlib.Repr()  # values in messages, long ones cut in the middle
_SHORT.maxstring = _SHORT.maxother = 120


class PromptDataset:
    """Examples with a prompt and a ground-truth answer; any other fields ride along to the reward.

    Each example is a dict. `prompt_key` names its prompt (a non-empty string), `answer_key` its answer (a string or a
    number, not null; the reward gets it as text) and `response_key`, if set, the field SFT trains on (kept from the
    reward). Every other field is passed to the reward function as a keyword argument, so none may have a name in
    `RESERVED_FIELDS`. The constructor checks all of this and raises DataError naming the first bad row.

    `source` (the file) and `positions` (each example's place in it, counted in `unit`: "line" or "row") name the
    rows in errors; without a source, rows are "example <index>".
    """

    def __init__(self, examples: Sequence[dict[str, Any]], prompt_key: str = "prompt", answer_key: str = "answer",
                 response_key: str | None = None, *, source: str | None = None, positions: Sequence[int] | None = None,
                 unit: str = "row"):
        self.examples = list(examples)
        self.prompt_key, self.answer_key, self.response_key = prompt_key, answer_key, response_key
        self.source, self.unit = source, unit
        self.positions = np.arange(len(self.examples)) if positions is None else np.asarray(positions, dtype=np.int64)
        assert len(self.positions) == len(self.examples), "one position per example"
        self.own_fields = {prompt_key, answer_key} | ({response_key} if response_key else set())
        for index, example in enumerate(self.examples):
            problem = self._problem(example)
            if problem is not None:
                raise DataError(f"{self.where(index)}: {problem}")

    @classmethod
    def from_file(cls, path: str, prompt_key: str = "prompt", answer_key: str = "answer",
                  response_key: str | None = None) -> "PromptDataset":
        """Read and check a `.jsonl` (one JSON object per line) or `.parquet` file."""
        rows, positions, unit = read_rows(path)
        if not rows:
            raise DataError(f"{path}: the file has no rows; a prompt file needs at least one "
                            '(a .jsonl file: one JSON object per line, such as {"prompt": "...", "answer": "..."})')
        return cls(rows, prompt_key, answer_key, response_key, source=path, positions=positions, unit=unit)

    def where(self, index: int) -> str:
        """Where example `index` came from, for messages: "train.jsonl, line 7", "val.parquet, row 3", "example 2"."""
        position = int(self.positions[index])
        return f"{self.source}, {self.unit} {position}" if self.source else f"example {position}"

    def _problem(self, example: Any) -> str | None:
        """What is wrong with `example`, or None."""
        prompt_key, answer_key = self.prompt_key, self.answer_key
        if not isinstance(example, dict):
            return (f'a row must be a JSON object such as {{"{prompt_key}": "...", "{answer_key}": "..."}}, '
                    f"not {_describe(example)}")
        if prompt_key not in example:
            return (f"no {prompt_key!r} field (fields: {sorted(example)}); "
                    "set data.prompt_key to the field that holds the prompt")
        prompt = example[prompt_key]
        if isinstance(prompt, (list, tuple)):
            return (f"the prompt {prompt_key!r} is a list (chat messages?); baton takes prompts as plain text for now: "
                    "store the text the model should see, e.g. "
                    "tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)")
        if not isinstance(prompt, str) or not prompt.strip():
            return f"the prompt {prompt_key!r} is {_describe(prompt)}; it must be a non-empty string"
        if answer_key not in example:
            return (f"no {answer_key!r} field (fields: {sorted(example)}); "
                    "set data.answer_key to the field that holds the answer the reward checks")
        answer = example[answer_key]
        if not isinstance(answer, (str, numbers.Real)) or (isinstance(answer, float) and not math.isfinite(answer)):
            hint = ("; to train SFT on several demonstrations, put them in another field and set data.response_key"
                    if isinstance(answer, list) else "")
            return (f"the answer {answer_key!r} is {_describe(answer)}; it must be a string or a number "
                    f"(the reward gets it as text){hint}")
        reserved = sorted((example.keys() & RESERVED_FIELDS.keys()) - self.own_fields)
        if reserved:
            name = reserved[0]
            return f"the field {name!r} has a name baton reserves: baton {RESERVED_FIELDS[name]}; {_reserved_fix(name)}"
        return None

    def check_prompt_lengths(self, tokenizer, max_prompt_len: int, overlong: str = "error") -> "PromptDataset":
        """This dataset when every prompt is at most `max_prompt_len` tokens. Otherwise, by `overlong`: "error"
        raises DataError naming the first longer prompt; "filter" returns the dataset without them and says how
        many it dropped."""
        if overlong not in OVERLONG_PROMPTS:
            raise ValueError(f"overlong {overlong!r} is not one of {OVERLONG_PROMPTS}")
        prompts = [e[self.prompt_key] for e in self.examples]
        lengths = np.zeros(len(prompts), dtype=np.int64)
        for start in range(0, len(prompts), _TOKENIZE_CHUNK):
            ids = tokenizer(prompts[start : start + _TOKENIZE_CHUNK], add_special_tokens=False)["input_ids"]
            lengths[start : start + len(ids)] = [len(row) for row in ids]
        longer = np.flatnonzero(lengths > max_prompt_len)
        if not len(longer):
            return self
        name = self.source or "the dataset"
        if overlong == "error":
            first = int(longer[0])
            raise DataError(f"{self.where(first)}: the prompt has {lengths[first]} tokens, more than "
                            f"data.max_prompt_len={max_prompt_len} ({len(longer)} of {len(self)} prompts are longer); "
                            "raise data.max_prompt_len, shorten those prompts, or set "
                            "data.overlong_prompts: filter to drop them")
        if len(longer) == len(self):
            raise DataError(f"{name}: all {len(self)} prompts are longer than data.max_prompt_len={max_prompt_len} "
                            "tokens, so data.overlong_prompts: filter leaves none; raise data.max_prompt_len")
        print(f"baton: {name}: dropped {len(longer)} of {len(self)} prompts longer than data.max_prompt_len="
              f"{max_prompt_len} tokens (data.overlong_prompts: filter)", file=sys.stderr)
        keep = np.flatnonzero(lengths <= max_prompt_len)
        return self._with_rows([self.examples[i] for i in keep], self.positions[keep])

    def one_response_per_row(self, key: str) -> "PromptDataset":
        """Field `key` may hold a list of responses to one prompt (several demonstrations): a dataset with
        one row per response, the list replaced by that response. Rows holding a single value stay as they are."""
        if not any(isinstance(e.get(key), (list, tuple)) for e in self.examples):
            return self
        rows, positions = [], []
        for example, position in zip(self.examples, self.positions):
            value = example.get(key)
            expanded = [{**example, key: r} for r in value] if isinstance(value, (list, tuple)) else [example]
            rows += expanded
            positions += [position] * len(expanded)
        return self._with_rows(rows, positions)

    def _with_rows(self, examples: list[dict[str, Any]], positions: Sequence[int]) -> "PromptDataset":
        return PromptDataset(examples, self.prompt_key, self.answer_key, self.response_key, source=self.source,
                             positions=positions, unit=self.unit)

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
    prompts = [e[dataset.prompt_key] for e in examples]  # non-empty strings: checked when the dataset was made
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
    if max_prompt_len is not None and input_ids.shape[1] > max_prompt_len:  # a last guard: loading checks lengths
        row = int(attention_mask.sum(-1).argmax())
        raise DataError(f"{dataset.where(indices[row])}: the prompt has {input_ids.shape[1]} tokens, more than "
                        f"max_prompt_len={max_prompt_len}; raise data.max_prompt_len, or set data.overlong_prompts: "
                        "filter to drop such prompts when the data is loaded")
    non_tensors: dict[str, Any] = {
        "prompt": prompts,
        "ground_truth": [str(e[dataset.answer_key]) for e in examples],
        "uid": np.arange(uid_offset, uid_offset + len(examples)),
    }
    extra = {k for e in examples for k in e} - dataset.own_fields
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
    missing = [i for i in indices if dataset[i].get(key) is None]
    if missing:
        raise DataError(f"{dataset.where(missing[0])}: no {key!r} to train on (missing or null; fields: "
                        f"{sorted(dataset[missing[0]])}); set data.response_key to the field holding the target response")
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


def _describe(value: Any) -> str:
    """A value as its JSON kind and a clipped repr, for messages: "null", "a number (5)", "a string ('')"."""
    if value is None:
        return "null"
    kind = ("a boolean" if isinstance(value, bool) else "a number" if isinstance(value, numbers.Number)
            else "a string" if isinstance(value, str) else "a list" if isinstance(value, (list, tuple))
            else "an object" if isinstance(value, dict) else f"a {type(value).__name__}")
    return f"{kind} ({_SHORT.repr(value)})"


def _reserved_fix(name: str) -> str:
    if name == "prompt":
        return "if it is the prompt, set data.prompt_key: prompt; else rename the field"
    if name == "ground_truth":
        return "if it is the answer, set data.answer_key: ground_truth; else rename the field"
    if name == "response":
        return "if SFT should train on it, set data.response_key: response; else rename the field"
    return "rename the field"


__all__ = ["OVERLONG_PROMPTS", "RESERVED_FIELDS", "PromptDataset", "PromptSampler", "collate_prompts", "collate_sft"]
