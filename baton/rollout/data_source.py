"""The rollout data source: prompt groups of fresh `Sample`s from a dataset, after the groups put back in its buffer
(slime's RolloutDataSourceWithBuffer), with a state that checkpoints save."""

from __future__ import annotations

import copy
from typing import Any, Callable


from baton.datasets import DataError, PromptDataset, PromptSampler
from baton.datasets.prompts import group_seeds, sample_seed
from baton.rewards import DATA_SOURCE
from baton.rewards.routing import UNKNOWN_DATA_SOURCE
from baton.rollout.config import BUFFER_FILTERS
from baton.rollout.sample import Sample

BufferFilter = Callable[[list[list[Sample]], int], list[list[Sample]]]

_IMMUTABLE = (str, int, float, bool, type(None))


def take_first(buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """The default buffer filter: the first `num_groups` groups, oldest first (FIFO)."""
    return buffer[:num_groups]


class RolloutDataSource:
    """Groups of `num_samples_per_prompt` samples of one prompt: first the groups put back with `add_samples`, then
    fresh ones in the order of a seeded `PromptSampler` over `dataset`, epoch after epoch.

    A fresh group's samples are PENDING, with the prompt tokenized as `collate_prompts` does (no special tokens,
    unpadded), the dataset's answer as `label` (str), the row's other fields as `metadata` (`data_source` "unknown"
    where a dataset with that field lacks it in a row), a new `group_index` (a running counter) and a per-sample
    `seed` from (seed, group_index, sample_index) (`sample_seed`), so a group draws the same seeds whenever it runs.

    The buffer filter decides which buffered groups a call takes: `fn(buffer, num_groups) -> groups`, given a copy
    of the buffer (oldest group first) and the number of groups wanted, returns at most `num_groups` distinct groups
    of that list (the list objects themselves, in the order to hand them out); the data source removes exactly those
    from its buffer and fills the rest of the request from the dataset. The filter must not modify the groups. It
    is a callable, a name in `BUFFER_FILTERS` or an import path "package.module:fn"; the default (`take_first`)
    takes the oldest groups.

    `state_dict()` holds the sampler's position, the group counter and every buffered group (partly generated
    samples with their tokens, log-probs, versions and status), so a restored source continues exactly.
    """

    def __init__(self, dataset: PromptDataset, tokenizer, num_samples_per_prompt: int, seed: int = 0,
                 max_prompt_len: int | None = None, buffer_filter: str | BufferFilter | None = None):
        if num_samples_per_prompt < 1:
            raise ValueError(f"num_samples_per_prompt={num_samples_per_prompt}: a group needs at least one sample")
        if seed < 0:
            raise ValueError(f"seed={seed}: use a non-negative seed")
        self.dataset, self.tokenizer = dataset, tokenizer
        self.num_samples_per_prompt, self.seed, self.max_prompt_len = num_samples_per_prompt, seed, max_prompt_len
        self.buffer_filter_name = buffer_filter if isinstance(buffer_filter, str) else None
        self.buffer_filter: BufferFilter = (BUFFER_FILTERS.get(buffer_filter) if isinstance(buffer_filter, str)
                                            else buffer_filter or take_first)
        self.sampler = PromptSampler(len(dataset), seed=seed)
        self.next_group_index = 0
        self.buffer: list[list[Sample]] = []

    @property
    def num_buffered(self) -> int:
        """The number of groups in the buffer."""
        return len(self.buffer)

    def get_samples(self, num_groups: int) -> list[list[Sample]]:
        """`num_groups` groups: those the buffer filter takes from the buffer, then fresh ones from the dataset."""
        if num_groups < 0:
            raise ValueError(f"num_groups={num_groups}: ask for zero or more groups")
        groups = self._take_buffered(num_groups) if self.buffer else []
        groups += [self._new_group(index) for index in self.sampler.next_indices(num_groups - len(groups))]
        return groups

    def add_samples(self, groups: list[list[Sample]]) -> None:
        """Put `groups` back at the end of the buffer, each a non-empty list of samples of one group."""
        for number, group in enumerate(groups):
            if not isinstance(group, list) or not group:
                what = "empty" if isinstance(group, list) else f"a {type(group).__name__}"
                raise ValueError(f"add_samples: group {number} is {what}; pass a list of groups, each a non-empty "
                                 "list of Samples")
            if not all(isinstance(s, Sample) for s in group):
                bad = next(s for s in group if not isinstance(s, Sample))
                raise ValueError(f"add_samples: group {number} holds a {type(bad).__name__}; a group is a list of "
                                 "Samples")
            indices = sorted({s.group_index for s in group})
            if len(indices) != 1:
                raise ValueError(f"add_samples: group {number} mixes samples of groups {indices}; put each prompt "
                                 "group back as its own list")
        self.buffer.extend(groups)

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "next_group_index": self.next_group_index,
                "buffer": [[s.to_dict() for s in group] for group in self.buffer]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        expected = {"sampler", "next_group_index", "buffer"}
        if state.keys() != expected:
            raise ValueError(f"data source state has keys {sorted(state)}, expected {sorted(expected)}")
        self.sampler.load_state_dict(state["sampler"])
        self.next_group_index = int(state["next_group_index"])
        self.buffer = [[Sample.from_dict(d) for d in group] for group in state["buffer"]]

    def _take_buffered(self, num_groups: int) -> list[list[Sample]]:
        name = self.buffer_filter_name or getattr(self.buffer_filter, "__qualname__", repr(self.buffer_filter))
        chosen = list(self.buffer_filter(list(self.buffer), num_groups))
        ids = [id(group) for group in chosen]
        buffered = {id(group) for group in self.buffer}
        if len(chosen) > num_groups:
            raise ValueError(f"buffer filter {name} returned {len(chosen)} groups for a request of {num_groups}; "
                             "return at most num_groups")
        if len(set(ids)) != len(ids) or not buffered.issuperset(ids):
            raise ValueError(f"buffer filter {name} returned groups that are not distinct groups of the buffer it "
                             "was given; return elements of that list (the group lists themselves, not copies)")
        taken = set(ids)
        self.buffer = [group for group in self.buffer if id(group) not in taken]
        return chosen

    def _new_group(self, index: int) -> list[Sample]:
        dataset, example = self.dataset, self.dataset[index]
        prompt = example[dataset.prompt_key]
        if not isinstance(prompt, str):
            dataset.text_prompts()  # raises, naming the row
        prompt_ids = list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])
        if self.max_prompt_len is not None and len(prompt_ids) > self.max_prompt_len:
            raise DataError(f"{dataset.where(index)}: the prompt has {len(prompt_ids)} tokens, more than "
                            f"max_prompt_len={self.max_prompt_len}; raise data.max_prompt_len, or set "
                            "data.overlong_prompts: filter to drop such prompts when the data is loaded")
        label = str(example[dataset.answer_key]) if dataset.answer_key else None
        metadata = {key: example.get(key) for key in dataset.extra_fields}
        if DATA_SOURCE in metadata and metadata[DATA_SOURCE] is None:
            metadata[DATA_SOURCE] = UNKNOWN_DATA_SOURCE
        group_index, self.next_group_index = self.next_group_index, self.next_group_index + 1
        seeds = group_seeds(self.seed, group_index, self.num_samples_per_prompt)
        # Each sample its own metadata; a shallow copy where every value is immutable (the usual row: a few strings
        # and numbers), a deep one otherwise (deep-copying a thousand such rows takes the driver ~4 ms).
        own = dict.copy if all(isinstance(v, _IMMUTABLE) for v in metadata.values()) else copy.deepcopy
        return [Sample(group_index=group_index, sample_index=i, prompt=prompt, prompt_ids=list(prompt_ids),
                       label=label, seed=seeds[i], metadata=own(metadata))
                for i in range(self.num_samples_per_prompt)]


__all__ = ["BufferFilter", "RolloutDataSource", "sample_seed", "take_first"]
