"""Packed micro-batches (baton.strategy.packing): rows' real tokens several to a sequence, attention kept within each
row, give the padded pass's outputs, losses and gradients for every loss the pipelines train with."""

from __future__ import annotations

import pytest
import torch

from baton.datasets.preference import IS_CHOSEN, PAIR_INDEX
from baton.models import build_model
from baton.pipelines.dpo import DPOLoss
from baton.rl.losses import TEACHER_TOP_K_IDS, TEACHER_TOP_K_LOG_PROBS, DistillLoss, PolicyLoss, SFTLoss, ValueLoss
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.strategy.fsdp2 import Fsdp2Strategy
from baton.strategy.hf import HFStrategy
from baton.strategy.head import RLHead
from baton.strategy.logprobs import response_hidden_states
from baton.strategy import packing as packing_module
from baton.strategy.packing import packed_mask, plan_packing
from conftest import padded_batch

# Eight rows of uneven prompts and responses (a reasoning-trace batch in miniature): padded, they run 8 x 20 positions.
PROMPTS = [3, 5, 2, 8, 4, 6, 1, 7]
RESPONSES = [12, 2, 5, 1, 9, 3, 12, 4]


@pytest.fixture(scope="module")
def batch():
    return padded_batch(PROMPTS, RESPONSES, prompt_width=8, response_width=12, seed=3)


def test_plan_puts_every_real_token_once_into_bins_as_long_as_the_longest_row(batch):
    mask = batch.batch["attention_mask"]
    plan = plan_packing(mask)
    assert plan.length == max(p + r for p, r in zip(PROMPTS, RESPONSES)) == 15
    assert len(plan.rows) == int(mask.sum())
    slots = set(zip(plan.bins.tolist(), plan.slots.tolist()))
    assert len(slots) == len(plan.rows) and all(0 <= s < plan.length for _, s in slots)  # no slot used twice
    # 84 real tokens in bins of 15: 6 at the least, far fewer positions than the padded 8 x 20.
    assert 6 <= plan.num_bins <= 7 and plan.cost == plan.num_bins * 15 < mask.numel() and not plan.separate
    assert sum(plan.fills) == 84 and max(plan.fills) <= 15


def test_the_mask_lets_a_token_see_only_the_earlier_tokens_of_its_own_row():
    mask = torch.tensor([[0, 1, 1], [1, 1, 0], [0, 0, 1]])  # rows of 2, 2 and 1 real tokens
    plan = plan_packing(mask)
    allowed = packed_mask(plan, None)[:, 0]
    segment = torch.full((plan.num_bins, plan.length), -1)
    segment[plan.bins, plan.slots] = plan.rows
    for b in range(plan.num_bins):
        for q in range(plan.length):
            for k in range(plan.length):
                assert bool(allowed[b, q, k]) == (segment[b, q] == segment[b, k] and k <= q)
    additive = packed_mask(plan, torch.float32)
    assert torch.equal(additive == 0, packed_mask(plan, None))


# sdpa in float64, so that summation order (which packing changes) cannot hide a real difference; eager in float32
# (its padded pass makes NaNs at left padding in float64), to float32 rounding.
# Bins run as one batch (these bins are short) or, with SEPARATE_BINS_FROM lowered, one pass per bin at its own fill.
@pytest.mark.parametrize("separate", [False, True], ids=["batched", "separate"])
@pytest.mark.parametrize("attention, dtype, tolerance", [("sdpa", torch.float64, 1e-10), ("eager", torch.float32, 1e-3)])
def test_packed_hidden_states_and_their_gradients_match_the_padded_pass(batch, attention, dtype, tolerance, separate,
                                                                        monkeypatch):
    if separate:
        monkeypatch.setattr(packing_module, "SEPARATE_BINS_FROM", 1)
    assert plan_packing(batch.batch["attention_mask"]).separate == separate
    model = build_model({"base": "tiny-qwen2", "attn_implementation": attention}, seed=0, dtype=dtype)
    data = batch.batch
    mask = data["response_mask"].bool()
    outputs, grads = [], []
    for packing in (False, True):
        model.zero_grad()
        hidden = response_hidden_states(model, data["input_ids"], data["attention_mask"], data["position_ids"],
                                        data["responses"].shape[1], packing=packing)
        (hidden[mask] ** 2).sum().backward()
        outputs.append(hidden.detach())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(outputs[1][mask], outputs[0][mask], rtol=tolerance, atol=tolerance)
    # Where the predicting column is itself padding, the packed pass gives zeros.
    width = data["responses"].shape[1]
    padding = data["attention_mask"][:, -width - 1 : -1] == 0
    assert padding.any() and outputs[1][padding].abs().sum() == 0
    for name, grad in grads[0].items():  # to the tolerance of the parameter's largest gradient
        assert float((grads[1][name] - grad).abs().max()) <= tolerance * max(float(grad.abs().max()), 1.0), name


def test_rows_attending_across_rows_would_differ(batch):
    """The test above can fail: packed with position ids restarting per row but no mask, rows see each other."""
    model = build_model("tiny-qwen2", seed=0)
    data = batch.batch
    plan = plan_packing(data["attention_mask"])
    ids = torch.zeros(plan.num_bins, plan.length, dtype=torch.long)
    ids[plan.bins, plan.slots] = data["input_ids"][plan.rows, plan.columns]
    positions = torch.zeros_like(ids)
    positions[plan.bins, plan.slots] = data["position_ids"][plan.rows, plan.columns]
    leaky = model.get_decoder()(input_ids=ids, position_ids=positions).last_hidden_state
    isolated = model.get_decoder()(input_ids=ids, position_ids=positions,
                                   attention_mask=packed_mask(plan, None)).last_hidden_state
    assert (leaky - isolated).abs().max() > 1e-2


def test_packing_is_on_by_default_for_sdpa_and_eager_and_refused_where_it_cannot_hold():
    assert RLHead(build_model("tiny-qwen2", seed=0), "causal_lm", 64, None).packing
    assert not RLHead(build_model("tiny-qwen2", seed=0), "causal_lm", 64, False).packing
    other = build_model("tiny-qwen2", seed=0)
    other.config._attn_implementation = "flex_attention"
    assert not RLHead(other, "causal_lm", 64, None).packing
    with pytest.raises(ValueError, match=r"packing: true needs the model's attention to be one of \['sdpa', 'eager'\]"
                                         r".*'flex_attention'.*set packing: false"):
        RLHead(other, "causal_lm", 64, True)


def rl_batch(batch):
    """The batch with every column the losses below read: advantages, old and reference log-probs, values and
    returns, a teacher's top-k, and preference pairs (rows 2i and 2i + 1)."""
    g = torch.Generator().manual_seed(7)
    rows, width = batch.batch["responses"].shape
    extra = {
        "old_log_probs": -torch.rand(rows, width, generator=g) * 3,
        "ref_log_probs": -torch.rand(rows, width, generator=g) * 3,
        "values": torch.randn(rows, width, generator=g), "returns": torch.randn(rows, width, generator=g),
        TEACHER_TOP_K_IDS: torch.randint(4, 30, (rows, width, 3), generator=g),
        TEACHER_TOP_K_LOG_PROBS: torch.log_softmax(torch.randn(rows, width, 3, generator=g), -1) - 0.5,
        PAIR_INDEX: torch.arange(rows) // 2, IS_CHOSEN: (torch.arange(rows) % 2 == 0).long(),
    }
    out = batch.select(["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "advantages"])
    out.batch.update(extra)
    return out


LOSSES = {
    "grpo": (PolicyLoss(kl_loss_coef=0.1), "token", "causal_lm"),
    "ppo": (PolicyLoss(entropy_coeff=0.01), "token", "causal_lm"),
    "ppo_critic": (ValueLoss(), "token", "value"),
    "sft": (SFTLoss(), "token", "causal_lm"),
    "dpo": (DPOLoss(), "sequence", "causal_lm"),
    "distill": (DistillLoss(sft_weight=0.2), "token", "causal_lm"),
}


@pytest.mark.parametrize("strategy_cls", [HFStrategy, Fsdp2Strategy], ids=["hf", "fsdp2"])
@pytest.mark.parametrize("loss_name", list(LOSSES))
def test_a_packed_train_step_matches_the_padded_one(batch, strategy_cls, loss_name):
    """The loss, the metrics and every gradient of one update in two micro-batches, packed and padded."""
    loss_fn, unit, kind = LOSSES[loss_name]
    data = rl_batch(batch)
    steps, strategies = [], []
    for packing in (False, True):
        s = strategy_cls(StrategyConfig(model="tiny-qwen2", kind=kind, seed=0, packing=packing,
                                        micro_batch_size_per_worker=4, optimizer=OptimizerConfig(lr=1e-3)))
        steps.append(s.train_step(data, loss_fn, unit))
        strategies.append(s)
    padded, packed = steps
    assert packed.keys() == padded.keys()
    for key, value in padded.items():
        assert packed[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for (name, a), b in zip(strategies[0].module.named_parameters(), strategies[1].module.parameters()):
        ga, gb = (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in (a, b))
        torch.testing.assert_close(gb, ga, rtol=1e-3, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["causal_lm", "value"])
def test_packed_forward_matches_the_padded_one(batch, kind):
    mask = batch.batch["response_mask"].bool()
    outs = [HFStrategy(StrategyConfig(model="tiny-qwen2", kind=kind, seed=0, packing=packing,
                                      max_tokens_per_microbatch=40)).forward(batch) for packing in (False, True)]
    for key in outs[0].batch.keys():
        torch.testing.assert_close(outs[1].batch[key][mask], outs[0].batch[key][mask], rtol=1e-5, atol=1e-5, msg=key)


def test_one_pass_calls_the_decoder_once_whatever_the_rows(batch, monkeypatch):
    """A model sharded over ranks (fsdp2) gathers each layer's weights at each call, so every rank must call the
    decoder alike: `one_pass` takes neither the prompt-sharing pass (two calls) nor a pass per packed bin."""
    monkeypatch.setattr(packing_module, "SEPARATE_BINS_FROM", 1)
    model = build_model("tiny-qwen2", seed=0)
    calls = []
    model.get_decoder().register_forward_hook(lambda *args: calls.append(1))
    data = batch.batch
    grouped = {k: v.repeat_interleave(4, dim=0)[:8] for k, v in data.items()}  # 2 prompts x 4 samples: shared
    for columns, packing in ((grouped, False), (data, True)):
        for one_pass in (False, True):
            calls.clear()
            response_hidden_states(model, columns["input_ids"], columns["attention_mask"], columns["position_ids"],
                                   columns["responses"].shape[1], packing=packing, one_pass=one_pass)
            assert len(calls) == 1 if one_pass else len(calls) > 1, (packing, one_pass, len(calls))
