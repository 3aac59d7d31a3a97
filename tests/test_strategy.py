"""The HF and mock strategies in-process: sampling, log-probs, training, critics, the factory and validation.

Everything runs on the tiny Qwen2 model and the shipped character tokenizer; reference values are
recomputed from the plain transformers model. Checkpoints are in test_checkpoint.py.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from baton.data import DataProto
from baton.strategy import (
    OptimizerConfig,
    SamplingParams,
    SchedulerConfig,
    StrategyConfig,
    create_strategy,
    strategy_class,
)
from baton.strategy.mock import MockStrategy

PROMPTS = ["1+1=", "12+30=", "7*8="]  # different lengths, so the batch is left padded
ANSWERS = ["2", "42", "56"]
PAD, EOS = 0, 1


def make_strategy(**overrides):
    config = {"model": "tiny-qwen2", "seed": 0, "optimizer": OptimizerConfig(lr=1e-3), **overrides}
    return create_strategy(StrategyConfig(**config))


def encode(strategy) -> DataProto:
    strategy.tokenizer.padding_side = "left"
    enc = strategy.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    return DataProto.from_dict({"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]},
                               {"ground_truth": ANSWERS})


def positions(attention_mask: torch.Tensor) -> torch.Tensor:
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def model_logits(strategy, batch: DataProto) -> torch.Tensor:
    """Full-vocabulary logits of the plain HF model at the positions that predict each response token."""
    data = batch.batch
    with torch.no_grad():
        logits = strategy.hf_model.eval()(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                                          position_ids=data["position_ids"]).logits
    return logits[:, -data["responses"].shape[1] - 1 : -1].float()


def greedy_reference(strategy, prompts: DataProto, steps: int) -> torch.Tensor:
    """`steps` argmax tokens per prompt, recomputing the whole sequence every step (no cache, no stopping)."""
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    tokens = []
    with torch.no_grad():
        for _ in range(steps):
            logits = strategy.hf_model.eval()(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
            token = logits[:, -1].argmax(-1)
            tokens.append(token)
            ids = torch.cat([ids, token[:, None]], 1)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(tokens, 1)  # [batch, steps]


def truncate_at(tokens: torch.Tensor, stop: set[int]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """What generate should return for these unstopped sequences: (responses, response_mask, finish_reason)."""
    responses, mask, reasons = torch.full_like(tokens, PAD), torch.zeros_like(tokens), []
    for row, seq in enumerate(tokens.tolist()):
        end = next((i + 1 for i, t in enumerate(seq) if t in stop), len(seq))
        responses[row, :end], mask[row, :end] = tokens[row, :end], 1
        reasons.append("stop" if seq[end - 1] in stop else "length")
    width = int(mask.sum(1).max())
    return responses[:, :width], mask[:, :width], reasons


@pytest.fixture(scope="module")
def strategy():
    """Shared, never trained; tests that use its own generator build their own strategy."""
    return make_strategy()


@pytest.fixture(scope="module")
def prompts(strategy):
    return encode(strategy)


@pytest.fixture(scope="module")
def rollout(strategy, prompts):
    """6 rows of sampled responses of different lengths."""
    batch = strategy.generate(prompts, SamplingParams(max_new_tokens=12, n=2, seed=1))
    assert len(set(batch.batch["response_mask"].sum(1).tolist())) > 1  # the tests below need uneven lengths
    return batch


# --- generate ---------------------------------------------------------------------------------------


def test_generate_output_layout(strategy, prompts):
    out = strategy.generate(prompts, SamplingParams(max_new_tokens=10, n=2, seed=3))
    rows, prompt_len = 6, prompts.batch["input_ids"].shape[1]
    data = out.batch
    response_len = data["responses"].shape[1]
    assert 1 <= response_len <= 10
    assert set(data) == {"prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
                         "rollout_log_probs"}
    for key, width in [("prompts", prompt_len), ("responses", response_len), ("response_mask", response_len),
                       ("rollout_log_probs", response_len), ("input_ids", prompt_len + response_len),
                       ("attention_mask", prompt_len + response_len), ("position_ids", prompt_len + response_len)]:
        assert data[key].shape == (rows, width), key
    assert data["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(data["prompts"], prompts.batch["input_ids"].repeat_interleave(2, 0))
    assert torch.equal(data["input_ids"], torch.cat([data["prompts"], data["responses"]], 1))
    assert torch.equal(data["attention_mask"],
                       torch.cat([prompts.batch["attention_mask"].repeat_interleave(2, 0), data["response_mask"]], 1))
    real = data["attention_mask"].bool()
    assert torch.equal(data["position_ids"][real], positions(data["attention_mask"])[real])
    mask = data["response_mask"].bool()
    assert torch.all(data["responses"][~mask] == PAD)
    assert torch.all(data["rollout_log_probs"][~mask] == 0) and torch.all(data["rollout_log_probs"][mask] < 0)
    lengths = mask.sum(1)
    # a response is a prefix of 1s, and it ends in eos exactly when it finished with "stop"
    assert torch.equal(mask, torch.arange(response_len)[None] < lengths[:, None])
    last = data["responses"][torch.arange(rows), lengths - 1]
    assert out.non_tensor_batch["finish_reason"].tolist() == ["stop" if t == EOS else "length" for t in last.tolist()]
    assert all(length == 10 for length, t in zip(lengths.tolist(), last.tolist()) if t != EOS)


def test_seeded_generate_is_reproducible(strategy, prompts):
    params = dict(max_new_tokens=12, n=2, temperature=1.0)
    a = strategy.generate(prompts, SamplingParams(**params, seed=7))
    b = strategy.generate(prompts, SamplingParams(**params, seed=7))
    c = strategy.generate(prompts, SamplingParams(**params, seed=8))
    assert a.equals(b)
    assert not a.equals(c)


def test_own_generator_replays_from_the_config_seed(prompts):
    params = SamplingParams(max_new_tokens=8, n=2)
    first, second = make_strategy(), make_strategy()
    calls_first = [first.generate(prompts, params) for _ in range(2)]
    calls_second = [second.generate(prompts, params) for _ in range(2)]
    assert calls_first[0].equals(calls_second[0]) and calls_first[1].equals(calls_second[1])
    assert not calls_first[0].equals(calls_first[1])  # the generator advances between calls


def test_max_new_tokens_bounds_length_and_marks_length(strategy, prompts):
    out = strategy.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0))
    greedy = greedy_reference(strategy, prompts, 3)
    assert EOS not in greedy.tolist()  # so every row must be cut by the limit
    assert out.batch["responses"].shape == (3, 3)
    assert out.batch["response_mask"].all()
    assert out.non_tensor_batch["finish_reason"].tolist() == ["length"] * 3


def test_n_samples_are_consecutive_and_repeat_non_tensor_columns(strategy, prompts):
    out = strategy.generate(prompts, SamplingParams(max_new_tokens=6, n=3, seed=2))
    assert len(out) == 9
    assert torch.equal(out.batch["prompts"].view(3, 3, -1), prompts.batch["input_ids"][:, None].expand(3, 3, -1))
    assert out.non_tensor_batch["ground_truth"].tolist() == [a for a in ANSWERS for _ in range(3)]
    # the samples of one prompt are different draws, not copies
    assert len({tuple(row) for row in out.batch["responses"][:3].tolist()}) > 1
    greedy = strategy.generate(prompts, SamplingParams(max_new_tokens=6, n=2, temperature=0))
    single = strategy.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))
    assert torch.equal(greedy.batch["responses"], single.batch["responses"].repeat_interleave(2, 0))


def test_temperature_zero_is_argmax_of_the_model(strategy, prompts):
    steps = 12
    reference, mask, reasons = truncate_at(greedy_reference(strategy, prompts, steps), {EOS})
    out = strategy.generate(prompts, SamplingParams(max_new_tokens=steps, temperature=0))
    assert torch.equal(out.batch["responses"], reference)
    assert torch.equal(out.batch["response_mask"], mask)
    assert out.non_tensor_batch["finish_reason"].tolist() == reasons
    # greedy reports temperature-1 log-probs of the chosen tokens
    log_probs = torch.log_softmax(model_logits(strategy, out), -1).gather(-1, reference[..., None]).squeeze(-1)
    torch.testing.assert_close(out.batch["rollout_log_probs"], log_probs * mask, atol=1e-4, rtol=0)


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}], ids=["top_k=1", "top_p=1e-6"])
def test_degenerate_filters_equal_greedy(strategy, prompts, filters):
    greedy = strategy.generate(prompts, SamplingParams(max_new_tokens=12, temperature=0))
    filtered = strategy.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5, **filters))
    unfiltered = strategy.generate(prompts, SamplingParams(max_new_tokens=12, temperature=1.0, seed=5))
    assert not unfiltered.equals(greedy)  # the seed does sample something else without the filter
    for key in ("responses", "response_mask"):
        assert torch.equal(filtered.batch[key], greedy.batch[key])
    torch.testing.assert_close(filtered.batch["rollout_log_probs"], greedy.batch["rollout_log_probs"])


def test_stop_token_ids_end_responses(strategy, prompts):
    steps = 12
    unstopped = greedy_reference(strategy, prompts, steps)
    stop = int(unstopped[0, 1])  # a token greedy decoding produces after the first step
    assert int(unstopped[0, 0]) != stop
    responses, mask, reasons = truncate_at(unstopped, {stop})
    out = strategy.generate(prompts, SamplingParams(max_new_tokens=steps, temperature=0, stop_token_ids=(stop,)))
    assert torch.equal(out.batch["responses"], responses)
    assert torch.equal(out.batch["response_mask"], mask)
    assert out.non_tensor_batch["finish_reason"].tolist() == reasons
    assert reasons[0] == "stop" and out.batch["response_mask"][0].tolist()[:3] == [1, 1, 0]
    assert out.batch["responses"][0, 1] == stop and torch.all(out.batch["responses"][0, 2:] == PAD)


def test_right_padded_prompts_are_rejected(strategy):
    strategy.tokenizer.padding_side = "right"
    enc = strategy.tokenizer(PROMPTS, return_tensors="pt", padding=True)
    strategy.tokenizer.padding_side = "left"
    with pytest.raises(ValueError, match="LEFT-padded"):
        strategy.generate(DataProto.from_dict(dict(enc)), SamplingParams(max_new_tokens=2))


# --- forward / log-probs ---------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 7, None], ids=["chunk=1", "chunk=7", "chunk=default"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forward_matches_full_softmax(rollout, chunk_size, temperature):
    strategy = make_strategy() if chunk_size is None else make_strategy(logprob_chunk_size=chunk_size)
    out = strategy.forward(rollout, temperature=temperature)
    assert set(out.batch) == {"log_probs", "entropy"}
    log_softmax = torch.log_softmax(model_logits(strategy, rollout) / temperature, -1)
    expected = log_softmax.gather(-1, rollout.batch["responses"][..., None]).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    # At the real response tokens; a padding position skips the LM head and gets zeros.
    real = rollout.batch["attention_mask"][:, -expected.shape[1]:].bool()
    assert not real.all()
    torch.testing.assert_close(out.batch["log_probs"][real], expected[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.batch["entropy"][real], entropy[real], atol=1e-5, rtol=0)
    assert out.batch["log_probs"][~real].abs().sum() == 0 == out.batch["entropy"][~real].abs().sum()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_log_probs_match_forward(strategy, prompts, temperature):
    out = strategy.generate(prompts, SamplingParams(max_new_tokens=12, n=2, temperature=temperature, seed=4))
    mask = out.batch["response_mask"].bool()
    forward = strategy.forward(out, temperature=temperature).batch["log_probs"]
    torch.testing.assert_close(out.batch["rollout_log_probs"][mask], forward[mask], atol=1e-4, rtol=0)


def test_forward_derives_missing_position_ids(strategy, rollout):
    without = DataProto.from_dict({k: v for k, v in rollout.batch.items() if k != "position_ids"})
    assert strategy.forward(without).equals(strategy.forward(rollout))


def test_the_samples_of_a_prompt_share_its_pass(strategy, prompts, rollout):
    """Generation prefills each prompt once; forward runs each distinct prompt once, then the responses per row
    (the log-probs still equal the plain model's: test_forward_matches_full_softmax)."""
    shapes = []  # [rows, columns] of each model call
    embed = strategy.hf_model.model.embed_tokens
    hook = embed.register_forward_hook(lambda module, args, out: shapes.append(out.shape[:2]))
    try:
        strategy.generate(prompts, SamplingParams(max_new_tokens=2, n=2, seed=0, stop_token_ids=(-1,)))
        generate_shapes, shapes[:] = list(shapes), []
        strategy.forward(rollout)
    finally:
        hook.remove()
    prompt_len, response_len = rollout.batch["prompts"].shape[1], rollout.batch["responses"].shape[1]
    assert generate_shapes == [(3, prompt_len), (6, 1)]
    assert shapes == [(3, prompt_len), (6, response_len - 1)]

    # One repeated prompt among distinct ones (where a sampler's epochs meet) is not worth a second pass.
    mostly_distinct = rollout[[0, 1, 2, 4]]  # prompts a, a, b, c
    assert torch.equal(mostly_distinct.batch["prompts"][0], mostly_distinct.batch["prompts"][1])
    shapes.clear()
    hook = embed.register_forward_hook(lambda module, args, out: shapes.append(out.shape[:2]))
    try:
        strategy.forward(mostly_distinct)
    finally:
        hook.remove()
    assert shapes == [(4, prompt_len + response_len)]


def test_stopped_rows_leave_the_batch(strategy, prompts):
    """Rows that have stopped are not run again (the responses are checked against a reference by
    test_stop_token_ids_end_responses)."""
    first = greedy_reference(strategy, prompts, 1)[:, 0]
    stop = int(first[0])
    rows_per_call = []
    embed = strategy.hf_model.model.embed_tokens
    hook = embed.register_forward_hook(lambda module, args, out: rows_per_call.append(len(out)))
    try:
        strategy.generate(prompts, SamplingParams(max_new_tokens=3, temperature=0, stop_token_ids=(stop,)))
    finally:
        hook.remove()
    assert rows_per_call[:2] == [3, int((first != stop).sum())] and rows_per_call[1] < 3


# --- train_step -------------------------------------------------------------------------------------


def pg_loss(outputs, micro_batch):
    """A policy-gradient-style token loss (sum over tokens) that also pulls on the entropy."""
    mask = micro_batch.batch["response_mask"]
    advantages = micro_batch.batch["advantages"][:, None]
    loss_sum = -((advantages * outputs["log_probs"] + 0.01 * outputs["entropy"]) * mask).sum()
    return loss_sum, {"rows": len(micro_batch)}


@pytest.fixture(scope="module")
def train_batch(rollout):
    batch = DataProto.from_dict({k: v.clone() for k, v in rollout.batch.items()}, dict(rollout.non_tensor_batch),
                                meta_info=dict(rollout.meta_info))  # the temperature it was sampled at (1)
    batch.batch["advantages"] = torch.linspace(-1.0, 1.0, len(batch))
    return batch


def train(strategy, batch, steps=2, loss_fn=pg_loss, loss_unit="token"):
    """Returns the metrics of each step and the micro-batch row counts the loss function saw."""
    seen, metrics = [], []

    def recording_loss(outputs, micro_batch):
        seen.append(len(micro_batch))
        return loss_fn(outputs, micro_batch)

    for _ in range(steps):
        metrics.append(strategy.train_step(batch, recording_loss, loss_unit=loss_unit))
    return metrics, seen


def params(strategy) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in strategy.hf_model.state_dict().items()}


def assert_params_close(a, b, atol=1e-4):
    """Parameters after AdamW steps (lr 1e-3) agree to a tenth of one step's largest move. Adam divides by
    sqrt(v) + eps, so where a gradient is near eps (1e-8) float reassociation alone (another micro-batch split,
    the prompt shared by a prompt's samples) moves an update by ~1e-5; the gradients themselves agree to ~1e-7."""
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def reference_training(train_batch):
    """Two steps on the whole batch at once, no clipping (so the gradient's scale shows in grad_norm)."""
    strategy = make_strategy(grad_clip=None)
    before = strategy.forward(train_batch).batch
    metrics, seen = train(strategy, train_batch)
    return before, metrics, seen, params(strategy)


def test_loss_is_normalised_by_the_token_count(train_batch, reference_training):
    before, metrics, seen, _ = reference_training
    expected = pg_loss(before, train_batch)[0] / train_batch.batch["response_mask"].sum()
    assert metrics[0]["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert seen == [6, 6] and metrics[0]["rows"] == 6


def test_train_step_uses_the_batch_temperature(train_batch):
    hot = DataProto(train_batch.batch, train_batch.non_tensor_batch, {"temperature": 0.7})
    strategy = make_strategy()
    before = strategy.forward(hot, temperature=0.7).batch
    expected = pg_loss(before, hot)[0] / hot.batch["response_mask"].sum()
    assert strategy.train_step(hot, pg_loss)["loss"] == pytest.approx(float(expected), abs=1e-5)


@pytest.mark.parametrize("split, expected_rows", [
    ({"micro_batch_size_per_worker": 1}, [1] * 6),
    ({"micro_batch_size_per_worker": 3}, [3, 3]),
    ({"max_tokens_per_microbatch": 20}, None),
], ids=["rows=1", "rows=3", "tokens=20"])
def test_micro_batching_gives_the_same_update(train_batch, reference_training, split, expected_rows):
    _, ref_metrics, _, ref_params = reference_training
    strategy = make_strategy(grad_clip=None, **split)
    metrics, seen = train(strategy, train_batch)
    if expected_rows is not None:
        assert seen == expected_rows * 2
    else:  # every micro-batch fits the budget unless it is a single longer row
        assert len(seen) > 2 and sum(seen) == 12
        real = train_batch.batch["attention_mask"].sum(1).tolist()
        start = 0
        for rows in seen[: len(seen) // 2]:
            assert rows == 1 or sum(real[start : start + rows]) <= 20
            start += rows
    for ref, got in zip(ref_metrics, metrics):
        assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert_params_close(params(strategy), ref_params)


def test_sequence_loss_unit(train_batch):
    def sequence_loss(outputs, micro_batch):  # per-sequence mean log-prob, summed over sequences
        mask = micro_batch.batch["response_mask"]
        per_row = (micro_batch.batch["advantages"][:, None] * outputs["log_probs"] * mask).sum(1) / mask.sum(1)
        return -per_row.sum(), {}

    whole, split = make_strategy(grad_clip=None), make_strategy(grad_clip=None, micro_batch_size_per_worker=4)
    before = whole.forward(train_batch).batch
    metrics, _ = train(whole, train_batch, loss_fn=sequence_loss, loss_unit="sequence")
    split_metrics, seen = train(split, train_batch, loss_fn=sequence_loss, loss_unit="sequence")
    mask = train_batch.batch["response_mask"]
    expected = -((train_batch.batch["advantages"][:, None] * before["log_probs"] * mask).sum(1) / mask.sum(1)).mean()
    assert metrics[0]["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert seen == [4, 2, 4, 2]
    assert split_metrics[0]["loss"] == pytest.approx(metrics[0]["loss"], abs=1e-5)
    assert_params_close(params(split), params(whole))


def test_gradient_checkpointing_gives_the_same_update(train_batch, reference_training):
    _, ref_metrics, _, ref_params = reference_training
    strategy = make_strategy(grad_clip=None, gradient_checkpointing=True)
    mlp_calls = []
    # a pre-hook: the recomputation in the backward pass stops early, inside the layer's last module
    strategy.hf_model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: mlp_calls.append(1))
    metrics, _ = train(strategy, train_batch)
    assert len(mlp_calls) == 4  # per step: the forward pass, and its recomputation in the backward pass
    assert [m["grad_norm"] for m in metrics] == pytest.approx([m["grad_norm"] for m in ref_metrics], rel=1e-4)
    assert_params_close(params(strategy), ref_params)


def test_grad_clip_reports_the_pre_clip_norm_and_shrinks_the_update(train_batch, reference_training):
    _, ref_metrics, _, _ = reference_training
    unclipped, clipped = make_strategy(grad_clip=None), make_strategy(grad_clip=1e-9)
    start = params(clipped)
    norm_unclipped = train(unclipped, train_batch, steps=1)[0][0]["grad_norm"]
    norm_clipped = train(clipped, train_batch, steps=1)[0][0]["grad_norm"]
    assert norm_unclipped == pytest.approx(ref_metrics[0]["grad_norm"], rel=1e-5)
    assert norm_clipped == pytest.approx(norm_unclipped, rel=1e-5) and norm_clipped > 1.0
    grads = [p.grad for p in clipped.hf_model.parameters()]
    assert float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) == pytest.approx(
        1e-9, rel=1e-3)

    def update_norm(strategy):
        return math.sqrt(sum(float(((v - start[k]) ** 2).sum()) for k, v in params(strategy).items()))

    assert update_norm(clipped) < 0.01 * update_norm(unclipped)


@pytest.mark.parametrize("name, factors", [
    # warm-up (step + 1) / 2 for steps 0, 1; then decay over total - warmup = 4 steps to min_lr_ratio 0.1
    ("linear", [0.5, 1.0, 1.0, 0.775, 0.55, 0.325, 0.1, 0.1]),
    ("cosine", [0.5, 1.0, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)] + [0.1]),
])
def test_scheduler_reports_the_lr_of_each_step(train_batch, name, factors):
    strategy = make_strategy(scheduler=SchedulerConfig(name=name, warmup_steps=2, total_steps=6, min_lr_ratio=0.1))
    applied = []  # the optimizer's lr while the step runs: the lr its update uses

    def loss_fn(outputs, micro_batch):
        applied.append(strategy.optimizer.param_groups[0]["lr"])
        return pg_loss(outputs, micro_batch)

    reported = [strategy.train_step(train_batch[:2], loss_fn)["lr"] for _ in factors]
    expected = [1e-3 * f for f in factors]
    assert applied == pytest.approx(expected, rel=1e-6)
    assert reported == pytest.approx(expected, rel=1e-6)


def test_train_step_rejects_bad_loss_unit(train_batch):
    with pytest.raises(ValueError, match="loss_unit 'tokens' is not one of"):
        make_strategy().train_step(train_batch, pg_loss, loss_unit="tokens")


# --- critic -----------------------------------------------------------------------------------------


def test_value_strategy_forward_and_training(train_batch):
    critic = make_strategy(kind="value")
    response_len = train_batch.batch["responses"].shape[1]
    out = critic.forward(train_batch)
    assert set(out.batch) == {"values"} and out.batch["values"].shape == (6, response_len)
    data = train_batch.batch
    with torch.no_grad():
        logits = critic.hf_model.eval()(input_ids=data["input_ids"], attention_mask=data["attention_mask"],
                                        position_ids=data["position_ids"]).logits
    torch.testing.assert_close(out.batch["values"], logits[:, -response_len - 1 : -1, 0], atol=1e-5, rtol=0)

    trained_on = []

    def mse(outputs, micro_batch):
        trained_on.append(outputs["values"].detach().clone())
        return (((outputs["values"] - 1.0) ** 2) * micro_batch.batch["response_mask"]).sum(), {}

    def error(values):
        mask = data["response_mask"]
        return float((((values - 1.0) ** 2) * mask).sum() / mask.sum())

    metrics = critic.train_step(train_batch, mse)
    # training sees the values forward() reports (no dropout in the value head)
    torch.testing.assert_close(trained_on[0], out.batch["values"], atol=1e-5, rtol=0)
    assert metrics["loss"] == pytest.approx(error(out.batch["values"]), rel=1e-5)
    assert error(critic.forward(train_batch).batch["values"]) < 0.25 * metrics["loss"]


# --- mock strategy ---------------------------------------------------------------------------------


def make_mock(**overrides):
    return make_strategy(name="mock", **overrides)


def test_mock_generate_is_deterministic_and_consistent(prompts):
    mock = make_mock()
    params = SamplingParams(max_new_tokens=6, n=2)
    out = mock.generate(prompts, params)
    assert out.equals(make_mock().generate(prompts, params))
    assert not out.equals(mock.generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=1)))
    data = out.batch
    lengths = data["response_mask"].sum(1)
    assert data["responses"].shape == (6, 6) and torch.all((lengths >= 1) & (lengths <= 6))
    assert torch.equal(data["input_ids"], torch.cat([data["prompts"], data["responses"]], 1))
    last = data["responses"][torch.arange(6), lengths - 1]
    reasons = out.non_tensor_batch["finish_reason"].tolist()
    assert reasons == ["length" if n == 6 else "stop" for n in lengths.tolist()]
    assert all(t == EOS for t, r in zip(last.tolist(), reasons) if r == "stop")
    assert torch.all(data["responses"][data["response_mask"] == 0] == PAD)
    assert out.non_tensor_batch["ground_truth"].tolist() == [a for a in ANSWERS for _ in range(2)]


# --- factory, validation -------------------------------------------------------------------------


def test_factory_names_and_import_paths():
    with pytest.raises(ValueError, match=r"\['fsdp2', 'hf', 'mock', 'vllm'\]"):
        strategy_class("sglang")
    assert strategy_class("baton.strategy.mock:MockStrategy") is MockStrategy
    created = create_strategy(StrategyConfig(name="baton.strategy.mock:MockStrategy"))
    assert isinstance(created, MockStrategy)


@pytest.mark.parametrize("kwargs", [
    {"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}, {"n": 0}, {"max_new_tokens": 0},
])
def test_sampling_params_validation(kwargs):
    with pytest.raises(ValueError, match="bad sampling parameters"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"kind": "reward"}, "kind 'reward'"),
    ({"dtype": "float64"}, "dtype 'float64'"),
    ({"micro_batch_size_per_worker": 2, "max_tokens_per_microbatch": 100}, "not both"),
    ({"micro_batch_size_per_worker": 0}, "micro_batch_size_per_worker must be at least 1"),
    ({"max_tokens_per_microbatch": 0}, "max_tokens_per_microbatch must be at least 1"),
    ({"logprob_chunk_size": 0}, "logprob_chunk_size must be at least 1"),
])
def test_strategy_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StrategyConfig(**kwargs)


def test_entropy_as_a_metric_has_the_same_value_and_no_gradient():
    from baton.strategy.logprobs import token_log_probs

    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    head = torch.nn.Linear(8, 11, bias=False)
    tokens = torch.randint(0, 11, (2, 5))
    lp_grad, ent_grad = token_log_probs(hidden, head, tokens, 0.7, chunk_size=3, entropy_grad=True)
    lp_value, ent_value = token_log_probs(hidden, head, tokens, 0.7, chunk_size=3, entropy_grad=False)
    torch.testing.assert_close(lp_value, lp_grad)
    torch.testing.assert_close(ent_value, ent_grad)
    assert ent_grad.requires_grad and not ent_value.requires_grad and lp_value.requires_grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy,entropy_grad", [(True, True), (True, False), (False, False)])
def test_chunked_log_prob_gradients_match_the_full_softmax(temperature, with_entropy, entropy_grad):
    """The chunk's hand-written backward (`_ChunkedLogProbs`) against autograd through the plain expressions, float64,
    for the hidden states and the (tied) LM head weight; the entropy's gradient only where it is asked for."""
    from baton.strategy.logprobs import token_log_probs

    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    head = torch.nn.Linear(8, 11, bias=False)
    tokens = torch.randint(0, 11, (2, 5))
    lp_weight, ent_weight = torch.randn(2, 5), torch.randn(2, 5)
    log_probs, entropy = token_log_probs(hidden, head, tokens, temperature, chunk_size=3, with_entropy=with_entropy,
                                         entropy_grad=entropy_grad)
    loss = (log_probs * lp_weight).sum() + ((entropy * ent_weight).sum() if entropy_grad else 0)
    grads = torch.autograd.grad(loss, (hidden, head.weight))

    log_softmax = torch.log_softmax(hidden.double() @ head.weight.double().T / temperature, -1)
    expected_lp = log_softmax.gather(-1, tokens[..., None])[..., 0]
    expected_ent = -(log_softmax.exp() * log_softmax).sum(-1) if with_entropy else torch.zeros(2, 5)
    expected_loss = (expected_lp * lp_weight).sum() + ((expected_ent * ent_weight).sum() if entropy_grad else 0)
    expected = torch.autograd.grad(expected_loss, (hidden, head.weight))
    torch.testing.assert_close(log_probs.double(), expected_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy.double(), expected_ent.double(), atol=1e-6, rtol=0)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got.double(), want.double(), atol=1e-6, rtol=1e-5)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors that ops made while this mode was on (their storages, each once); the
    storages of `existing` tensors (which a view op returns again) count nothing."""

    def __init__(self, existing=()):
        super().__init__()
        self.live, self.now, self.peak = {t.untyped_storage().data_ptr(): 0 for t in existing}, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in self.live:
                key, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
                self.live[key] = size
                self.now += size
                self.peak = max(self.peak, self.now)
                weakref.finalize(tensor, self._free, key)
        return out

    def _free(self, key):
        self.now -= self.live.pop(key, 0)


@pytest.mark.parametrize("hidden_size", [8, 64])
def test_the_log_prob_backward_holds_two_chunks_of_logits_and_one_weight_gradient(hidden_size):
    """Peak memory of the LM head's forward and backward, counted tensor by tensor: the hand-written backward holds
    the recomputed log-softmax and the logits' gradient ([chunk, vocab] float32 each) and one gradient of the head's
    weight, whatever the number of chunks. Autograd through the plain expressions, checkpointed per chunk, held 4.6
    chunks of logits (hidden 8); a hand-written function per chunk, the weight's gradient three times (hidden 64)."""
    from baton.strategy.logprobs import chunk_tokens, token_log_probs

    vocab, tokens, chunk = 1000, 64, 16
    hidden = torch.randn(1, tokens, hidden_size, requires_grad=True)
    head = torch.nn.Linear(hidden_size, vocab, bias=False)
    with LiveBytes(existing=(hidden, head.weight)) as memory:
        log_probs, entropy = token_log_probs(hidden, head, torch.randint(0, vocab, (1, tokens)), chunk_size=chunk)
        (log_probs.sum() + entropy.sum()).backward()
    chunk_logits, weight = chunk * vocab * 4, head.weight.numel() * 4
    assert memory.peak < 2 * chunk_logits + weight + 0.1 * chunk_logits + 2 * hidden.numel() * 4
    assert chunk_tokens(151_936) == 441 and chunk_tokens(32_000) == 1024  # 256 MiB of float32 logits at most


def test_an_optimizer_step_makes_no_copies_of_the_weights(train_batch):
    """AdamW is fused: its step writes the weights and its state in place. torch's default on CPU (neither foreach
    nor fused) makes two temporary copies of each weight it steps, 1 GB for a 0.5B model's tied embedding."""
    strategy = make_strategy()
    train(strategy, train_batch, steps=1)  # the state exists from here on
    existing = [t for t in strategy.hf_model.parameters()] + [p.grad for p in strategy.hf_model.parameters()]
    existing += [v for state in strategy.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    with LiveBytes(existing=existing) as memory:
        strategy.optimizer.step()
    largest = max(p.numel() for p in strategy.hf_model.parameters()) * 4
    assert memory.peak < 0.1 * largest
