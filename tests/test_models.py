"""The shipped character tokenizer and the model builders, on real (tiny) HF objects."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from baton.models import (
    CHAR_TOKENIZER_DIR,
    MODEL_CONFIGS,
    build_char_tokenizer,
    build_model,
    count_parameters,
    load_tokenizer,
    model_config,
)
from baton.models.tokenizer import CHARACTERS, save_char_tokenizer

SAMPLE_TEXT = "  12 + 345 = 357\n\nWhat's (a-b)*c? {x: [1, 2]} ~ end . , ! \n "


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def test_vocabulary_and_special_ids(tokenizer):
    assert len(tokenizer) == 100
    assert (tokenizer.pad_token, tokenizer.eos_token, tokenizer.bos_token, tokenizer.unk_token) == (
        "<pad>", "<eos>", "<bos>", "<unk>",
    )
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.unk_token_id) == (0, 1, 2, 3)
    assert tokenizer("\n ~")["input_ids"] == [4, 5, 99]
    assert tokenizer.padding_side == "right"


def test_one_token_per_character_and_exact_round_trip(tokenizer):
    ids = tokenizer(SAMPLE_TEXT)["input_ids"]
    assert ids == [4 + CHARACTERS.index(char) for char in SAMPLE_TEXT]  # no bos/eos, no merges
    assert tokenizer.decode(ids) == SAMPLE_TEXT
    assert tokenizer.decode([2, *ids, 1, 0, 0], skip_special_tokens=True) == SAMPLE_TEXT


def test_special_token_text_is_split_into_characters(tokenizer):
    ids = tokenizer("1<eos>2")["input_ids"]
    assert len(ids) == 7 and tokenizer.eos_token_id not in ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1<eos>2"


def test_unknown_characters_become_one_unk_each(tokenizer):
    assert tokenizer("a\té")["input_ids"] == [tokenizer.convert_tokens_to_ids("a"), 3, 3]


@settings(max_examples=50, deadline=None)
@given(text=st.text(alphabet=CHARACTERS, max_size=200))
def test_round_trip_property(tokenizer, text):
    ids = tokenizer(text)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text


def test_auto_tokenizer_and_fast_class_load_the_shipped_files():
    for cls in (AutoTokenizer, PreTrainedTokenizerFast):
        loaded = cls.from_pretrained(CHAR_TOKENIZER_DIR, local_files_only=True)
        assert loaded(SAMPLE_TEXT)["input_ids"] == load_tokenizer()(SAMPLE_TEXT)["input_ids"]


def test_left_padding_when_requested():
    tokenizer = load_tokenizer()
    tokenizer.padding_side = "left"
    batch = tokenizer(["1+1=", "12+30="], padding=True, return_tensors="pt")
    assert batch["input_ids"][0, :2].tolist() == [0, 0]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1], [1] * 6]
    assert tokenizer.decode(batch["input_ids"][0], skip_special_tokens=True) == "1+1="


def test_shipped_files_match_build_char_tokenizer(tmp_path):
    built, shipped = build_char_tokenizer(), load_tokenizer()
    assert shipped.get_vocab() == built.get_vocab()
    assert shipped.all_special_tokens == built.all_special_tokens
    assert shipped.split_special_tokens == built.split_special_tokens
    text = SAMPLE_TEXT + CHARACTERS + "<pad>é"
    assert shipped(text)["input_ids"] == built(text)["input_ids"]
    assert shipped.decode(built(text)["input_ids"]) == built.decode(built(text)["input_ids"])
    # Regenerating gives the same pipeline. Fields that only record library versions or defaults
    # (model_max_length, format version) are left out so another transformers release still passes.
    save_char_tokenizer(str(tmp_path))
    regenerated, shipped_json = (
        json.loads((directory / "tokenizer.json").read_text()) for directory in (tmp_path, Path(CHAR_TOKENIZER_DIR))
    )
    for key in ("added_tokens", "normalizer", "pre_tokenizer", "decoder"):
        assert regenerated[key] == shipped_json[key], key
    for key in ("type", "vocab", "merges", "unk_token"):
        assert regenerated["model"][key] == shipped_json["model"][key], key


def test_load_tokenizer_rejects_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        load_tokenizer(str(tmp_path / "does-not-exist"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))


def _parameters(model):
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_seeded_build_is_deterministic_and_leaves_caller_rng_alone():
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    first = _parameters(build_model("tiny-qwen2", seed=0))
    assert torch.equal(torch.rand(3), expected_draw)
    second = _parameters(build_model("tiny-qwen2", seed=0))
    other = _parameters(build_model("tiny-qwen2", seed=1))
    assert first.keys() == second.keys() == other.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert not torch.equal(first["model.layers.0.self_attn.q_proj.weight"], other["model.layers.0.self_attn.q_proj.weight"])


def test_registry_models_match_the_tokenizer_and_expected_sizes(tokenizer):
    tiny = build_model("tiny-qwen2", seed=0)
    assert tiny.training
    assert tiny.config.vocab_size == len(tokenizer)
    assert (tiny.config.pad_token_id, tiny.config.eos_token_id, tiny.config.bos_token_id) == (0, 1, 2)
    assert tiny.config._attn_implementation == "sdpa"
    assert tiny.lm_head.weight is tiny.model.embed_tokens.weight
    assert 0.7e6 < count_parameters(tiny) < 1.2e6
    assert 7e6 < count_parameters(build_model("small-qwen2", seed=0)) < 12e6


def test_build_model_dtype():
    model = build_model({"base": "tiny-qwen2", "num_hidden_layers": 1}, dtype=torch.bfloat16, seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.config.dtype == torch.bfloat16


def test_save_pretrained_round_trip_through_build_model(tmp_path, tokenizer):
    model = build_model("tiny-qwen2", seed=0).eval()
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = build_model(str(tmp_path))
    assert loaded.training
    loaded.eval()
    tokenizer = load_tokenizer()
    tokenizer.padding_side = "left"
    batch = tokenizer(["1+1=2", "12+30=42"], padding=True, return_tensors="pt")
    with torch.no_grad():
        expected, actual = model(**batch).logits, loaded(**batch).logits
    assert expected.shape == (2, 8, len(tokenizer))
    assert torch.equal(expected, actual)
    with pytest.warns(UserWarning, match="seed=3 is ignored"):
        build_model(str(tmp_path), seed=3)


def test_dict_config_with_base_override():
    config = model_config({"base": "tiny-qwen2", "num_hidden_layers": 2, "hidden_size": 64})
    assert (config.num_hidden_layers, config.hidden_size) == (2, 64)
    assert config.intermediate_size == MODEL_CONFIGS["tiny-qwen2"]["intermediate_size"]
    assert model_config("tiny-qwen2").num_hidden_layers == 4  # the registry entry is not mutated
    model = build_model({"base": "tiny-qwen2", "num_hidden_layers": 2, "hidden_size": 64}, seed=0)
    assert len(model.model.layers) == 2 and model.config.hidden_size == 64


def test_bad_names_and_keys_raise_value_error(tmp_path):
    with pytest.raises(ValueError, match="tiny-qwen2"):
        model_config("huge-qwen2")
    with pytest.raises(ValueError, match="valid names"):
        model_config({"base": "huge-qwen2"})
    with pytest.raises(ValueError, match="hiden_size"):
        model_config({"base": "tiny-qwen2", "hiden_size": 64})
    with pytest.raises(ValueError, match="neither a local directory"):
        build_model(str(tmp_path / "no-such-checkpoint"))
    with pytest.raises(ValueError, match="Qwen/Qwen2.5-0.5B"):
        build_model("Qwen/Qwen2.5-0.5B")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model_config({"base": "tiny-qwen2", "rope_theta": 1e6})  # legacy key, converted by transformers
