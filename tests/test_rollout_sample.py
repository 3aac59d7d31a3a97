"""Sample: its invariants, JSON round trip and conversion to a training batch; rollout dumps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from baton.datasets import arithmetic_splits, collate_prompts
from baton.models import load_tokenizer
from baton.rollout import Sample, Status, load_rollout, samples_to_data, save_rollout
from baton.strategy.base import SamplingParams
from baton.strategy.sampling import generation_output, padded_responses

PAD = 99


def pair() -> list[Sample]:
    """Two samples of group 7: a completed one with a masked env token and a dict reward, a truncated longer one."""
    first = Sample(group_index=7, sample_index=0, prompt="abc", prompt_ids=[5, 6, 7], label="11", response="xy",
                   response_ids=[10, 11], loss_mask=[1, 0], reward={"score": 1.0, "acc": 1.0, "pred": "11"},
                   rollout_log_probs=[-0.5, 0.0], weight_versions=[3, -1], status=Status.COMPLETED, seed=1,
                   metadata={"data_source": "a", "extra": [1, 2]})
    second = Sample(group_index=7, sample_index=1, prompt="d", prompt_ids=[8], response="wxyz",
                    response_ids=[20, 21, 22, 23], reward=0.5, rollout_log_probs=[-1.0, -2.0, -3.0, -4.0],
                    weight_versions=[5, 5, 6, 6], status=Status.TRUNCATED, seed=2, metadata={"data_source": "b"})
    return [first, second]


def test_sample_properties():
    first, second = pair()
    assert first.response_length == 2
    assert first.effective_loss_mask() == [1, 0]
    assert second.effective_loss_mask() == [1, 1, 1, 1]
    assert first.oldest_version() == 3  # the env token's -1 does not count
    assert second.oldest_version() == 5
    empty = Sample(group_index=0, sample_index=0, prompt="p", prompt_ids=[1])
    assert empty.oldest_version() is None
    env_only = Sample(group_index=0, sample_index=0, prompt="p", prompt_ids=[1], response_ids=[4],
                      rollout_log_probs=[0.0], weight_versions=[-1])
    assert env_only.oldest_version() is None
    assert first.score() == 1.0 and first.score("acc") == 1.0 and second.score() == 0.5


def test_score_errors_name_the_sample():
    first, second = pair()
    second.reward = None
    with pytest.raises(ValueError, match="group 7 sample 1 has no reward"):
        second.score()
    with pytest.raises(ValueError, match="group 7 sample 0: the reward dict has no 'reward'"):
        first.score("reward")


@pytest.mark.parametrize("name, value", [("loss_mask", [1]), ("rollout_log_probs", [0.0, 0.0, 0.0]),
                                          ("weight_versions", [])])
def test_check_names_the_sample_and_the_list(name, value):
    first = pair()[0]
    first.check()
    setattr(first, name, value)
    with pytest.raises(ValueError, match=rf"group 7 sample 0: {name} has {len(value)} entries but the response has "
                                         rf"2 tokens; append one entry to {name}"):
        first.check()


def test_check_refuses_a_loss_mask_that_is_not_zero_one():
    first = pair()[0]
    first.loss_mask = [1, 2]
    with pytest.raises(ValueError, match="group 7 sample 0: loss_mask holds values other than 0 and 1"):
        first.check()


def test_dict_round_trip_is_json_safe():
    for sample in pair():
        d = json.loads(json.dumps(sample.to_dict()))
        assert d["status"] == sample.status.value
        back = Sample.from_dict(d)
        assert back == sample and back.status is sample.status
        back.response_ids.append(1)
        assert len(d["response_ids"]) == sample.response_length  # from_dict copies


def test_from_dict_errors():
    d = pair()[0].to_dict()
    with pytest.raises(ValueError, match="unknown key 'reponse'"):
        Sample.from_dict({**d, "reponse": "x"})
    with pytest.raises(ValueError, match="status 'done' is not one of"):
        Sample.from_dict({**d, "status": "done"})
    del d["prompt_ids"]
    with pytest.raises(ValueError, match="prompt_ids"):
        Sample.from_dict(d)


def test_samples_to_data_exact_values():
    data = samples_to_data(pair(), pad_token_id=PAD, temperature=0.7)
    b, nt = data.batch, data.non_tensor_batch
    assert b["prompts"].tolist() == [[5, 6, 7], [PAD, PAD, 8]]
    assert b["responses"].tolist() == [[10, 11, PAD, PAD], [20, 21, 22, 23]]
    assert b["response_mask"].tolist() == [[1, 0, 0, 0], [1, 1, 1, 1]]
    assert b["input_ids"].tolist() == [[5, 6, 7, 10, 11, PAD, PAD], [PAD, PAD, 8, 20, 21, 22, 23]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 1]]  # env token attended
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 4, 4], [0, 0, 0, 1, 2, 3, 4]]
    assert b["rollout_log_probs"].tolist() == [[-0.5, 0.0, 0.0, 0.0], [-1.0, -2.0, -3.0, -4.0]]
    assert b["rollout_weight_versions"].tolist() == [[3, -1, -1, -1], [5, 5, 6, 6]]
    assert b["scores"].tolist() == [1.0, 0.5]
    assert b["token_level_scores"].tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]]
    assert b["reward_extra/acc"].tolist() == [1.0, 0.0]
    assert "reward_extra/pred" not in b and "reward_extra/score" not in b  # not numeric; the score itself
    assert {k: v.dtype for k, v in b.items()} == {
        "prompts": torch.long, "responses": torch.long, "response_mask": torch.long, "input_ids": torch.long,
        "attention_mask": torch.long, "position_ids": torch.long, "rollout_log_probs": torch.float32,
        "rollout_weight_versions": torch.int64, "scores": torch.float32, "token_level_scores": torch.float32,
        "reward_extra/acc": torch.float32}
    assert nt["uid"].tolist() == [7, 7] and nt["uid"].dtype == np.int64
    assert nt["ground_truth"].tolist() == ["11", None]
    assert nt["prompt"].tolist() == ["abc", "d"]
    assert nt["finish_reason"].tolist() == ["stop", "length"]
    assert nt["data_source"].tolist() == ["a", "b"]
    assert "extra" not in nt  # only one sample has it
    assert data.meta_info == {"temperature": 0.7}


def test_samples_to_data_zero_length_response_gets_no_score_token():
    first, second = pair()
    first.response_ids, first.loss_mask, first.rollout_log_probs, first.weight_versions = [], None, [], []
    data = samples_to_data([first, second], pad_token_id=PAD, temperature=1.0)
    assert data.batch["token_level_scores"][0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert data.batch["scores"].tolist() == [1.0, 0.5]
    assert data.batch["attention_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("status", [Status.ABORTED, Status.PENDING, Status.FAILED])
def test_samples_to_data_refuses_untrainable_samples(status):
    first, second = pair()
    second.status = status
    with pytest.raises(ValueError, match=f"group 7 sample 1 has status '{status.value}'; only completed or truncated"):
        samples_to_data([first, second], pad_token_id=PAD, temperature=1.0)


def test_samples_to_data_checks_every_sample():
    first, second = pair()
    second.weight_versions = [5]
    with pytest.raises(ValueError, match="group 7 sample 1: weight_versions has 1 entries"):
        samples_to_data([first, second], pad_token_id=PAD, temperature=1.0)


def test_samples_to_data_matches_generation_output():
    """The same prompts and responses give generate()'s columns, values and dtypes."""
    tokenizer = load_tokenizer(None)
    train, _ = arithmetic_splits(max_operand=20, num_val=10)
    prompts = collate_prompts(train, [3, 0], tokenizer)  # different lengths: left padding
    responses = [[11, 12, 1], [13], [14, 15], [16, 17, 18, 1]]
    log_probs = [[-0.1 * (i + j) for j in range(len(r))] for i, r in enumerate(responses)]
    stopped = [True, False, False, True]
    padded = padded_responses(responses, log_probs, stopped, tokenizer.pad_token_id)
    expected = generation_output(prompts, SamplingParams(temperature=0.9, n=2), padded["responses"],
                                 padded["response_mask"], padded["rollout_log_probs"], padded["stopped"])
    samples = []
    for row, (ids, lps, stop) in enumerate(zip(responses, log_probs, stopped)):
        example = train[[3, 0][row // 2]]
        samples.append(Sample(
            group_index=int(prompts.non_tensor_batch["uid"][row // 2]), sample_index=row % 2, prompt=example["prompt"],
            prompt_ids=tokenizer(example["prompt"], add_special_tokens=False)["input_ids"], label=example["answer"],
            response_ids=ids, rollout_log_probs=lps, weight_versions=[0] * len(ids), reward=1.0,
            status=Status.COMPLETED if stop else Status.TRUNCATED,
            metadata={"teacher_answers": example["teacher_answers"]}))
    data = samples_to_data(samples, tokenizer.pad_token_id, temperature=0.9)
    assert expected.batch.keys() <= data.batch.keys()
    for key, value in expected.batch.items():
        assert data.batch[key].dtype == value.dtype, key
        assert torch.equal(data.batch[key], value), key
    assert expected.non_tensor_batch.keys() == data.non_tensor_batch.keys()
    for key, value in expected.non_tensor_batch.items():
        assert data.non_tensor_batch[key].dtype == value.dtype, key
        assert data.non_tensor_batch[key].tolist() == value.tolist(), key
    assert data.meta_info == expected.meta_info


def test_dump_round_trip(tmp_path):
    third = Sample(group_index=8, sample_index=0, prompt="q", prompt_ids=[3], status=Status.ABORTED,
                   response_ids=[4], rollout_log_probs=[-0.2], weight_versions=[2])
    groups = [pair(), [third]]
    template = str(tmp_path / "dumps" / "rollout_{rollout_id:03d}.jsonl")
    path = save_rollout(template, 5, groups)
    assert path == str(tmp_path / "dumps" / "rollout_005.jsonl")
    lines = open(path).read().splitlines()
    assert [json.loads(line)["sample_index"] for line in lines] == [0, 1, 0]
    assert load_rollout(template, 5) == groups
    assert [p.name for p in (tmp_path / "dumps").iterdir()] == ["rollout_005.jsonl"]  # no temp file left


def test_dump_refuses_to_overwrite(tmp_path):
    template = str(tmp_path / "r{rollout_id}.jsonl")
    save_rollout(template, 1, [pair()])
    with pytest.raises(FileExistsError, match=r"r1\.jsonl already exists.*pass overwrite=True"):
        save_rollout(template, 1, [pair()[:1]])
    save_rollout(template, 1, [pair()[:1]], overwrite=True)
    assert load_rollout(template, 1) == [pair()[:1]]


def test_dump_template_needs_rollout_id(tmp_path):
    with pytest.raises(ValueError, match=r"needs exactly one, \{rollout_id\}"):
        save_rollout(str(tmp_path / "rollout.jsonl"), 1, [pair()])


def test_load_missing_rollout_names_the_saved_ones(tmp_path):
    template = str(tmp_path / "r_{rollout_id}.jsonl")
    with pytest.raises(FileNotFoundError, match="matches no dumps"):
        load_rollout(template, 0)
    for rollout_id in (3, 10):
        save_rollout(template, rollout_id, [pair()])
    with pytest.raises(FileNotFoundError,
                       match=r"r_4\.jsonl for rollout 4: the template has dumps of rollouts \[3, 10\]"):
        load_rollout(template, 4)


def test_load_bad_line_names_file_and_line(tmp_path):
    template = str(tmp_path / "r{rollout_id}.jsonl")
    path = save_rollout(template, 2, [pair()])
    with open(path, "a") as f:
        f.write('{"group_index": 9, "bogus": 1}\n')
    with pytest.raises(ValueError, match=r"r2\.jsonl:3: not a sample: .*unknown key 'bogus'"):
        load_rollout(template, 2)
    with open(path, "w") as f:
        f.write("not json\n")
    with pytest.raises(ValueError, match=r"r2\.jsonl:1: not a sample"):
        load_rollout(template, 2)
