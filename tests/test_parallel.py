"""Parallel layouts of the fsdp2 strategy (`strategy.parallel`) train as one process does, the way Megatron users
check a layout: the same losses, gradient norms and metrics at every step, the same log-probs and the same weights
after the steps, for SFT, GRPO's policy loss and PPO's critic. Two spawned gloo processes each (this machine has two
cores), on the tiny Qwen2 model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_loss_metrics import POLICY_LOSS, POLICY_METRICS, uneven_batch
from test_mixed_precision import run_on_ranks
from test_rl_drivers import DRIVERS, settings
from test_strategy_distributed import TEXTS

from baton.data import DataProto, TensorBucket
from baton.data.shards import (
    WeightShards, add_fingerprints, bucket_fingerprints, differing, fingerprint, joined_fingerprints, pieces_buckets,
)
from baton.models import load_tokenizer
from baton.pipelines.base import run_pipeline
from baton.rl.losses import SFTLoss, ValueLoss
from baton.strategy import OptimizerConfig, ParallelConfig, StrategyConfig, create_strategy
from baton.strategy.fsdp2 import Fsdp2Strategy
from baton.tracking import run_metrics
from baton.workers.weight_sync import assembled_buckets, probe_batch

NUM_STEPS = 3
# name: (processes, layout); dp_shard is what the processes leave
LAYOUTS = {"tp2": (2, ParallelConfig(tp=2)), "cp2": (2, ParallelConfig(cp=2)),
           "hsdp2": (2, ParallelConfig(dp_replicate=2)), "tp2-dp2": (4, ParallelConfig(tp=2)),
           "cp2-tp2": (4, ParallelConfig(cp=2, tp=2)), "cp2-dp2": (4, ParallelConfig(cp=2)),
           "hsdp2-tp2": (4, ParallelConfig(dp_replicate=2, tp=2))}


def config(kind: str = "causal_lm", parallel: ParallelConfig | None = None, **overrides) -> StrategyConfig:
    # eps 1e-6: Adam moves a weight by about lr whatever its gradient's size, so with the default 1e-8 a gradient at
    # rounding level would move by lr in a direction set by the order of a sum (as in test_strategy_distributed).
    settings = dict(name="hf" if parallel is None else "fsdp2", model="tiny-qwen2", kind=kind,
                    optimizer=OptimizerConfig(lr=1e-3, eps=1e-6), parallel=parallel or ParallelConfig())
    return StrategyConfig(**{**settings, **overrides})


def critic_batch() -> DataProto:
    batch = uneven_batch()
    values = create_strategy(config("value")).forward(batch).batch["values"]
    noise = torch.Generator().manual_seed(1)
    batch.batch["values"] = values + torch.randn(values.shape, generator=noise)
    batch.batch["returns"] = values + torch.randn(values.shape, generator=noise)
    return batch


LOSSES = {"sft": ("causal_lm", SFTLoss(), ()), "grpo": ("causal_lm", POLICY_LOSS, POLICY_METRICS),
          "critic": ("value", ValueLoss(cliprange_value=0.5), ("critic/vf_loss", "critic/vf_clipfrac"))}


def train(strategy, batch: DataProto, loss_fn) -> dict:
    """NUM_STEPS updates on `batch`, then the outputs of a forward pass and the full weights (None on ranks other
    than the writer)."""
    steps = [strategy.train_step(batch, loss_fn) for _ in range(NUM_STEPS)]
    outputs = strategy.forward(batch)
    weights = strategy._full_state_dict()
    return {"steps": steps, "outputs": dict(outputs.batch), "weights": weights or None,
            "collects": strategy.rank_info is None or strategy.rank_info.is_collect_rank}


def train_on_rank(rank: int, world_size: int, kind: str, loss: str, parallel: ParallelConfig, batch: DataProto,
                  model: str = "tiny-qwen2"):
    strategy = Fsdp2Strategy(config(kind, parallel, micro_batch_size_per_worker=2, model=model))
    info = strategy.rank_info
    return train(strategy, batch.chunk(info.dp_size)[info.dp_rank], LOSSES[loss][1])


@pytest.fixture(scope="module")
def batches() -> dict[str, DataProto]:
    policy = uneven_batch()
    return {"causal_lm": policy, "value": critic_batch()}


@pytest.fixture(scope="module")
def single(batches) -> dict[str, dict]:
    """Each loss trained by one hf process on the whole batch."""
    return {loss: train(create_strategy(config(kind)), batches[kind], loss_fn)
            for loss, (kind, loss_fn, _) in LOSSES.items()}


def train_losses_on_rank(rank: int, world_size: int, losses: tuple[str, ...], parallel: ParallelConfig,
                         batches: dict[str, DataProto]) -> dict[str, dict]:
    """`train_on_rank` for each loss in turn, a fresh strategy each, in one set of processes (started once)."""
    return {loss: train_on_rank(rank, world_size, LOSSES[loss][0], loss, parallel, batches[LOSSES[loss][0]])
            for loss in losses}


# Every loss on every two-process layout; the four-process layouts (two per core here) with GRPO's loss.
CASES = {layout: tuple(loss for loss in LOSSES if processes == 2 or loss == "grpo")
         for layout, (processes, _) in LAYOUTS.items()}


@pytest.mark.parametrize("layout", CASES)
def test_a_parallel_layout_trains_as_one_process(layout, batches, single, tmp_path):
    processes, parallel = LAYOUTS[layout]
    ranks = run_on_ranks(train_losses_on_rank, processes, (CASES[layout], parallel, batches), tmp_path)
    for loss in CASES[layout]:
        kind, _, metric_names = LOSSES[loss]
        check_same_training([rank[loss] for rank in ranks], single[loss], metric_names,
                            batches[kind].batch["response_mask"])


def check_same_training(ranks: list[dict], want: dict, metric_names, mask: torch.Tensor) -> None:
    for rank in ranks:  # every rank reports the whole batch's metrics
        for step, (got, expected) in enumerate(zip(rank["steps"], want["steps"])):
            for key in ("loss", "grad_norm", *metric_names):
                assert got[key] == pytest.approx(expected[key], rel=2e-4, abs=1e-6), (step, key)
    # Outputs come from the collecting ranks (tp 0, cp 0), each for its data-parallel shard; compared at the response
    # tokens (a critic's value at a padding position is whatever the masked attention gives).
    collected = [rank["outputs"] for rank in ranks if rank["collects"]]
    for key, value in want["outputs"].items():
        torch.testing.assert_close(torch.cat([part[key] for part in collected]) * mask, value * mask, atol=1e-4,
                                   rtol=1e-4)
    weights = ranks[0]["weights"]
    assert all(rank["weights"] is None for rank in ranks[1:]) and weights.keys() == want["weights"].keys()
    for name, value in want["weights"].items():
        torch.testing.assert_close(weights[name], value, atol=5e-4, rtol=0, msg=name)


def test_a_context_parallel_rank_that_holds_no_response_position_still_trains_its_part(tmp_path):
    """Responses of one token sit in the second half of every row: the first rank's share of them is empty, but its
    positions are keys and values for the other's queries, so its backward pass runs all the same."""
    batch = probe_batch(load_tokenizer(), TEXTS, 1)
    ranks = run_on_ranks(train_on_rank, 2, ("causal_lm", "sft", ParallelConfig(cp=2), batch), tmp_path)
    check_same_training(ranks, train(create_strategy(config()), batch, SFTLoss()), (), batch.batch["response_mask"])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    """A tiny Llama model (no attention biases, an LM head of its own: not tied) saved as an HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from baton.models import load_tokenizer

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    LlamaForCausalLM(LlamaConfig(vocab_size=len(load_tokenizer()), hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=256, tie_word_embeddings=False)).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("layout", ["tp2", "cp2"])
def test_a_llama_model_from_an_hf_directory_trains_alike_in_a_parallel_layout(layout, llama_dir, batches, tmp_path):
    """Llama's layers take the same split; its untied LM head is split by vocabulary rows on its own."""
    batch = batches["causal_lm"]
    ranks = run_on_ranks(train_on_rank, 2, ("causal_lm", "grpo", LAYOUTS[layout][1], batch, llama_dir), tmp_path)
    want = train(create_strategy(config(model=llama_dir)), batch, POLICY_LOSS)
    assert "lm_head.weight" in want["weights"]  # its own tensor
    check_same_training(ranks, want, POLICY_METRICS, batch.batch["response_mask"])


# --- the pipelines, on Ray -------------------------------------------------------------------------------------------


def driver_run(driver: str, run_dir, parallel: ParallelConfig | None = None) -> dict[int, dict]:
    """A GRPO run of `driver` (test_rl_drivers' settings, two steps): one hf actor on the local backend, or with
    `parallel` an fsdp2 actor of two workers in that layout on Ray. Its metrics by step."""
    pipeline_cls, config_cls = DRIVERS[driver]
    config = config_cls(**settings(run_dir))
    trainer = dict(num_steps=2, val_every_steps=1, save_every_steps=2)
    if parallel is not None:
        strategy = dataclasses.replace(config.actor.strategy, name="fsdp2", parallel=parallel)
        config.actor = dataclasses.replace(config.actor, strategy=strategy, world_size=2)
        trainer.update(backend="ray", num_nodes=1)
    config.trainer = dataclasses.replace(config.trainer, **trainer)
    run_pipeline(pipeline_cls, config)
    return run_metrics(str(run_dir))


@pytest.mark.ray
@pytest.mark.parametrize("driver", list(DRIVERS))
def test_each_rl_driver_trains_a_tensor_and_a_context_parallel_actor_as_one_process(driver, tmp_path, ray_cluster):
    want = driver_run(driver, tmp_path / "one")
    for layout in ("tp2", "cp2"):
        got = driver_run(driver, tmp_path / layout, LAYOUTS[layout][1])
        assert sorted(got) == sorted(want) == [0, 1, 2], layout
        for step, metrics in want.items():
            assert got[step].keys() == metrics.keys(), (layout, step, sorted(set(got[step]) ^ set(metrics)))
            for key, value in metrics.items():
                assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (layout, step, key)
        assert got[2]["actor/grad_norm"] > 0.1


# --- checkpoints across layouts --------------------------------------------------------------------------------------


def save_on_rank(rank: int, world_size: int, parallel: ParallelConfig, batch: DataProto, path: str) -> dict:
    """One update in layout `parallel`, then a checkpoint at `path`; the outputs of a forward pass after it."""
    strategy = Fsdp2Strategy(config("causal_lm", parallel))
    info = strategy.rank_info
    shard = batch.chunk(info.dp_size)[info.dp_rank]
    strategy.train_step(shard, POLICY_LOSS)
    strategy.save_checkpoint(path)
    return dict(strategy.forward(shard).batch)


def resume_on_rank(rank: int, world_size: int, parallel: ParallelConfig, batch: DataProto, path: str) -> dict:
    strategy = Fsdp2Strategy(config("causal_lm", parallel))
    strategy.load_checkpoint(path)
    info = strategy.rank_info
    return train(strategy, batch.chunk(info.dp_size)[info.dp_rank], POLICY_LOSS)


def test_a_checkpoint_of_one_layout_resumes_in_another_and_exports_an_hf_model(batches, tmp_path):
    """Saved by tensor-parallel ranks; resumed by two plain data-parallel ranks and by one hf process, each training
    on as an uninterrupted single process does (the optimizer's moments included: a resume without them would take
    other steps); the checkpoint's model loads in transformers with the saving layout's log-probs."""
    batch = batches["causal_lm"]
    path = str(tmp_path / "step_1")
    saved = run_on_ranks(save_on_rank, 2, (ParallelConfig(tp=2), batch, path), tmp_path)[0]
    uninterrupted = create_strategy(config())
    uninterrupted.train_step(batch, POLICY_LOSS)
    want = train(uninterrupted, batch, POLICY_LOSS)

    resumed = run_on_ranks(resume_on_rank, 2, (ParallelConfig(), batch, path), tmp_path)
    check_same_training(resumed, want, POLICY_METRICS, batch.batch["response_mask"])
    one = create_strategy(config())
    one.load_checkpoint(path)
    check_same_training([train(one, batch, POLICY_LOSS)], want, POLICY_METRICS, batch.batch["response_mask"])

    exported = create_strategy(config(model=path)).forward(batch)  # transformers' from_pretrained on the directory
    torch.testing.assert_close(exported.batch["log_probs"], saved["log_probs"], atol=1e-5, rtol=1e-5)


# --- weight sync from every shard ------------------------------------------------------------------------------------


def pieces_on_rank(rank: int, world_size: int, parallel: ParallelConfig) -> dict:
    """This rank's buckets of a weight sync (as plain data) and, on the writer, the whole weights to check them by."""
    strategy = Fsdp2Strategy(config("causal_lm", parallel))
    buckets = [vars(bucket) for bucket in pieces_buckets(strategy.weight_pieces(), 1 << 15, world_size)]
    return {"buckets": buckets, "whole": strategy._full_state_dict() or None}


def test_every_rank_sends_its_rows_and_the_destination_puts_the_weights_back_together(tmp_path):
    """tp 2 × dp 2: weights split by rows over both, by columns over tp, or replicated over tp (the norms). Each
    rank sends a part no other sends; bucket k of every rank holds pieces of the same weights; put together they are
    the model, and the pieces' fingerprints add up to the whole weights'."""
    ranks = run_on_ranks(pieces_on_rank, 4, (ParallelConfig(tp=2),), tmp_path)
    shards = [WeightShards([TensorBucket(**bucket) for bucket in rank["buckets"]]) for rank in ranks]
    for part in shards:
        for bucket in part.buckets:
            add_fingerprints(part.fingerprints, bucket_fingerprints(bucket))
    whole = ranks[0]["whole"]
    assert len({len(part.buckets) for part in shards}) == 1 and len(shards[0].buckets) > 2
    sent = [sum(t.numel() for bucket in part.buckets for t in bucket.tensors.values()) for part in shards]
    assert sum(sent) == sum(t.numel() for name, t in whole.items() if name != "lm_head.weight")  # each element once
    assert max(sent) < 0.3 * sum(sent)  # every rank sends about a quarter (a norm weight goes whole from rank 0)
    assembled = {name: tensor for bucket in assembled_buckets(shards) for name, tensor in bucket.items()}
    assert assembled.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(assembled[name], tensor), name
    expected = joined_fingerprints(shards)
    assert expected == {name: fingerprint(tensor) for name, tensor in whole.items() if name != "lm_head.weight"}
    # A destination that missed one bucket serves other (older) values for exactly that bucket's weights.
    missed = {name for part in shards for name in part.buckets[1].tensors}
    stale = {name: fingerprint(tensor - 1e-3 if name in missed else tensor) for name, tensor in whole.items()}
    assert differing(expected, stale) == sorted(missed)
