"""Moving a strategy's state: checkpoints (exact resumption, HF format, safe overwrites, interrupted writes),
weight export/import and offload/reload, for the hf and mock strategies."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from baton.data import DataProto
from baton.strategy import OptimizerConfig, SamplingParams, SchedulerConfig, StrategyConfig, create_strategy
from baton.strategy import hf

PROMPTS = ["1+1=", "12+30=", "7*8="]
SCHEDULER = SchedulerConfig(name="linear", warmup_steps=2, total_steps=10)  # so the scheduler's state matters


def make_strategy(**overrides):
    config = {"model": "tiny-qwen2", "seed": 0, "optimizer": OptimizerConfig(lr=1e-3), "scheduler": SCHEDULER,
              **overrides}
    return create_strategy(StrategyConfig(**config))


def encode(strategy) -> DataProto:
    strategy.tokenizer.padding_side = "left"
    enc = strategy.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]})


def pg_loss(outputs, micro_batch):
    mask = micro_batch.batch["response_mask"]
    advantages = torch.linspace(-1.0, 1.0, len(micro_batch))[:, None]
    return -(advantages * outputs["log_probs"] * mask).sum(), {}


def params(strategy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in strategy.hf_model.state_dict().items()}


def same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def prompts():
    return encode(make_strategy())


@pytest.fixture(scope="module")
def batch(prompts):
    return make_strategy().generate(prompts, SamplingParams(max_new_tokens=10, n=2, seed=1))


def test_round_trip_resumes_training_and_sampling_exactly(tmp_path, prompts, batch):
    path = str(tmp_path / "ckpt")
    original = make_strategy()
    original.generate(prompts, SamplingParams(max_new_tokens=4))  # advance the sampling generator
    for _ in range(2):
        original.train_step(batch, pg_loss)
    original.save_checkpoint(path)
    expected_metrics = original.train_step(batch, pg_loss)
    expected_params = params(original)
    expected_samples = original.generate(prompts, SamplingParams(max_new_tokens=8, n=2))

    resumed = make_strategy(seed=1)  # different weights and generator until the checkpoint is loaded
    resumed.load_checkpoint(path)
    assert resumed.global_step == 2
    metrics = resumed.train_step(batch, pg_loss)
    assert metrics["loss"] == expected_metrics["loss"]
    assert metrics["grad_norm"] == expected_metrics["grad_norm"]
    assert metrics["lr"] == expected_metrics["lr"] == pytest.approx(1e-3)  # step 2: after the 2-step warm-up
    assert same_params(params(resumed), expected_params)
    assert resumed.generate(prompts, SamplingParams(max_new_tokens=8, n=2)).equals(expected_samples)


def test_checkpoint_opens_with_plain_transformers(tmp_path, batch):
    path = str(tmp_path / "ckpt")
    strategy = make_strategy()
    strategy.train_step(batch, pg_loss)
    strategy.save_checkpoint(path)

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id) == (0, 1, 2)
    assert tokenizer("12+30=")["input_ids"] == strategy.tokenizer("12+30=")["input_ids"]
    data = batch.batch
    inputs = {"input_ids": data["input_ids"], "attention_mask": data["attention_mask"],
              "position_ids": data["position_ids"]}
    with torch.no_grad():
        loaded = model(**inputs).logits
        own = strategy.hf_model.eval()(**inputs).logits
        untrained = make_strategy().hf_model.eval()(**inputs).logits
    torch.testing.assert_close(loaded, own, atol=1e-6, rtol=0)
    assert not torch.allclose(loaded, untrained, atol=1e-4)  # the trained weights were saved, not the initial ones


def test_save_overwrites_only_when_asked(tmp_path, batch):
    path = str(tmp_path / "ckpt")
    strategy = make_strategy()
    strategy.train_step(batch, pg_loss)
    strategy.save_checkpoint(path)
    first = params(strategy)
    strategy.train_step(batch, pg_loss)

    with pytest.raises(FileExistsError, match="overwrite=True"):
        strategy.save_checkpoint(path)
    reader = make_strategy()
    reader.load_checkpoint(path)
    assert same_params(params(reader), first) and reader.global_step == 1

    (tmp_path / "ckpt.old").mkdir()  # as a save interrupted between its two renames leaves it
    (tmp_path / "ckpt.old" / "stale").write_text("")
    strategy.save_checkpoint(path, overwrite=True)
    reader.load_checkpoint(path)
    assert same_params(params(reader), params(strategy)) and reader.global_step == 2
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .partial or .old left behind


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path, batch, monkeypatch):
    path = str(tmp_path / "ckpt")
    strategy = make_strategy()
    strategy.train_step(batch, pg_loss)
    strategy.save_checkpoint(path)
    saved = params(strategy)
    strategy.train_step(batch, pg_loss)

    real_save, calls = hf.save_state, []

    def failing_save(path, obj):  # the model files are written; the second state file fails
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        return real_save(path, obj)

    monkeypatch.setattr(hf, "save_state", failing_save)
    with pytest.raises(OSError, match="disk full"):
        strategy.save_checkpoint(path, overwrite=True)
    monkeypatch.undo()
    assert len(calls) == 2
    reader = make_strategy()
    reader.load_checkpoint(path)
    assert same_params(params(reader), saved) and reader.global_step == 1

    strategy.save_checkpoint(path, overwrite=True)  # a later save replaces it and clears the partial write
    reader.load_checkpoint(path)
    assert same_params(params(reader), params(strategy))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_loading_something_else_is_a_clear_error(tmp_path):
    strategy = make_strategy()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    for path in (tmp_path / "model", tmp_path / "missing"):
        with pytest.raises(FileNotFoundError, match="is not a baton checkpoint"):
            strategy.load_checkpoint(str(path))


def test_critic_from_a_policy_checkpoint(tmp_path, batch):
    policy_path, critic_path = str(tmp_path / "policy"), str(tmp_path / "critic")
    policy = make_strategy()
    policy.train_step(batch, pg_loss)
    policy.save_checkpoint(policy_path)

    critic, twin = make_strategy(kind="value", model=policy_path), make_strategy(kind="value", model=policy_path)
    backbone = {k.removeprefix("model."): v for k, v in params(policy).items() if k.startswith("model.")}
    critic_backbone = {k.removeprefix("model."): v for k, v in params(critic).items() if k.startswith("model.")}
    assert same_params(critic_backbone, backbone)
    assert same_params(params(twin), params(critic))  # the new value head is seeded by the config
    values = critic.forward(batch)

    def mse(outputs, micro_batch):
        torch.testing.assert_close(outputs["values"], values.batch["values"][: len(micro_batch)], atol=1e-5, rtol=0)
        return ((outputs["values"] * micro_batch.batch["response_mask"]) ** 2).sum(), {}

    critic.train_step(batch, mse)  # train-mode values equal forward's: no dropout in the head
    critic.save_checkpoint(critic_path)
    twin.load_checkpoint(critic_path)
    assert twin.forward(batch).equals(critic.forward(batch))


def test_export_and_import_weights_in_buckets(batch):
    trained = make_strategy()
    trained.train_step(batch, pg_loss)
    bucket_bytes = 64 << 10
    buckets = list(trained.export_weights(bucket_bytes))
    assert len(buckets) > 2
    names = [name for bucket in buckets for name in bucket]
    assert sorted(names) == sorted(trained.hf_model.state_dict())
    for bucket in buckets[:-1]:  # a bucket closes as soon as it reaches the size
        sizes = [t.numel() * t.element_size() for t in bucket.values()]
        assert sum(sizes) >= bucket_bytes > sum(sizes) - sizes[-1]

    receiver = make_strategy(seed=1)
    receiver.import_weights(buckets[:1])  # any subset
    assert all(torch.equal(v, buckets[0][k]) for k, v in params(receiver).items() if k in buckets[0])
    assert not same_params(params(receiver), params(trained))
    receiver.import_weights(iter(buckets))
    assert same_params(params(receiver), params(trained))
    assert receiver.hf_model.lm_head.weight is receiver.hf_model.model.embed_tokens.weight  # still tied
    assert receiver.forward(batch).equals(trained.forward(batch))
    with pytest.raises(ValueError, match="do not exist in this model"):
        receiver.import_weights([{"score.weight": torch.zeros(1, 128)}])


def test_offload_and_reload_are_no_ops_on_cpu(batch):
    strategy = make_strategy()
    strategy.train_step(batch, pg_loss)
    before, state = strategy.forward(batch), params(strategy)
    strategy.offload()
    assert all(p.device.type == "cpu" for p in strategy.hf_model.parameters())
    assert strategy.forward(batch).equals(before)
    strategy.reload()
    assert strategy.forward(batch).equals(before)
    assert all(torch.equal(v, state[k]) for k, v in params(strategy).items())
    strategy.train_step(batch, pg_loss)  # optimizer state still usable


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_moves_parameters_and_optimizer_state_off_the_gpu(batch):
    strategy = make_strategy()
    assert strategy.device.type == "cuda"
    strategy.train_step(batch, pg_loss)
    before = strategy.forward(batch)

    def optimizer_tensors():  # AdamW's moments (its 0-dim step counters stay on the CPU)
        return [v for state in strategy.optimizer.state.values() for v in state.values() if v.dim() > 0]

    strategy.offload()
    assert all(p.device.type == "cpu" and p.grad.device.type == "cpu" for p in strategy.hf_model.parameters())
    assert optimizer_tensors() and all(t.device.type == "cpu" for t in optimizer_tensors())
    strategy.reload()
    assert all(p.device.type == "cuda" for p in strategy.hf_model.parameters())
    assert all(t.device.type == "cuda" for t in optimizer_tensors())
    torch.testing.assert_close(strategy.forward(batch).batch["log_probs"], before.batch["log_probs"])
    strategy.train_step(batch, pg_loss)


def test_mock_training_weights_and_checkpoint(tmp_path, prompts):
    path = str(tmp_path / "mock")
    mock = make_strategy(name="mock", optimizer=OptimizerConfig(lr=0.1))
    rollout = mock.generate(prompts, SamplingParams(max_new_tokens=6))
    assert torch.all(mock.forward(rollout).batch["log_probs"] == -1.0)

    def towards_half(outputs, micro_batch):  # the gradient changes as the scalar moves, so AdamW's state matters
        return (((outputs["log_probs"] - 0.5) ** 2) * micro_batch.batch["response_mask"]).sum(), {}

    assert mock.train_step(rollout, towards_half)["loss"] == pytest.approx(1.5**2)
    after = mock.forward(rollout)
    assert float(after.batch["log_probs"][0, 0]) == pytest.approx(-0.9, abs=1e-6)  # AdamW's first step: lr 0.1

    other = make_strategy(name="mock")
    other.import_weights(mock.export_weights())
    assert other.forward(rollout).equals(after)
    with pytest.raises(ValueError, match="holds one weight"):
        other.import_weights([{"model.embed_tokens.weight": torch.zeros(1)}])

    mock.save_checkpoint(path)
    with pytest.raises(FileExistsError):
        mock.save_checkpoint(path)
    expected = mock.train_step(rollout, towards_half), mock.forward(rollout)
    resumed = make_strategy(name="mock", optimizer=OptimizerConfig(lr=0.1))
    resumed.load_checkpoint(path)
    assert resumed.global_step == 1
    assert resumed.train_step(rollout, towards_half) == expected[0]
    assert resumed.forward(rollout).equals(expected[1])
