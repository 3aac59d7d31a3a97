"""RolloutDataSource: fresh groups in the sampler's order, the buffer first, buffer filters, exact resume."""

from __future__ import annotations

import json

import pytest

from baton.config import ConfigError
from baton.datasets import DataError, PromptDataset, PromptSampler, arithmetic_splits
from baton.models import load_tokenizer
from baton.rollout import RolloutDataSource, Sample, Status, sample_seed


def most_generated_first(buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
    """A buffer filter (loaded by import path below): the groups with the most generated tokens first."""
    return sorted(buffer, key=lambda group: -sum(s.response_length for s in group))[:num_groups]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def train():
    return arithmetic_splits(max_operand=3, num_val=4)[0]  # 12 problems: a few calls cross an epoch


def source(train, tokenizer, **kwargs) -> RolloutDataSource:
    return RolloutDataSource(train, tokenizer, num_samples_per_prompt=kwargs.pop("n", 2), seed=kwargs.pop("seed", 3),
                             **kwargs)


def generate_some(group: list[Sample], num_tokens: int, version: int) -> None:
    """Stand in for a rollout cut off part way: tokens, log-probs and versions appended, status left pending."""
    for sample in group:
        for _ in range(num_tokens):
            sample.response_ids.append(10 + sample.sample_index)
            sample.rollout_log_probs.append(-0.25 * sample.response_length)
            sample.weight_versions.append(version)


def test_fresh_groups_follow_the_sampler(train, tokenizer):
    data = source(train, tokenizer, n=3)
    groups = data.get_samples(14)  # more than one epoch of 12
    order = PromptSampler(len(train), seed=3).next_indices(14)
    assert [g[0].group_index for g in groups] == list(range(14))
    for group, index in zip(groups, order):
        example = train[index]
        assert [s.sample_index for s in group] == [0, 1, 2]
        for s in group:
            assert s.prompt == example["prompt"] and s.label == example["answer"]
            assert s.prompt_ids == tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
            assert s.metadata == {"teacher_answers": example["teacher_answers"]}
            assert s.status is Status.PENDING and s.response_ids == [] and s.reward is None
            assert s.seed == sample_seed(3, s.group_index, s.sample_index)
    seeds = [s.seed for g in groups for s in g]
    assert len(set(seeds)) == len(seeds) and all(0 <= x < 2**62 for x in seeds)
    assert groups[0][0].metadata is not groups[0][1].metadata
    answers = [s.metadata["teacher_answers"] for s in groups[0]]
    assert isinstance(answers[0], list) and answers[0] is not answers[1]  # a mutable field is each sample's own


def test_seeds_depend_on_the_sample_only():
    assert sample_seed(3, 5, 1) == sample_seed(3, 5, 1)
    assert len({sample_seed(3, 5, 1), sample_seed(3, 5, 0), sample_seed(3, 4, 1), sample_seed(4, 5, 1)}) == 4


def test_data_source_field_defaults_to_unknown(tokenizer):
    dataset = PromptDataset([{"prompt": "1+1=", "answer": 2, "data_source": "math"}, {"prompt": "2+2=", "answer": 4}])
    data = RolloutDataSource(dataset, tokenizer, num_samples_per_prompt=1, seed=0)
    sampler = PromptSampler(2, seed=0)
    by_prompt = {g[0].prompt: g[0] for g in data.get_samples(2)}
    assert [dataset[i]["prompt"] for i in sampler.next_indices(2)] == [g for g in by_prompt]
    assert by_prompt["1+1="].metadata == {"data_source": "math"} and by_prompt["1+1="].label == "2"
    assert by_prompt["2+2="].metadata == {"data_source": "unknown"}


def test_buffer_first_then_fresh(train, tokenizer):
    data = source(train, tokenizer)
    first = data.get_samples(3)
    data.add_samples([first[2], first[0]])
    assert data.num_buffered == 2
    groups = data.get_samples(3)
    assert groups[0] is first[2] and groups[1] is first[0]
    assert groups[2][0].group_index == 3
    assert groups[2][0].prompt == train[PromptSampler(len(train), seed=3).next_indices(4)[3]]["prompt"]
    assert data.num_buffered == 0
    data.add_samples([first[1], first[2]])
    assert data.get_samples(1) == [first[1]] and data.num_buffered == 1
    assert data.get_samples(0) == [] and data.num_buffered == 1


def test_buffer_filter_by_import_path(train, tokenizer):
    data = source(train, tokenizer, buffer_filter="test_rollout_data_source:most_generated_first")
    groups = data.get_samples(4)
    for group, num_tokens in zip(groups, [1, 3, 0, 2]):
        generate_some(group, num_tokens, version=0)
    data.add_samples(groups)
    taken = data.get_samples(2)
    assert taken[0] is groups[1] and taken[1] is groups[3]
    assert data.buffer == [groups[0], groups[2]]  # exactly the taken ones removed, order kept
    assert data.get_samples(3)[:2] == [groups[0], groups[2]]


def test_bad_buffer_filters(train, tokenizer):
    with pytest.raises(ConfigError, match="no attribute 'nope'"):
        source(train, tokenizer, buffer_filter="test_rollout_data_source:nope")
    copies = source(train, tokenizer, buffer_filter=lambda buffer, n: [list(g) for g in buffer[:n]])
    copies.add_samples(copies.get_samples(2))
    with pytest.raises(ValueError, match="not distinct groups of the buffer.*not copies"):
        copies.get_samples(2)
    greedy = source(train, tokenizer, buffer_filter=lambda buffer, n: buffer)
    greedy.add_samples(greedy.get_samples(3))
    with pytest.raises(ValueError, match="returned 3 groups for a request of 2"):
        greedy.get_samples(2)
    twice = source(train, tokenizer, buffer_filter=lambda buffer, n: [buffer[0], buffer[0]])
    twice.add_samples(twice.get_samples(2))
    with pytest.raises(ValueError, match="not distinct"):
        twice.get_samples(2)


def test_add_samples_validates(train, tokenizer):
    data = source(train, tokenizer)
    a, b = data.get_samples(2)
    with pytest.raises(ValueError, match="group 1 is empty"):
        data.add_samples([a, []])
    with pytest.raises(ValueError, match="group 0 is a tuple"):
        data.add_samples([tuple(a)])
    with pytest.raises(ValueError, match="group 0 holds a dict"):
        data.add_samples([[a[0].to_dict()]])
    with pytest.raises(ValueError, match=r"group 0 mixes samples of groups \[0, 1\]"):
        data.add_samples([[a[0], b[0]]])
    assert data.num_buffered == 0


def test_max_prompt_len(train, tokenizer):
    data = source(train, tokenizer, max_prompt_len=3)  # "1+2=" is 4 tokens
    with pytest.raises(DataError, match="more than max_prompt_len=3"):
        data.get_samples(1)


def test_state_resumes_exactly(train, tokenizer):
    data = source(train, tokenizer)
    groups = data.get_samples(5)
    generate_some(groups[1], 2, version=4)
    groups[1][0].status = Status.ABORTED
    data.add_samples([groups[3], groups[1]])
    state = json.loads(json.dumps(data.state_dict()))  # JSON-safe
    assert state["next_group_index"] == 5 and len(state["buffer"]) == 2
    restored = source(train, tokenizer)
    restored.load_state_dict(state)
    assert restored.num_buffered == 2
    assert restored.buffer[1][0].response_ids == [10, 10] and restored.buffer[1][0].status is Status.ABORTED
    assert restored.buffer[1][1].weight_versions == [4, 4]
    for num_groups in (1, 4, 12):  # the buffer, then fresh groups across the epoch boundary
        ours = [[s.to_dict() for s in g] for g in data.get_samples(num_groups)]
        theirs = [[s.to_dict() for s in g] for g in restored.get_samples(num_groups)]
        assert ours == theirs
    assert data.state_dict() == restored.state_dict()
    assert ours[0][0]["group_index"] == 8


def test_state_refuses_another_seed(train, tokenizer):
    state = source(train, tokenizer).state_dict()
    with pytest.raises(ValueError, match="seed 3, this run uses seed 4"):
        source(train, tokenizer, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="expected"):
        source(train, tokenizer).load_state_dict({**state, "extra": 1})
