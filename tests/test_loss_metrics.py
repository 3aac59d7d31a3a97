"""Loss metrics are the whole batch's: the same values for any split over micro-batches and workers.

The pipelines' losses return their metrics as (sum, count) pairs, which the strategy adds up over
micro-batches and ranks (see `baton.strategy.base.LossFn`). The batch here has responses of uneven
lengths, so per-micro-batch means averaged would differ from the batch's.
"""

from __future__ import annotations

import pytest
import torch
from test_mixed_precision import run_on_ranks
from test_strategy_distributed import TEXTS

from baton.algorithms import agg_loss
from baton.data import DataProto
from baton.models import load_tokenizer
from baton.rl.losses import PolicyLoss, ValueLoss
from baton.strategy import OptimizerConfig, StrategyConfig, create_strategy
from baton.strategy.fsdp2 import Fsdp2Strategy
from baton.strategy.hf import HFStrategy
from baton.strategy.mock import MockStrategy
from baton.workers.weight_sync import probe_batch

RESPONSE_LENGTHS = [4, 1, 1, 2, 4, 4, 3]  # valid tokens per row; micro-batches of 2 rows hold 5, 3, 8 and 3
POLICY_LOSS = PolicyLoss(entropy_coeff=0.01, kl_loss_coef=0.1)
POLICY_METRICS = ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "actor/entropy",
                  "actor/kl")


def config(name: str = "hf", **overrides) -> StrategyConfig:
    return StrategyConfig(name=name, model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3), **overrides)


def uneven_batch() -> DataProto:
    """Rows with RESPONSE_LENGTHS valid response tokens (right padded), advantages, and old and reference log-probs
    near the model's own (seeded noise), so that the ratio clip binds on some tokens."""
    batch = probe_batch(load_tokenizer(), TEXTS[: len(RESPONSE_LENGTHS)], max(RESPONSE_LENGTHS))
    data = batch.batch
    response_len = data["responses"].shape[1]
    data["response_mask"] = (torch.arange(response_len) < torch.tensor(RESPONSE_LENGTHS)[:, None]).long()
    data["attention_mask"][:, -response_len:] = data["response_mask"]
    rows = len(RESPONSE_LENGTHS)
    data["advantages"] = torch.linspace(-1.0, 1.5, rows)[:, None].expand(rows, response_len).contiguous()
    log_probs = create_strategy(config()).forward(batch).batch["log_probs"]
    noise = torch.Generator().manual_seed(0)
    data["old_log_probs"] = log_probs + 0.3 * torch.randn(log_probs.shape, generator=noise)
    data["ref_log_probs"] = log_probs + 0.3 * torch.randn(log_probs.shape, generator=noise)
    return batch


@pytest.fixture(scope="module")
def batch() -> DataProto:
    return uneven_batch()


def as_floats(loss_fn):
    """`loss_fn` with each (sum, count) metric turned into this micro-batch's own mean: the old, split-dependent rule."""
    def per_micro_batch(outputs, micro_batch):
        loss, metrics = loss_fn(outputs, micro_batch)
        return loss, {key: total / max(count, 1.0) for key, (total, count) in metrics.items()}
    return per_micro_batch


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_policy_loss_metrics_do_not_depend_on_the_micro_batches(batch, loss_agg_mode):
    loss_fn = PolicyLoss(loss_agg_mode=loss_agg_mode, entropy_coeff=0.01, kl_loss_coef=0.1)
    whole = create_strategy(config()).train_step(batch, loss_fn)
    micro = create_strategy(config(micro_batch_size_per_worker=2)).train_step(batch, loss_fn)
    for key in ("loss", *POLICY_METRICS):
        assert micro[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-7), key
    assert whole["actor/pg_clipfrac"] > 0.05  # the clip binds: clipfrac is a real statistic here
    # One micro-batch reports what the loss itself computes on the whole batch.
    outputs = create_strategy(config()).forward(batch).batch
    _, direct = loss_fn(dict(outputs), batch)
    assert whole["actor/pg_loss"] == pytest.approx(direct["actor/pg_loss"][0] / direct["actor/pg_loss"][1], rel=1e-5)
    if loss_agg_mode == "token-mean":
        mask = batch.batch["response_mask"]
        assert whole["actor/entropy"] == pytest.approx(float(agg_loss(outputs["entropy"], mask, "token-mean")), rel=1e-5)
    # Averaging each micro-batch's own means (floats) gives other values: what the pairs fix.
    averaged = create_strategy(config(micro_batch_size_per_worker=2)).train_step(batch, as_floats(loss_fn))
    assert abs(averaged["actor/pg_loss"] - whole["actor/pg_loss"]) > 1e-3
    assert averaged["loss"] == pytest.approx(whole["loss"], rel=1e-6)


def test_value_loss_metrics_do_not_depend_on_the_micro_batches(batch):
    critic_batch = DataProto.from_dict({**batch.batch})
    values = create_strategy(config(kind="value")).forward(critic_batch).batch["values"]
    noise = torch.Generator().manual_seed(1)
    critic_batch.batch["values"] = values + torch.randn(values.shape, generator=noise)
    critic_batch.batch["returns"] = values + torch.randn(values.shape, generator=noise)
    loss_fn = ValueLoss(cliprange_value=0.5)
    whole = create_strategy(config(kind="value")).train_step(critic_batch, loss_fn)
    micro = create_strategy(config(kind="value", micro_batch_size_per_worker=2)).train_step(critic_batch, loss_fn)
    for key in ("loss", "critic/vf_loss", "critic/vf_clipfrac"):
        assert micro[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-7), key
    assert 0 < whole["critic/vf_clipfrac"] < 1


class PaddedHF(HFStrategy):
    """An hf strategy that runs one padding micro-batch after the real ones, as an FSDP2 rank with fewer rows does."""

    def _micro_batches(self, batch: DataProto) -> list[DataProto]:
        filler = batch[:1]
        filler.meta_info["baton_padding"] = True
        return [*super()._micro_batches(batch), filler]


def test_a_padding_micro_batch_counts_nothing(batch):
    whole = create_strategy(config()).train_step(batch, POLICY_LOSS)
    padded = PaddedHF(config()).train_step(batch, POLICY_LOSS)
    for key in ("loss", *POLICY_METRICS):
        assert padded[key] == pytest.approx(whole[key], rel=1e-6, abs=1e-7), key
    float_metric = PaddedHF(config()).train_step(batch, lambda outputs, mb: (outputs["log_probs"].sum() * 0, {"one": 1.0}))
    assert float_metric["one"] == 1.0  # a float is averaged over the real micro-batches only


def test_mock_strategy_takes_both_metric_forms(batch):
    def loss_fn(outputs, micro_batch):
        return outputs["log_probs"].sum(), {"pair": (3.0, 2.0), "float": 0.25, "empty": (0.0, 0.0)}

    metrics = MockStrategy(config("mock")).train_step(batch, loss_fn)
    assert (metrics["pair"], metrics["float"], metrics["empty"]) == (1.5, 0.25, 0.0)


def fsdp2_metrics(rank: int, world_size: int, batch: DataProto) -> list[dict[str, float]]:
    """This rank's train_step metrics for its shard (4 and 3 rows), without and with one row per micro-batch
    (4 passes and 3 real + 1 padding pass)."""
    shard = batch.chunk(world_size)[rank]
    return [Fsdp2Strategy(config("fsdp2", **split)).train_step(shard, POLICY_LOSS)
            for split in ({}, {"micro_batch_size_per_worker": 1})]


def test_fsdp2_on_two_ranks_reports_the_metrics_of_one_hf_worker(batch, tmp_path):
    want = create_strategy(config()).train_step(batch, POLICY_LOSS)
    for per_rank in zip(*run_on_ranks(fsdp2_metrics, 2, (batch,), tmp_path)):
        for got in per_rank:  # every rank reports the global values
            for key in ("loss", *POLICY_METRICS):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
