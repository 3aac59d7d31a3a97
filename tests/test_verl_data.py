"""verl's RL data loads unchanged: dotted keys into nested fields (reward_model.ground_truth), chat-message prompts
rendered by the tokenizer's chat template, parquet struct columns, and a data_source column in every batch."""

from __future__ import annotations

import json
import re

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from baton.data import DataProto
from baton.datasets import DataError, PromptDataset, collate_prompts, collate_sft
from baton.datasets.load import load_datasets
from baton.models import build_char_tokenizer, build_model, load_tokenizer, save_tokenizer
from baton.models.tokenizer import CHAR_CHAT_TEMPLATE, CHARACTERS
from baton.pipelines.config import DataConfig
from baton.workers import RewardWorker

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

QUESTIONS = ["1+1=", "2+5=", "9+9="]
ANSWERS = ["2", "7", "18"]


def verl_row(index: int, split: str = "train") -> dict:
    """A row as verl's examples/data_preprocess/gsm8k.py writes it."""
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": QUESTIONS[index]}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ANSWERS[index]},
        "extra_info": {"split": split, "index": index, "answer": f"#### {ANSWERS[index]}",
                       "question": QUESTIONS[index]},
    }


def write_parquet(path, rows) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def files_config(train: str, **settings) -> DataConfig:
    return DataConfig(task="files", train_path=train, **settings)


def verl_reward(response, ground_truth, *, data_source, reward_model, extra_info, raw_prompt, prompt, **fields):
    """Reads the fields verl's reward functions get, and reports what it saw."""
    return {"score": float(response == ground_truth),
            "reward_model_agrees": float(reward_model["ground_truth"] == ground_truth),
            "index": float(extra_info["index"]), "num_messages": float(len(raw_prompt)),
            "prompt_is_rendered": float(prompt.endswith("assistant: ")), "gsm8k": float(data_source == "openai/gsm8k")}


def with_responses(batch: DataProto, texts: list[str]) -> DataProto:
    tokenizer = load_tokenizer()
    tokenizer.padding_side = "right"
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    batch.batch.update(responses=enc["input_ids"], response_mask=enc["attention_mask"])
    return batch


# ---- verl's gsm8k layout, end to end ----------------------------------------------------------------------------


def test_a_verl_parquet_file_loads_renders_and_reaches_the_reward_with_its_nested_fields(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [verl_row(i) for i in range(3)])
    train, _, tokenizer = load_datasets(files_config(path, answer_key="reward_model.ground_truth"), None)
    batch = collate_prompts(train, [2, 0], tokenizer)
    columns = batch.non_tensor_batch
    assert list(columns["prompt"]) == ["user: 9+9=\nassistant: ", "user: 1+1=\nassistant: "]
    assert tokenizer.batch_decode(batch.batch["input_ids"], skip_special_tokens=True) == list(columns["prompt"])
    assert list(columns["ground_truth"]) == ["18", "2"]
    assert list(columns["raw_prompt"]) == [verl_row(2)["prompt"], verl_row(0)["prompt"]]
    assert list(columns["reward_model"]) == [verl_row(2)["reward_model"], verl_row(0)["reward_model"]]  # whole
    assert [e["index"] for e in columns["extra_info"]] == [2, 0]
    assert list(columns["data_source"]) == ["openai/gsm8k"] * 2
    assert sorted(columns) == ["ability", "data_source", "extra_info", "ground_truth", "prompt", "raw_prompt",
                               "reward_model", "uid"]  # the answer's path is not a column of its own

    out = RewardWorker(f"{__name__}:verl_reward").compute_rewards(with_responses(batch, ["18", "3"]))
    assert out.batch["scores"].tolist() == [1.0, 0.0]
    extras = {k.removeprefix("reward_extra/"): v.tolist() for k, v in out.batch.items()
              if k.startswith("reward_extra/")}
    assert extras == {"reward_model_agrees": [1.0, 1.0], "index": [2.0, 0.0], "num_messages": [1.0, 1.0],
                      "prompt_is_rendered": [1.0, 1.0], "gsm8k": [1.0, 1.0]}


def test_without_the_answer_key_a_verl_row_says_where_its_answer_is(tmp_path):
    path = write_parquet(tmp_path / "train.parquet", [verl_row(0)])
    with pytest.raises(DataError, match=r"train\.parquet, row 0: no 'answer' field \(fields: \['ability', "
                                        r"'data_source', "
                                        r"'extra_info', 'prompt', 'reward_model'\]\); set data\.answer_key .*"
                                        r"set data\.answer_key: reward_model\.ground_truth$"):
        load_datasets(files_config(path), None)


# ---- dotted keys -------------------------------------------------------------------------------------------------


def test_every_key_may_be_a_dotted_path_and_the_path_value_reaches_sft_too(tmp_path):
    rows = [{"task": {"question": q}, "extra_info": {"answer": a, "solution": [f"{a}.", f"= {a}"]}}
            for q, a in zip(QUESTIONS, ANSWERS)]
    data = PromptDataset.from_file(write_jsonl(tmp_path / "train.jsonl", rows), prompt_key="task.question",
                                   answer_key="extra_info.answer", response_key="extra_info.solution")
    batch = collate_prompts(data, [1], load_tokenizer())
    assert list(batch.non_tensor_batch["prompt"]) == ["2+5="] and list(batch.non_tensor_batch["ground_truth"]) == ["7"]
    assert batch.non_tensor_batch["task"][0] == {"question": "2+5="}

    demos = data.one_response_per_row("extra_info.solution")
    assert [e["extra_info.solution"] for e in demos][:2] == ["2.", "= 2"] and len(demos) == 6
    tokenizer = load_tokenizer()
    sft = collate_sft(demos, [3], tokenizer, response_key="extra_info.solution")
    assert tokenizer.decode(sft.batch["responses"][0], skip_special_tokens=True) == "= 7"


def test_a_top_level_field_named_with_dots_wins_over_the_path():
    rows = [{"prompt": "1+1=", "extra_info.answer": "top", "extra_info": {"answer": "nested"}}]
    batch = collate_prompts(PromptDataset(rows, answer_key="extra_info.answer"), [0], load_tokenizer())
    assert list(batch.non_tensor_batch["ground_truth"]) == ["top"]
    assert batch.non_tensor_batch["extra_info"][0] == {"answer": "nested"}


@pytest.mark.parametrize("row, key, message", [
    ({"prompt": "x", "reward_model": {"style": "rule"}}, "reward_model.ground_truth",
     r"no 'reward_model\.ground_truth' field: 'reward_model' has no 'ground_truth' field "
     r"\(fields there: \['style'\]\)"),
    ({"prompt": "x", "answer": "1"}, "reward_model.ground_truth",
     r"no 'reward_model\.ground_truth' field: no 'reward_model' field \(fields there: \['answer', 'prompt'\]\)"),
    ({"prompt": "x", "extra_info": {"meta": "text"}}, "extra_info.meta.answer",
     r"no 'extra_info\.meta\.answer' field: 'extra_info\.meta' is a string \('text'\), so it holds no 'answer' field"),
    ({"prompt": "x", "extra_info": {"a": {"b": {}}}}, "extra_info.a.b.c",
     r"no 'extra_info\.a\.b\.c' field: 'extra_info\.a\.b' has no 'c' field \(fields there: \[\]\)"),
])
def test_a_missing_path_names_the_missing_part_and_the_fields_at_that_level(row, key, message):
    with pytest.raises(DataError, match=rf"^example 0: {message}; set data\.answer_key"):
        PromptDataset([row], answer_key=key)


def test_a_dotted_answer_is_checked_like_any_answer_and_a_parquet_null_is_named(tmp_path):
    rows = [verl_row(0), {**verl_row(1), "reward_model": {"style": "rule", "ground_truth": None}}]
    path = write_parquet(tmp_path / "train.parquet", rows)
    with pytest.raises(DataError, match=r"train\.parquet, row 1: the answer 'reward_model\.ground_truth' is null"):
        PromptDataset.from_file(path, answer_key="reward_model.ground_truth")


def test_a_dotted_prompt_path_names_the_prompt_key_in_its_error():
    with pytest.raises(DataError, match=r"no 'task\.question' field: 'task' has no 'question' field "
                                        r"\(fields there: \['text'\]\); set data\.prompt_key"):
        PromptDataset([{"task": {"text": "1+1="}, "answer": "2"}], prompt_key="task.question")


# ---- chat prompts ------------------------------------------------------------------------------------------------


def test_a_mixed_file_renders_chat_prompts_and_keeps_text_prompts(tmp_path):
    rows = [{"prompt": [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+1="}], "answer": "2"},
            {"prompt": "2+5=", "answer": "7"}]
    train, _, tokenizer = load_datasets(files_config(write_jsonl(tmp_path / "train.jsonl", rows)), None)
    assert [e["prompt"] for e in train] == ["system: Add.\nuser: 1+1=\nassistant: ", "2+5="]
    assert [e["raw_prompt"] for e in train] == [rows[0]["prompt"], "2+5="]  # as the file held it


def test_prompts_to_generate_from_need_no_answer_and_their_batches_no_ground_truth(tmp_path):
    path = write_parquet(tmp_path / "prompts.parquet", [{"prompt": verl_row(i)["prompt"]} for i in range(2)])
    data = PromptDataset.from_file(path, answer_key=None).render_chat(load_tokenizer())
    assert data.text_prompts() == ["user: 1+1=\nassistant: ", "user: 2+5=\nassistant: "]
    assert sorted(collate_prompts(data, [0, 1], load_tokenizer()).non_tensor_batch) == ["prompt", "raw_prompt", "uid"]
    with pytest.raises(DataError, match=r"^example 0: the prompt 'prompt' is a list, so chat messages, but the list "
                                        r"is empty"):
        PromptDataset([{"prompt": []}], answer_key=None)


def test_text_only_data_gets_no_raw_prompt(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "1=", "answer": "1"}])
    train, _, tokenizer = load_datasets(files_config(path), None)
    assert "raw_prompt" not in collate_prompts(train, [0], tokenizer).non_tensor_batch


@pytest.mark.parametrize("prompt, message", [
    ([], r"the list is empty; a chat prompt needs at least one message"),
    (["hi"], r"message 0 is a string \('hi'\); each message must be an object with a string \"role\" and a string "
             r"\"content\""),
    ([{"role": "user", "content": "a"}, {"content": "b"}], r"message 1 is an object .*string \"role\""),
    ([{"role": "user", "content": ["a", "b"]}], r"message 0 is an object .*string \"content\""),
    ([{"role": "human", "content": "a"}], r"message 0 has the role 'human'; a role is one of system, developer, user, "
                                          r"assistant, tool"),
])
def test_bad_chat_messages_are_an_error_naming_the_row(tmp_path, prompt, message):
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1=", "answer": "2"}, {"prompt": prompt, "answer": "1"}])
    with pytest.raises(DataError, match=rf"train\.jsonl, line 2: the prompt 'prompt' is a list, so chat messages, but "
                                        rf"{message}"):
        PromptDataset.from_file(path)


def test_a_tokenizer_without_a_chat_template_is_an_error_naming_its_directory_and_the_fix(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    path = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "1=", "reward_model": {"ground_truth": "1"}}, verl_row(0)])
    with pytest.raises(DataError, match=rf"train\.jsonl, line 2: the prompt is chat messages, but the tokenizer in "
                                        rf"{re.escape(str(tmp_path / 'plain'))} has no chat template .*"
                                        r"chat_template\.jinja"):
        load_datasets(files_config(path, answer_key="reward_model.ground_truth"), str(tmp_path / "plain"))


def test_a_chat_template_that_fails_on_a_row_names_that_row(tmp_path):
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system "
                               "messages') }}{% endif %}{{ m['content'] }}{% endfor %}")
    rows = [verl_row(0), {**verl_row(1), "prompt": [{"role": "system", "content": "x"}]}]
    data = PromptDataset(rows, answer_key="reward_model.ground_truth", source="train.parquet")
    with pytest.raises(DataError, match=r"train\.parquet, row 1: the chat template of the tokenizer in .* fails on the "
                                        r"prompt's messages: no system messages"):
        data.render_chat(tokenizer)


def test_a_raw_prompt_field_in_chat_data_is_an_error():
    data = PromptDataset([{**verl_row(0), "raw_prompt": "mine"}], answer_key="reward_model.ground_truth")
    with pytest.raises(DataError, match=r"example 0: the field 'raw_prompt' has the name baton gives .*"
                                        r"rename the field"):
        data.render_chat(load_tokenizer())


def test_chat_prompts_must_be_rendered_before_they_are_tokenised():
    data = PromptDataset([verl_row(0)], answer_key="reward_model.ground_truth")
    for tokenise in (lambda: collate_prompts(data, [0], load_tokenizer()),
                     lambda: data.check_prompt_lengths(load_tokenizer(), 100)):
        with pytest.raises(ValueError, match=r"example 0: the prompt is chat messages; .*render_chat\(tokenizer\)"):
            tokenise()


def test_prompt_lengths_are_the_rendered_texts(tmp_path, capsys):
    """"user: 1+1=\\nassistant: " is 22 characters, so 22 tokens; the question alone is 4."""
    path = write_parquet(tmp_path / "train.parquet", [verl_row(0), verl_row(2)])
    config = files_config(path, answer_key="reward_model.ground_truth", max_prompt_len=21)
    with pytest.raises(DataError, match=r"train\.parquet, row 0: the prompt has 22 tokens, more than "
                                        r"data\.max_prompt_len=21 \(2 of 2 prompts are longer\)"):
        load_datasets(config, None)
    rows = [verl_row(0), {**verl_row(1), "prompt": [{"role": "user", "content": "1"}]}]
    config = files_config(write_parquet(tmp_path / "mixed.parquet", rows), answer_key="reward_model.ground_truth",
                          max_prompt_len=21, overlong_prompts="filter")
    train, _, _ = load_datasets(config, None)
    assert [e["prompt"] for e in train] == ["user: 1\nassistant: "]
    assert "dropped 1 of 2 prompts" in capsys.readouterr().err


# ---- data_source -------------------------------------------------------------------------------------------------


def test_data_source_is_a_column_of_every_batch_once_any_row_has_it(tmp_path):
    rows = [{"prompt": "1=", "answer": "1"}, {"prompt": "2=", "answer": "2", "data_source": None},
            {"prompt": "3=", "answer": "3", "data_source": "toy", "hint": "odd"}]
    data = PromptDataset(rows)
    tokenizer = load_tokenizer()
    first, second = collate_prompts(data, [0, 1], tokenizer), collate_prompts(data, [2], tokenizer)
    assert list(first.non_tensor_batch["data_source"]) == ["unknown", "unknown"]
    assert list(first.non_tensor_batch["hint"]) == [None, None]
    merged = DataProto.concat([first, second])  # batches have the same columns, so they concatenate
    assert list(merged.non_tensor_batch["data_source"]) == ["unknown", "unknown", "toy"]
    plain = PromptDataset([{"prompt": "1=", "answer": "1"}])
    assert "data_source" not in collate_prompts(plain, [0], tokenizer).non_tensor_batch


def test_parquet_data_source_nulls_are_unknown(tmp_path):
    rows = [verl_row(0), {**verl_row(1), "data_source": None}]
    train, _, tokenizer = load_datasets(files_config(write_parquet(tmp_path / "t.parquet", rows),
                                                     answer_key="reward_model.ground_truth"), None)
    batch = collate_prompts(train, [0, 1], tokenizer)
    assert list(batch.non_tensor_batch["data_source"]) == ["openai/gsm8k", "unknown"]


# ---- the character tokenizer's chat template --------------------------------------------------------------------


def test_the_char_chat_template_renders_printable_text_that_round_trips():
    tokenizer = load_tokenizer()
    assert tokenizer.chat_template == CHAR_CHAT_TEMPLATE and set(CHAR_CHAT_TEMPLATE) <= set(CHARACTERS)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 + 30 ="},
                {"role": "assistant", "content": " 42"}, {"role": "user", "content": "and 1 + 1?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "system: Be brief.\nuser: 12 + 30 =\nassistant:  42\nuser: and 1 + 1?\nassistant: "
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
    assert tokenizer.apply_chat_template(messages[:2], tokenize=False) == "system: Be brief.\nuser: 12 + 30 =\n"


def test_a_checkpoint_carries_the_chat_template_to_every_loader(tmp_path):
    directory = tmp_path / "ckpt"
    build_model("tiny-qwen2", seed=0).save_pretrained(directory)  # a checkpoint's layout: config.json first
    save_tokenizer(load_tokenizer(), str(directory))
    assert (directory / "chat_template.jinja").read_text() == CHAR_CHAT_TEMPLATE
    for loader in (load_tokenizer, AutoTokenizer.from_pretrained, PreTrainedTokenizerFast.from_pretrained):
        assert loader(str(directory)).chat_template == CHAR_CHAT_TEMPLATE, loader


def test_save_tokenizer_refuses_a_directory_that_loses_the_chat_template(tmp_path, monkeypatch):
    """A transformers that wrote the template where its loader does not look would lose it: save_tokenizer says so."""
    tokenizer = build_char_tokenizer()
    real_save = type(tokenizer).save_pretrained

    def save_then_drop_template(self, directory, **kwargs):
        files = real_save(self, directory, **kwargs)
        (tmp_path / "ckpt" / "chat_template.jinja").unlink()
        return files

    monkeypatch.setattr(type(tokenizer), "save_pretrained", save_then_drop_template)
    with pytest.raises(RuntimeError, match="has another chat template once loaded back"):
        save_tokenizer(tokenizer, str(tmp_path / "ckpt"))

