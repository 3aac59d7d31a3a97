"""Bad prompt data is an error when it is loaded, naming the file, the row and the fix; data fields cannot take
the names of baton's own columns; a reward function that raises names the row (or scores it 0 and is counted)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from baton.cli import read_prompts
from baton.data import DataProto
from baton.datasets import RESERVED_FIELDS, DataError, PromptDataset, collate_prompts
from baton.datasets.load import load_datasets
from baton.models import load_tokenizer
from baton.pipelines.config import DataConfig
from baton.rewards import RewardError
from baton.workers import RewardWorker

GOOD = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": 4}]


def write_jsonl(path, rows) -> str:
    """Rows as JSON lines; a str row is written as it is (a raw line)."""
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return str(path)


def files_config(train: str, val: str | None = None, **settings) -> DataConfig:
    return DataConfig(task="files", train_path=train, val_path=val, **settings)


# ---- rows and fields -----------------------------------------------------------------------------------------


def test_good_rows_load_with_number_answers_as_text_and_extra_fields_riding_along(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{**row, "data_source": "toy"} for row in GOOD])
    train, val, tokenizer = load_datasets(files_config(path), None)
    batch = collate_prompts(train, range(len(train)), tokenizer)
    assert list(batch.non_tensor_batch["ground_truth"]) == ["2", "4"]
    assert list(batch.non_tensor_batch["data_source"]) == ["toy", "toy"]
    assert list(batch.non_tensor_batch["uid"]) == [0, 1] and val is None


@pytest.mark.parametrize("row, message", [
    ('"just a string"', r"line 2: a row must be a JSON object .* not a string \('just a string'\)"),
    ("42", r"line 2: a row must be a JSON object .* not a number \(42\)"),
    ('["1+1=", "2"]', r"line 2: a row must be a JSON object .* not a list"),
    ('{"prompt": null, "answer": "2"}', r"line 2: the prompt 'prompt' is null; it must be a non-empty string"),
    ('{"prompt": "", "answer": "2"}', r"line 2: the prompt 'prompt' is a string \(''\); it must be a non-empty string"),
    ('{"prompt": 12, "answer": "2"}', r"line 2: the prompt 'prompt' is a number \(12\)"),
    ('{"prompt": [{"role": "user"}], "answer": "2"}',
     r"line 2: the prompt 'prompt' is a list, so chat messages, but message 0 is an object .*string \"content\""),
    ('{"question": "1+1=", "answer": "2"}', r"line 2: no 'prompt' field \(fields: \['answer', 'question'\]\); set data.prompt_key"),
    ('{"prompt": "1+1="}', r"line 2: no 'answer' field \(fields: \['prompt'\]\); set data.answer_key"),
    ('{"prompt": "1+1=", "answer": null}', r"line 2: the answer 'answer' is null"),
    ('{"prompt": "1+1=", "answer": ["2", "two"]}', r"line 2: the answer 'answer' is a list .* data.response_key"),
    ('{"prompt": "1+1=", "answer": NaN}', r"line 2: the answer 'answer' is a number \(nan\)"),
])
def test_a_bad_row_is_an_error_naming_the_file_and_line(tmp_path, row, message):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD[0], row])
    with pytest.raises(DataError, match=rf"train\.jsonl, {message}"):
        PromptDataset.from_file(path)


def test_rows_given_as_a_list_are_named_by_index():
    with pytest.raises(DataError, match=r"^example 1: the prompt 'prompt' is null"):
        PromptDataset([GOOD[0], {"prompt": None, "answer": "2"}])


def test_malformed_json_names_the_real_line_counting_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD[0], "", "   ", GOOD[1], '{"prompt": "3+3=", "answer": 6'])
    with pytest.raises(DataError, match=r"train\.jsonl, line 5: not valid JSON \(Expecting ',' delimiter, column 31\)"):
        PromptDataset.from_file(path)


def test_blank_lines_count_in_the_line_numbers_of_later_errors(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", ["", GOOD[0], "", {"prompt": "x=", "answer": None}])
    with pytest.raises(DataError, match=r"train\.jsonl, line 4: the answer 'answer' is null"):
        PromptDataset.from_file(path)


def test_bytes_that_are_not_utf8_are_named_by_line_and_byte_offset(tmp_path):
    path = tmp_path / "train.jsonl"
    first = (json.dumps(GOOD[0]) + "\n").encode()
    path.write_bytes(first + b'{"prompt": "caf\xe9", "answer": "x"}\n')
    with pytest.raises(DataError, match=rf"train\.jsonl, line 2: the byte b'\\xe9' at byte offset {len(first) + 15} "
                                        r"of the file \(byte 16 of the line\) is not UTF-8"):
        PromptDataset.from_file(str(path))


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "\\ud800", "answer": "1"}', "line 2: a lone surrogate"),  # an unpaired escape: not text
    ('{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "line 2: nested too deeply to be a row"),
])
def test_a_row_that_is_json_but_not_text_is_an_error_naming_the_line(tmp_path, line, message):
    path = write_jsonl(tmp_path / "train.jsonl", [GOOD[0], line])
    with pytest.raises(DataError, match=rf"train\.jsonl, {message}"):
        PromptDataset.from_file(path)


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_an_empty_file_is_an_error_naming_it(tmp_path, text):
    (tmp_path / "train.jsonl").write_text(text)
    with pytest.raises(DataError, match=r"train\.jsonl: the file has no rows"):
        load_datasets(files_config(str(tmp_path / "train.jsonl")), None)


def test_the_val_file_is_checked_too(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", GOOD)
    val = write_jsonl(tmp_path / "val.jsonl", [GOOD[0], GOOD[1], {"prompt": None, "answer": "1"}])
    with pytest.raises(DataError, match=r"val\.jsonl, line 3: the prompt 'prompt' is null"):
        load_datasets(files_config(train, val), None)


def test_generate_prompt_files_are_checked(tmp_path):
    """`baton generate --prompts-file` (and `baton eval --data`) read through PromptDataset.from_file."""
    path = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "1+1="}, {"prompt": None}])
    with pytest.raises(DataError, match=r"prompts\.jsonl, line 2: the prompt 'prompt' is null"):
        read_prompts(path, load_tokenizer())
    chat = write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "1+1="}]}, {"prompt": "2+2="}])
    assert read_prompts(chat, load_tokenizer()) == ["user: 1+1=\nassistant: ", "2+2="]  # rendered by the chat template


# ---- reserved names --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(RESERVED_FIELDS))
def test_a_field_with_a_reserved_name_is_an_error_naming_it_and_the_fix(tmp_path, name):
    rows = [{"question": "1+1=", "answer": "2"}, {"question": "2+2=", "answer": "4", name: 7}]
    fix = {"ground_truth": "set data.answer_key: ground_truth", "prompt": "set data.prompt_key: prompt",
           "response": "set data.response_key: response"}.get(name, "rename the field")
    with pytest.raises(DataError, match=rf"train\.jsonl, line 2: the field '{name}' has a name baton reserves: .*{fix}"):
        PromptDataset.from_file(write_jsonl(tmp_path / "train.jsonl", rows), prompt_key="question")


def test_the_reserved_set_holds_baton_own_columns_and_the_reward_arguments():
    assert {"uid", "ground_truth", "prompt", "response_text", "finish_reason", "response", "input_ids", "responses",
            "scores", "advantages"} <= RESERVED_FIELDS.keys()
    assert "data_source" not in RESERVED_FIELDS and "extra_info" not in RESERVED_FIELDS


def test_a_reserved_name_is_fine_as_the_prompt_answer_or_response_key(tmp_path):
    rows = [{"question": "1+1=", "ground_truth": "2", "response": "2", "prompt_id": 3}]
    data = PromptDataset(rows, prompt_key="question", answer_key="ground_truth", response_key="response")
    batch = collate_prompts(data, [0], load_tokenizer())
    assert list(batch.non_tensor_batch["prompt"]) == ["1+1="] and list(batch.non_tensor_batch["ground_truth"]) == ["2"]
    assert "response" not in batch.non_tensor_batch and list(batch.non_tensor_batch["prompt_id"]) == [3]
    assert len(PromptDataset([{"prompt": "1+1=", "answer": "2"}], prompt_key="prompt")) == 1


def test_a_uid_column_cannot_merge_every_prompt_into_one_group(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", [{**row, "uid": 7} for row in GOOD])
    with pytest.raises(DataError, match=r"line 1: the field 'uid' has a name baton reserves: .*group id"):
        load_datasets(files_config(path), None)


# ---- prompt lengths --------------------------------------------------------------------------------------------


def long_rows() -> list[dict]:
    """The character tokenizer gives one token per character: prompts of 4, 20, 4 and 12 tokens."""
    return [GOOD[0], {"prompt": "x" * 20, "answer": "1"}, GOOD[1], {"prompt": "y" * 12, "answer": "1"}]


def test_an_over_long_prompt_is_an_error_naming_file_line_length_and_limit(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", long_rows())
    with pytest.raises(DataError, match=r"train\.jsonl, line 2: the prompt has 20 tokens, more than "
                                        r"data\.max_prompt_len=10 \(2 of 4 prompts are longer\); .* data\.overlong_prompts: filter"):
        load_datasets(files_config(path, max_prompt_len=10), None)


def test_filter_drops_over_long_prompts_and_says_how_many(tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", long_rows())
    val = write_jsonl(tmp_path / "val.jsonl", long_rows()[:2])
    train_data, val_data, _ = load_datasets(files_config(train, val, max_prompt_len=10, overlong_prompts="filter"), None)
    assert [e["prompt"] for e in train_data] == ["1+1=", "2+2="] and [e["prompt"] for e in val_data] == ["1+1="]
    assert [train_data.where(i) for i in range(2)] == [f"{train}, line 1", f"{train}, line 3"]
    err = capsys.readouterr().err
    assert f"{train}: dropped 2 of 4 prompts longer than data.max_prompt_len=10" in err
    assert f"{val}: dropped 1 of 2 prompts" in err


def test_filter_that_leaves_no_prompt_is_an_error_naming_the_file(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", long_rows()[1:2])
    with pytest.raises(DataError, match=r"train\.jsonl: all 1 prompts are longer than data\.max_prompt_len=10"):
        load_datasets(files_config(path, max_prompt_len=10, overlong_prompts="filter"), None)


def test_the_arithmetic_task_is_checked_against_max_prompt_len_too():
    with pytest.raises(DataError, match=r"the arithmetic task's train split, row \d+: the prompt has \d tokens"):
        load_datasets(DataConfig(max_prompt_len=4), None)


def test_collate_names_the_row_of_an_over_long_prompt_as_a_last_guard(tmp_path):
    data = PromptDataset.from_file(write_jsonl(tmp_path / "train.jsonl", long_rows()))
    with pytest.raises(DataError, match=r"train\.jsonl, line 4: the prompt has 12 tokens, more than max_prompt_len=10"):
        collate_prompts(data, [0, 3, 2], load_tokenizer(), max_prompt_len=10)


def test_overlong_prompts_takes_error_or_filter():
    with pytest.raises(ValueError, match="data.overlong_prompts 'drop' is not one of"):
        DataConfig(overlong_prompts="drop")


# ---- parquet ---------------------------------------------------------------------------------------------------


def write_parquet(path, rows) -> str:
    """Rows as a parquet file, answers as strings (a parquet column has one type)."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{**row, "answer": str(row["answer"])} for row in rows]), str(path))
    return str(path)


def test_parquet_rows_are_checked_and_named_by_index(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [GOOD[0], {"prompt": None, "answer": "2"}])
    with pytest.raises(DataError, match=r"train\.parquet, row 1: the prompt 'prompt' is null"):
        PromptDataset.from_file(path)
    path = write_parquet(tmp_path / "uid.parquet", [{**row, "uid": 7} for row in GOOD])
    with pytest.raises(DataError, match=r"uid\.parquet, row 0: the field 'uid' has a name baton reserves"):
        PromptDataset.from_file(path)


def test_an_empty_parquet_file_and_a_long_parquet_prompt_are_errors(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), str(empty))
    with pytest.raises(DataError, match=r"empty\.parquet: the file has no rows"):
        PromptDataset.from_file(str(empty))
    path = write_parquet(tmp_path / "train.parquet", long_rows())
    with pytest.raises(DataError, match=r"train\.parquet, row 1: the prompt has 20 tokens"):
        load_datasets(files_config(path, max_prompt_len=10), None)
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot be read as parquet"):
        PromptDataset.from_file(str(broken))


# ---- the reward ------------------------------------------------------------------------------------------------


def as_int(response: str, ground_truth: str, **fields) -> float:
    return float(int(response) == int(ground_truth))


def returns_none(response: str, ground_truth: str, **fields):
    return None if response == "x" else 1.0


def returns_text(response: str, ground_truth: str, **fields):
    return "1.0"


def returns_nan(response: str, ground_truth: str, **fields):
    return math.nan


def verl_style(solution_str: str, ground_truth: str, **fields) -> float:
    return 1.0


def no_fields(response: str, ground_truth: str) -> float:
    return 1.0


def response_batch(responses: list[str], ground_truths: list[str], **columns) -> DataProto:
    """Decoded-response rows as the rollout gives them: right-padded responses, prompts and extra columns."""
    tokenizer = load_tokenizer()
    tokenizer.padding_side = "right"
    enc = tokenizer(responses, return_tensors="pt", padding=True)
    columns = {"prompt": [f"prompt {i}" for i in range(len(responses))], **columns}
    return DataProto.from_dict(
        {"responses": enc["input_ids"], "response_mask": enc["attention_mask"]},
        {"ground_truth": np.array(ground_truths, dtype=object), **{k: np.array(v, dtype=object) for k, v in columns.items()}},
    )


def test_a_raising_reward_names_the_function_the_row_and_the_error():
    batch = response_batch(["19", "1x", "7"], ["19", "19", "7"])
    with pytest.raises(RewardError) as info:
        RewardWorker(f"{__name__}:as_int").compute_rewards(batch)
    message = str(info.value)
    assert f"reward function '{__name__}:as_int' raised ValueError: invalid literal for int()" in message
    assert "on row 1 of the batch" in message and "prompt:       'prompt 1'" in message
    assert "response:     '1x'" in message and "ground truth: '19'" in message and "reward_on_error: zero" in message
    assert isinstance(info.value.__cause__, ValueError) and "\x1b[" not in message


def test_a_long_response_is_cut_in_the_message():
    with pytest.raises(RewardError) as info:
        RewardWorker(f"{__name__}:as_int").compute_rewards(response_batch(["z" * 5000], ["1"]))
    assert len(str(info.value)) < 1000 and "zzz...zzz" in str(info.value)


def test_on_error_zero_scores_raising_rows_zero_and_counts_them():
    batch = response_batch(["19", "1x", "7", "?"], ["19", "19", "8", "1"])
    out = RewardWorker(f"{__name__}:as_int", on_error="zero").compute_rewards(batch)
    assert out.batch["scores"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.meta_info["metrics"]["reward/num_errors"] == 2
    assert RewardWorker("exact_match").compute_rewards(batch).meta_info["metrics"]["reward/num_errors"] == 0


def test_num_errors_adds_up_over_the_parts_of_a_batch():
    """DP_COMPUTE concatenates the workers' outputs: the metric becomes one count per worker."""
    worker = RewardWorker(f"{__name__}:as_int", on_error="zero")
    parts = [worker.compute_rewards(response_batch(texts, ["1", "1"])) for texts in (["1", "x"], ["y", "z"])]
    assert sum(DataProto.concat(parts).meta_info["metrics"]["reward/num_errors"]) == 3


def test_on_error_takes_raise_or_zero():
    with pytest.raises(ValueError, match="on_error 'skip' is not one of"):
        RewardWorker("exact_match", on_error="skip")


@pytest.mark.parametrize("fn, returned", [("returns_none", "None"), ("returns_text", "'1.0'"), ("returns_nan", "nan")])
@pytest.mark.parametrize("on_error", ["raise", "zero"])
def test_a_reward_that_returns_a_non_number_is_an_error_naming_it_and_the_value(fn, returned, on_error):
    with pytest.raises(RewardError, match=rf"reward function '{__name__}:{fn}' returned {returned} .*finite number"):
        RewardWorker(f"{__name__}:{fn}", on_error=on_error).compute_rewards(response_batch(["x"], ["1"]))


def test_a_column_named_like_the_reward_response_parameter_is_an_error():
    batch = response_batch(["1"], ["1"], solution_str=["from the data"])
    with pytest.raises(ValueError, match=r"column 'solution_str' has the name of reward function .*takes the response"):
        RewardWorker(f"{__name__}:verl_style").compute_rewards(batch)
    assert RewardWorker(f"{__name__}:verl_style").compute_rewards(response_batch(["1"], ["1"])).batch["scores"].tolist() == [1.0]


def test_a_reward_without_fields_is_told_to_take_them():
    with pytest.raises(ValueError, match=r"takes no parameter 'prompt'.*add \*\*fields to its signature"):
        RewardWorker(f"{__name__}:no_fields").compute_rewards(response_batch(["1"], ["1"]))
