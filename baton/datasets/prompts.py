"""Prompt datasets: examples from jsonl/parquet files or lists, checked when loaded, chat prompts rendered by the
tokenizer's template; seeded shuffling with a resumable position; collation into left-padded `DataProto` batches."""

from __future__ import annotations

import json
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
from baton.rewards.routing import DATA_SOURCE, UNKNOWN_DATA_SOURCE  # verl's field naming each row's source, and its default
from baton.rewards.routing import RewardRoutes, setting_collision

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
# Written by `render_chat` beside the rendered prompt: each prompt as the file held it (the messages of a chat prompt).
# Not in RESERVED_FIELDS: only a dataset with chat prompts writes it, so only there is a field of this name an error.
RAW_PROMPT = "raw_prompt"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
OVERLONG_PROMPTS = ("error", "filter")  # data.overlong_prompts: what loading does with a prompt over max_prompt_len
_TOKENIZE_CHUNK = 1024  # prompts tokenised at once when checking lengths
_SHORT = reprlib.Repr()  # values in messages, long ones cut in the middle
_SHORT.maxstring = _SHORT.maxother = 120


class PromptDataset:
    """Examples with a prompt and a ground-truth answer; any other fields ride along to the reward.

    Each example is a dict. `prompt_key` names its prompt: a non-empty string, or chat messages (a list of
    {"role", "content"} objects, rendered to text by `render_chat` before tokenising). `answer_key` names its answer:
    a string or a number, not null (the reward gets it as text); with `answer_key=None` rows need none (prompts to
    generate from) and batches have no `ground_truth`. `response_key`, if set, names the field SFT trains on (kept
    from the reward). Every other field is passed to the reward function as a keyword argument, so none may have a
    name in `RESERVED_FIELDS`. The constructor checks all of this and raises DataError naming the first bad row.

    A key may be a dotted path into nested objects, as verl's rows keep the answer in
    `reward_model.ground_truth`; a top-level field whose name is the whole key, dots and all, wins over the path.
    The path's value is copied to a top-level field named by the key, so `example[key]` reads every key, dotted or
    not. The nested object itself is not an own field: it still rides along whole (the reward gets `reward_model`
    with its ground truth inside, as verl's reward functions do, and the answer again as its second argument).

    `source` (the file) and `positions` (each example's place in it, counted in `unit`: "line" or "row") name the
    rows in errors; without a source, rows are "example <index>".
    """

    def __init__(self, examples: Sequence[dict[str, Any]], prompt_key: str = "prompt",
                 answer_key: str | None = "answer", response_key: str | None = None, *, source: str | None = None,
                 positions: Sequence[int] | None = None, unit: str = "row"):
        self.prompt_key, self.answer_key, self.response_key = prompt_key, answer_key, response_key
        self.source, self.unit = source, unit
        self.positions = np.arange(len(examples)) if positions is None else np.asarray(positions, dtype=np.int64)
        assert len(self.positions) == len(examples), "one position per example"
        self.own_fields = {key for key in (prompt_key, answer_key, response_key) if key}
        self.examples = []
        for index, example in enumerate(examples):
            if isinstance(example, dict):
                example = _with_paths_copied(example, self.own_fields)
            problem = self._problem(example)
            if problem is not None:
                raise DataError(f"{self.where(index)}: {problem}")
            self.examples.append(example)
        # Every batch gets every field some row has (a row without it: None), so batches share their columns.
        self.extra_fields = sorted({k for e in self.examples for k in e} - self.own_fields)

    @classmethod
    def from_file(cls, path: str, prompt_key: str = "prompt", answer_key: str | None = "answer",
                  response_key: str | None = None) -> "PromptDataset":
        """Read and check a `.jsonl` (one JSON object per line) or `.parquet` file."""
        example = {key: "..." for key in (prompt_key, answer_key) if key}  # a row with the data's own field names
        rows, positions, unit = read_rows(path, example)
        if not rows:
            raise DataError(f"{path}: the file has no rows; a prompt file needs at least one "
                            f"(a .jsonl file: one JSON object per line, such as {json.dumps(example)})")
        return cls(rows, prompt_key, answer_key, response_key, source=path, positions=positions, unit=unit)

    def where(self, index: int) -> str:
        """Where example `index` came from, for messages: "train.jsonl, line 7", "val.parquet, row 3", "example 2"."""
        position = int(self.positions[index])
        return f"{self.source}, {self.unit} {position}" if self.source else f"example {position}"

    def _problem(self, example: Any) -> str | None:
        """What is wrong with `example`, or None."""
        prompt_key, answer_key = self.prompt_key, self.answer_key
        if not isinstance(example, dict):
            answer = f', "{answer_key}": "..."' if answer_key else ""
            return f'a row must be a JSON object such as {{"{prompt_key}": "..."{answer}}}, not {_describe(example)}'
        if prompt_key not in example:
            return f"{_missing(example, prompt_key)}; set data.prompt_key to the field that holds the prompt"
        prompt = example[prompt_key]
        if isinstance(prompt, (list, tuple)):
            problem = _messages_problem(prompt)
            if problem is not None:
                return f"the prompt {prompt_key!r} is a list, so chat messages, but {problem}"
        elif not isinstance(prompt, str) or not prompt.strip():
            return (f"the prompt {prompt_key!r} is {_describe(prompt)}; it must be a non-empty string "
                    'or a list of chat messages such as [{"role": "user", "content": "..."}]')
        problem = self._answer_problem(example) if answer_key else None
        if problem is not None:
            return problem
        reserved = sorted((example.keys() & RESERVED_FIELDS.keys()) - self.own_fields)
        if reserved:
            name = reserved[0]
            return f"the field {name!r} has a name baton reserves: baton {RESERVED_FIELDS[name]}; {_reserved_fix(name)}"
        return None

    def _answer_problem(self, example: dict[str, Any]) -> str | None:
        """What is wrong with `example`'s answer, or None."""
        answer_key = self.answer_key
        if answer_key not in example:
            return (f"{_missing(example, answer_key)}; set data.answer_key to the field that holds the answer the "
                    f"reward checks{_verl_answer_hint(example, answer_key)}")
        answer = example[answer_key]
        if not isinstance(answer, (str, numbers.Real)) or (isinstance(answer, float) and not math.isfinite(answer)):
            hint = ("; to train SFT on several demonstrations, put them in another field and set data.response_key"
                    if isinstance(answer, list) else "")
            return (f"the answer {answer_key!r} is {_describe(answer)}; it must be a string or a number "
                    f"(the reward gets it as text){hint}")
        return None

    def check_reward_settings(self, rewards: RewardRoutes) -> "PromptDataset":
        """This dataset, unless one of its fields is named like a setting of one of `rewards`' functions (a keyword
        parameter with a default, or a reward_kwargs key), which a row would set: DataError naming the file, the
        first row with that field, and the fix."""
        fields = set(self.extra_fields)
        for reward in rewards.rewards.values():
            taken = reward.settings & fields
            if taken:
                name = min(taken)
                index = next(i for i, example in enumerate(self.examples) if name in example)
                raise DataError(f"{self.where(index)}: {setting_collision(reward.name, name)}")
        return self

    def render_chat(self, tokenizer) -> "PromptDataset":
        """This dataset when every prompt is text. Otherwise the dataset with each chat prompt replaced by its text,
        `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)` (text prompts stay as
        they are), and every row's prompt as the file held it (messages or text) in the field `raw_prompt`, which
        rides along to the reward. DataError when the tokenizer has no chat template, when its template fails on a
        row, or when a row already has a `raw_prompt` field."""
        chat = [i for i, e in enumerate(self.examples) if not isinstance(e[self.prompt_key], str)]
        if not chat:
            return self
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError(f"{self.where(chat[0])}: the prompt is chat messages, but the tokenizer in "
                            f"{tokenizer.name_or_path} has no chat template to render them with; use the tokenizer of "
                            "a chat (instruct) model, add a template to that directory (a chat_template.jinja file), "
                            "or store the prompts as text")
        clash = next((i for i, e in enumerate(self.examples) if RAW_PROMPT in e), None)
        if clash is not None:
            raise DataError(f"{self.where(clash)}: the field {RAW_PROMPT!r} has the name baton gives each prompt as "
                            "the file held it when the data has chat prompts; rename the field")
        texts = [e[self.prompt_key] for e in self.examples]
        for start in range(0, len(chat), _TOKENIZE_CHUNK):
            rows = chat[start : start + _TOKENIZE_CHUNK]
            for row, text in zip(rows, self._apply_chat_template(tokenizer, rows)):
                texts[row] = text
        rows = [{**e, self.prompt_key: text, RAW_PROMPT: e[self.prompt_key]} for e, text in zip(self.examples, texts)]
        return self._with_rows(rows, self.positions)

    def _apply_chat_template(self, tokenizer, rows: list[int]) -> list[str]:
        """The rendered text of the chat prompts of `rows`; a failing template is a DataError naming its row."""
        import jinja2  # transformers renders chat templates with it

        conversations = [list(self.examples[i][self.prompt_key]) for i in rows]
        try:
            return tokenizer.apply_chat_template(conversations, tokenize=False, add_generation_prompt=True)
        except jinja2.TemplateError:
            for row, messages in zip(rows, conversations):  # which row: render them one at a time
                try:
                    tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                except jinja2.TemplateError as e:
                    raise DataError(f"{self.where(row)}: the chat template of the tokenizer in "
                                    f"{tokenizer.name_or_path} fails on the prompt's messages: {e}") from e
            raise

    def text_prompts(self) -> list[str]:
        """Every example's prompt; ValueError when some are still chat messages (see `render_chat`)."""
        prompts = [e[self.prompt_key] for e in self.examples]
        chat = next((i for i, p in enumerate(prompts) if not isinstance(p, str)), None)
        if chat is not None:
            raise ValueError(f"{self.where(chat)}: the prompt is chat messages; render the dataset's chat prompts "
                             "to text first, with dataset.render_chat(tokenizer)")
        return prompts

    def check_prompt_lengths(self, tokenizer, max_prompt_len: int, overlong: str = "error") -> "PromptDataset":
        """This dataset when every prompt is at most `max_prompt_len` tokens. Otherwise, by `overlong`: "error"
        raises DataError naming the first longer prompt; "filter" returns the dataset without them and says how
        many it dropped. Chat prompts must be rendered first (`render_chat`): the length is the rendered text's."""
        if overlong not in OVERLONG_PROMPTS:
            raise ValueError(f"overlong {overlong!r} is not one of {OVERLONG_PROMPTS}")
        prompts = self.text_prompts()
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


# A prompt batch's non-tensor column: each prompt's sampling seeds (`group_seeds`), so that a sample's tokens are a
# function of (run seed, the prompt's group index, sample index) whichever path generates it.
SAMPLE_SEEDS = "sample_seeds"


def group_seeds(seed: int, group_index: int, num_samples: int) -> list[int]:
    """The sampling seeds of a group's samples, each in [0, 2**62): sample i's a function of (seed, group_index, i)
    only (one SeedSequence per group: the driver draws a step's thousand seeds in a few calls)."""
    state = np.random.SeedSequence([seed, group_index]).generate_state(num_samples, np.uint64)
    return [int(value) >> 2 for value in state]


def sample_seed(seed: int, group_index: int, sample_index: int) -> int:
    """The sampling seed of one sample (see `group_seeds`)."""
    return group_seeds(seed, group_index, sample_index + 1)[sample_index]


def collate_prompts(dataset: PromptDataset, indices: Sequence[int], tokenizer, max_prompt_len: int | None = None,
                    uid_offset: int = 0, seed: int | None = None, num_samples: int = 1) -> DataProto:
    """Left-padded `input_ids` / `attention_mask` [rows, prompt_len] plus non-tensor `prompt`,
    `ground_truth` (unless the dataset has no answer_key), `uid` (one id per prompt, for group-based advantages)
    and every other field of the dataset, None in a row without it; `data_source` (verl's name for a row's source)
    is "unknown" there instead. With a `seed`, also `sample_seeds`: each prompt's `num_samples` sampling seeds,
    `group_seeds(seed, uid, num_samples)`, the rollout system's rule, so the generate call samples what the rollout
    system would for the group of that index.
    Chat prompts must be rendered first (`PromptDataset.render_chat`); `prompt` is then the rendered text."""
    examples = [dataset[i] for i in indices]
    prompts = [e[dataset.prompt_key] for e in examples]
    if not all(isinstance(p, str) for p in prompts):
        dataset.text_prompts()  # raises, naming the row
    tokenizer.padding_side = "left"
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
    if max_prompt_len is not None and input_ids.shape[1] > max_prompt_len:  # a last guard: loading checks lengths
        row = int(attention_mask.sum(-1).argmax())
        raise DataError(f"{dataset.where(indices[row])}: the prompt has {input_ids.shape[1]} tokens, more than "
                        f"max_prompt_len={max_prompt_len}; raise data.max_prompt_len, or set data.overlong_prompts: "
                        "filter to drop such prompts when the data is loaded")
    non_tensors: dict[str, Any] = {"prompt": prompts}
    if dataset.answer_key:
        non_tensors["ground_truth"] = [str(e[dataset.answer_key]) for e in examples]
    non_tensors["uid"] = np.arange(uid_offset, uid_offset + len(examples))
    if seed is not None:
        non_tensors[SAMPLE_SEEDS] = [tuple(group_seeds(seed, int(uid), num_samples)) for uid in non_tensors["uid"]]
    for key in dataset.extra_fields:
        non_tensors[key] = [e.get(key) for e in examples]
    if DATA_SOURCE in non_tensors:
        non_tensors[DATA_SOURCE] = [UNKNOWN_DATA_SOURCE if s is None else s for s in non_tensors[DATA_SOURCE]]
    return DataProto.from_dict({"input_ids": input_ids.long(), "attention_mask": attention_mask.long()}, non_tensors)


def collate_sft(dataset: PromptDataset, indices: Sequence[int], tokenizer, max_prompt_len: int | None = None,
                response_key: str | None = None) -> DataProto:
    """Supervised pairs in the generate() layout: prompts left-padded, then `responses` = the
    `response_key` field (default: the answer) + eos right-padded, with `response_mask` on it and
    the eos (what the SFT loss covers)."""
    prompts = collate_prompts(dataset, indices, tokenizer, max_prompt_len)
    key = response_key or dataset.answer_key
    if key is None:
        raise ValueError("collate_sft needs the field to train on: pass response_key, or a dataset with an answer_key")
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


def _with_paths_copied(example: dict[str, Any], keys: set[str]) -> dict[str, Any]:
    """`example` with the value of each dotted key in `keys` that is not a top-level field but a path to a value
    copied to a top-level field of that name; `example` itself when there is none."""
    found = {}
    for key in keys:
        if "." in key and key not in example:
            value = _follow(example, key)
            if value is not _NOT_FOUND:
                found[key] = value
    return {**example, **found} if found else example


_NOT_FOUND = object()


def has_field(example: dict[str, Any], key: str) -> bool:
    """Whether `example` has the field `key`, or the nested field a dotted `key` names (as data keys may)."""
    return key in example or _follow(example, key) is not _NOT_FOUND


def _follow(example: dict[str, Any], key: str) -> Any:
    """The value at the dotted path `key` in `example`, or _NOT_FOUND."""
    value = example
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _NOT_FOUND
        value = value[part]
    return value


def _missing(example: dict[str, Any], key: str) -> str:
    """Why `example` has no field `key`, naming the fields there are at the level where a dotted path stops."""
    if "." not in key:
        return f"no {key!r} field (fields: {sorted(example)})"
    value, walked = example, []
    for part in key.split("."):
        if not isinstance(value, dict):
            return f"no {key!r} field: {'.'.join(walked)!r} is {_describe(value)}, so it holds no {part!r} field"
        if part not in value:
            where = f"{'.'.join(walked)!r} has no {part!r} field" if walked else f"no {part!r} field"
            return f"no {key!r} field: {where} (fields there: {sorted(value)})"
        value, walked = value[part], [*walked, part]
    raise AssertionError(f"{key!r} is in the example")


def _verl_answer_hint(example: dict[str, Any], answer_key: str) -> str:
    """A hint for rows in verl's layout, which keep the answer in reward_model.ground_truth."""
    verl_key = "reward_model.ground_truth"
    if answer_key != verl_key and _follow(example, verl_key) is not _NOT_FOUND:
        return f"; these rows keep it where verl does: set data.answer_key: {verl_key}"
    return ""


def _messages_problem(messages: Sequence[Any]) -> str | None:
    """What is wrong with a chat prompt's list of messages, or None."""
    if not messages:
        return "the list is empty; a chat prompt needs at least one message"
    for number, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            return (f"message {number} is {_describe(message)}; each message must be an object with a string "
                    '"role" and a string "content", such as {"role": "user", "content": "..."}')
        if message["role"] not in CHAT_ROLES:
            return f"message {number} has the role {message['role']!r}; a role is one of {', '.join(CHAT_ROLES)}"
    return None


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


__all__ = ["CHAT_ROLES", "OVERLONG_PROMPTS", "RAW_PROMPT", "RESERVED_FIELDS", "PromptDataset", "PromptSampler",
           "collate_prompts", "collate_sft"]
