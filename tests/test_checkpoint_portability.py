"""A saved checkpoint is the same model outside baton: its tokenizer gives the shipped ids through every loader,
and plain transformers (AutoModelForCausalLM + AutoTokenizer, greedy generate) scores it as baton does."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from baton.datasets import PromptDataset, collate_prompts, collate_sft
from baton.models import build_model, load_tokenizer, save_tokenizer
from baton.models.tokenizer import CHARACTERS, SPECIAL_TOKENS
from baton.rl.losses import SFTLoss
from baton.strategy import OptimizerConfig, SamplingParams, StrategyConfig
from baton.strategy.hf import HFStrategy

# Spaces (single, double, leading, trailing), newlines, and every character of the vocabulary.
TEXTS = ["reverse: hello=", "  12 + 30 = 42 \n", "a  b\n\nc ", CHARACTERS, CHARACTERS[::-1] + " <eos> <pad>"]
# Additions written with spaces, which a tokenizer that drops spaces would turn into other inputs.
EXAMPLES = [{"prompt": f"{a} + {b} =", "answer": f" {a + b}"} for a in range(4) for b in range(4)]


def ids(tokenizer, texts=TEXTS) -> list[list[int]]:
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def loaders(directory):
    return {"AutoTokenizer": AutoTokenizer.from_pretrained(directory, local_files_only=True),
            "load_tokenizer": load_tokenizer(str(directory)),
            "PreTrainedTokenizerFast": PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)}


def model_dir_with(tokenizer, directory):
    """A directory as a checkpoint lays it out: the model's files (a Qwen2 config.json) and then the tokenizer."""
    build_model("tiny-qwen2", seed=0).save_pretrained(directory)
    save_tokenizer(tokenizer, str(directory))
    return directory


def char_tokenizer_before_the_fix() -> PreTrainedTokenizerFast:
    """The character tokenizer as shipped before: plain " " and "\\n" in the vocabulary, no byte-level step."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", split_special_tokens=True, clean_up_tokenization_spaces=False)


def test_saved_char_tokenizer_loads_to_the_shipped_ids_everywhere(tmp_path):
    shipped = load_tokenizer()
    expected = ids(shipped)
    assert [len(row) for row in expected] == [len(text) for text in TEXTS]  # one token per character, spaces included
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # save_tokenizer warns when AutoTokenizer would differ
        directory = model_dir_with(shipped, tmp_path / "ckpt")
    assert json.loads((directory / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    for name, tokenizer in loaders(directory).items():
        assert ids(tokenizer) == expected, name
        assert [tokenizer.decode(row) for row in expected] == TEXTS, name
        assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2), name
        assert len(tokenizer) == len(shipped), name


def test_checkpoints_written_before_the_fix_load_right_through_load_tokenizer(tmp_path):
    """Old checkpoints record "TokenizersBackend" beside a Qwen2 config.json: AutoTokenizer rebuilds them as a
    Qwen2Tokenizer that loses the spaces; load_tokenizer reads the saved pipeline instead."""
    old = char_tokenizer_before_the_fix()
    directory = tmp_path / "old"
    build_model("tiny-qwen2", seed=0).save_pretrained(directory)
    old.save_pretrained(directory)
    assert json.loads((directory / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    assert ids(load_tokenizer(str(directory))) == ids(old) == ids(load_tokenizer())
    assert ids(AutoTokenizer.from_pretrained(directory), ["reverse: hello="]) != ids(old, ["reverse: hello="])


def test_save_tokenizer_warns_when_plain_auto_tokenizer_would_differ(tmp_path):
    with pytest.warns(UserWarning, match="AutoTokenizer.from_pretrained"):
        directory = model_dir_with(char_tokenizer_before_the_fix(), tmp_path / "ckpt")
    assert ids(load_tokenizer(str(directory))) == ids(load_tokenizer())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model that has memorised some of EXAMPLES (so its answers differ from prompt to prompt), saved."""
    strategy = HFStrategy(StrategyConfig(model="tiny-qwen2", seed=0, optimizer=OptimizerConfig(lr=3e-3)))
    data = PromptDataset(EXAMPLES)
    for _ in range(100):
        strategy.train_step(collate_sft(data, range(len(data)), strategy.tokenizer), SFTLoss(), "token")
    path = tmp_path_factory.mktemp("portable") / "actor"
    strategy.save_checkpoint(str(path))
    return strategy, path


def baton_completions(strategy, prompts: list[str], max_new_tokens: int) -> list[str]:
    batch = collate_prompts(PromptDataset([{"prompt": p, "answer": ""} for p in prompts]), range(len(prompts)),
                            strategy.tokenizer)
    out = strategy.generate(batch, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, n=1))
    return strategy.tokenizer.batch_decode(out.batch["responses"], skip_special_tokens=True)


def plain_transformers_completions(path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """What someone without baton would run on the checkpoint directory."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def test_plain_transformers_scores_a_checkpoint_as_baton_does(checkpoint):
    strategy, path = checkpoint
    prompts, answers = [e["prompt"] for e in EXAMPLES], [e["answer"] for e in EXAMPLES]
    assert ids(AutoTokenizer.from_pretrained(path), prompts) == ids(strategy.tokenizer, prompts)

    ours = baton_completions(strategy, prompts, max_new_tokens=4)
    theirs = plain_transformers_completions(path, prompts, max_new_tokens=4)
    assert theirs == ours
    accuracy = sum(c == a for c, a in zip(ours, answers)) / len(answers)
    assert 0.25 < accuracy < 1.0 and len(set(ours)) > 2  # a model whose answers depend on the prompt
    reloaded = HFStrategy(StrategyConfig(model=str(path), tokenizer=str(path)))  # baton's own reload, for good measure
    assert baton_completions(reloaded, prompts, max_new_tokens=4) == ours
