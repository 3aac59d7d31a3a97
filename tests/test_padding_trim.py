"""A micro-batch's all-padding columns are dropped before the model runs (baton.strategy.padding), and the
strategy's outputs and updates stay those of the padded micro-batch."""

from __future__ import annotations

import pytest
import torch

from baton.data import DataProto
from baton.rl.losses import SFTLoss
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.strategy.hf import HFStrategy
from baton.strategy.padding import pad_responses, trim_padding
from conftest import padded_batch


def test_drops_the_columns_that_are_padding_in_every_row():
    batch = padded_batch([2, 3], [1, 2], prompt_width=6, response_width=5)
    trimmed, tail = trim_padding(batch)
    assert tail == 3
    t = trimmed.batch
    assert t["input_ids"].shape == (2, 3 + 2) and t["attention_mask"].shape == (2, 5)  # 3 pad columns each side
    assert torch.equal(t["input_ids"], batch.batch["input_ids"][:, 3:8])
    assert torch.equal(t["position_ids"], batch.batch["position_ids"][:, 3:8])
    assert t["responses"].shape == (2, 2) and t["response_mask"].shape == (2, 2) and t["advantages"].shape == (2, 2)
    assert t["top_ids"].shape == (2, 2, 2)
    assert torch.equal(t["prompts"], batch.batch["prompts"])  # prompt-width: not a sequence or response column
    assert list(trimmed.non_tensor_batch["uid"]) == [0, 1] and trimmed.meta_info == {"temperature": 1.0}
    assert t["attention_mask"].sum() == batch.batch["attention_mask"].sum()  # every real token kept


def test_keeps_the_last_prompt_column_and_one_response_column():
    batch = padded_batch([1, 1], [0, 0], prompt_width=4, response_width=3)
    trimmed, tail = trim_padding(batch)
    assert tail == 2 and trimmed.batch["input_ids"].shape == (2, 1 + 1)


def test_a_batch_without_padding_columns_or_without_the_columns_comes_back_as_it_is():
    full = padded_batch([4, 2], [1, 3], prompt_width=4, response_width=3)
    same, tail = trim_padding(full)
    assert same is full and tail == 0
    other = DataProto.from_dict({"x": torch.zeros(2, 3)})
    assert trim_padding(other) == (other, 0)


def test_equal_prompt_and_response_widths_drop_only_the_left_padding():
    batch = padded_batch([1, 2], [1, 1], prompt_width=3, response_width=3)  # "prompts" is as wide as "responses"
    trimmed, tail = trim_padding(batch)
    assert tail == 0 and trimmed.batch["input_ids"].shape == (2, 2 + 3)
    assert trimmed.batch["responses"].shape == (2, 3) and trimmed.batch["prompts"].shape == (2, 3)


def test_pad_responses_restores_the_width_with_zeros():
    out = pad_responses({"log_probs": torch.ones(2, 3), "top": torch.ones(2, 3, 4)}, 2)
    assert out["log_probs"].shape == (2, 5) and out["top"].shape == (2, 5, 4)
    assert out["log_probs"][:, 3:].abs().sum() == 0 and out["log_probs"][:, :3].sum() == 6


def strategy(trim: bool, micro_batch_rows: int | None = 2) -> HFStrategy:
    # Packing off: a packed pass runs no padding at all, so trimming would change nothing to compare.
    return HFStrategy(StrategyConfig(model="tiny-qwen2", seed=0, trim_padding=trim, optimizer=OptimizerConfig(lr=1e-2),
                                     micro_batch_size_per_worker=micro_batch_rows, packing=False))


@pytest.fixture(scope="module")
def batch():
    # Rows 0-1 are short: as a micro-batch of two they carry 5 prompt and 4 response columns of padding only.
    return padded_batch([2, 3, 8, 1], [1, 2, 6, 6], prompt_width=8, response_width=6, seed=1)


def test_outputs_at_real_tokens_match_the_padded_micro_batch(batch):
    trimmed, untrimmed = strategy(True).forward(batch), strategy(False).forward(batch)
    mask = batch.batch["response_mask"].bool()
    for key in ("log_probs", "entropy"):
        a, b = trimmed.batch[key], untrimmed.batch[key]
        assert a.shape == b.shape == (4, 6)
        torch.testing.assert_close(a[mask], b[mask], rtol=1e-5, atol=1e-5)
    # The first micro-batch (rows 0-1) ran 2 response columns wide: its other 4 come back as zeros, as padding
    # positions do untrimmed (the LM head runs on real tokens only).
    assert trimmed.batch["log_probs"][:2, 2:].abs().sum() == 0 == untrimmed.batch["log_probs"][:2, 2:].abs().sum()
    top_a, top_b = strategy(True).top_k_log_probs(batch, 3), strategy(False).top_k_log_probs(batch, 3)
    torch.testing.assert_close(top_a.batch["top_k_log_probs"][mask], top_b.batch["top_k_log_probs"][mask],
                               rtol=1e-5, atol=1e-5)


def test_a_value_model_gives_the_same_values(batch):
    def values(trim: bool):
        s = HFStrategy(StrategyConfig(model="tiny-qwen2", kind="value", seed=0, trim_padding=trim,
                                      micro_batch_size_per_worker=2, packing=False))
        return s.forward(batch).batch["values"]

    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(values(True)[mask], values(False)[mask], rtol=1e-5, atol=1e-5)


def test_train_steps_match_the_padded_micro_batches(batch):
    # The gradients, not the updated weights: AdamW's first step moves a weight by ±lr whatever the size of its
    # gradient, so a gradient of 1e-12 against -1e-12 (float rounding) would move it 2 lr apart.
    sft = batch.select(["input_ids", "attention_mask", "position_ids", "responses", "response_mask"])
    a, b = strategy(True), strategy(False)
    ma, mb = a.train_step(sft, SFTLoss(), "token"), b.train_step(sft, SFTLoss(), "token")
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-6)
    assert ma["grad_norm"] == pytest.approx(mb["grad_norm"], rel=1e-5)
    for (name, pa), pb in zip(a.hf_model.named_parameters(), b.hf_model.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_one_micro_batch_of_the_whole_batch_is_not_changed(batch):
    # A batch is padded to its own longest prompt and response, so without micro-batching nothing is dropped and
    # the outputs are bit for bit the untrimmed ones.
    assert torch.equal(strategy(True, None).forward(batch).batch["log_probs"],
                       strategy(False, None).forward(batch).batch["log_probs"])
