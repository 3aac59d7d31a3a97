"""Pipeline parallelism (`strategy.parallel.pp`) in the fsdp2 strategy trains as one process does: the same losses,
gradient norms and metrics at every step, the same log-probs (or values) and weights after the steps, for SFT, GRPO's
policy loss and PPO's critic; its checkpoints load on one process and its weight sync puts the whole model back
together. Spawned gloo processes on the tiny Qwen2 model, whose LM head is tied to its embedding (the first and the
last stage both hold it), and on one with an LM head of its own."""

from __future__ import annotations

import pytest
import torch
from test_loss_metrics import POLICY_LOSS, POLICY_METRICS, uneven_batch
from test_mixed_precision import run_on_ranks
from test_parallel import LOSSES, check_same_training, config, driver_run, train, train_on_rank

from baton.config import ConfigError
from baton.data import DataProto, TensorBucket
from baton.data.shards import WeightShards, pieces_buckets
from baton.pipelines.preflight import check_parallel
from baton.strategy import ParallelConfig, create_strategy
from baton.strategy.fsdp2 import Fsdp2Strategy
from baton.workers.weight_sync import assembled_buckets

MODEL = "tiny-qwen2"  # 4 decoder layers; tied embeddings
UNTIED = {"base": MODEL, "tie_word_embeddings": False}
PP2 = ParallelConfig(pp=2)


@pytest.fixture(scope="module")
def batches() -> dict[str, DataProto]:
    policy = uneven_batch()
    critic = uneven_batch()
    values = create_strategy(config("value")).forward(critic).batch["values"]
    noise = torch.Generator().manual_seed(1)
    critic.batch["values"] = values + torch.randn(values.shape, generator=noise)
    critic.batch["returns"] = values + torch.randn(values.shape, generator=noise)
    return {"causal_lm": policy, "value": critic}


@pytest.mark.parametrize("loss,model", [pytest.param(loss, MODEL, id=loss) for loss in LOSSES]
                         + [pytest.param("grpo", UNTIED, id="grpo-untied")])
def test_two_pipeline_stages_train_as_one_process(loss, model, batches, tmp_path):
    """Four micro-batches of unequal widths per step (trimmed padding): the second stage receives hidden states of
    each one's own shape, and the 1F1B order runs a forward of one between the other's forward and backward."""
    kind, loss_fn, metric_names = LOSSES[loss]
    batch = batches[kind]
    ranks = run_on_ranks(train_on_rank, 2, (kind, loss, PP2, batch, model), tmp_path)
    assert [rank["collects"] for rank in ranks] == [False, True]  # the last stage's outputs are collected
    want = train(create_strategy(config(kind, model=model)), batch, loss_fn)
    check_same_training(ranks, want, metric_names, batch.batch["response_mask"])
    # Every stage returns the outputs, not only the collected one.
    torch.testing.assert_close(ranks[0]["outputs"], ranks[1]["outputs"], atol=0, rtol=0)


def test_pipeline_stages_over_data_parallel_shards_train_as_one_process(batches, tmp_path):
    """pp 2 × dp_shard 2: each stage sharded by FSDP2 over its own two ranks, each pipeline on its half of the rows."""
    batch = batches["causal_lm"]
    ranks = run_on_ranks(train_on_rank, 4, ("causal_lm", "grpo", PP2, batch), tmp_path)
    want = train(create_strategy(config()), batch, POLICY_LOSS)
    check_same_training(ranks, want, POLICY_METRICS, batch.batch["response_mask"])


@pytest.mark.ray
def test_an_rl_driver_trains_a_pipeline_parallel_actor_on_ray_as_one_process(tmp_path, ray_cluster):
    """GRPO's loop driver with an actor of two stages: the dispatch gives both stages the same rows and collects the
    last one's log-probs, with no change to the pipeline."""
    want = driver_run("loop", tmp_path / "one")
    got = driver_run("loop", tmp_path / "pp2", PP2)
    assert sorted(got) == sorted(want) == [0, 1, 2]
    for step, metrics in want.items():
        assert got[step].keys() == metrics.keys(), (step, sorted(set(got[step]) ^ set(metrics)))
        for key, value in metrics.items():
            assert got[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)
    assert got[2]["actor/grad_norm"] > 0.1


def save_on_rank(rank: int, world_size: int, batch: DataProto, path: str) -> dict:
    """One update at pp 2, then a checkpoint at `path`; the outputs of a forward pass after it."""
    strategy = Fsdp2Strategy(config("causal_lm", PP2))
    strategy.train_step(batch, POLICY_LOSS)
    strategy.save_checkpoint(path)
    return dict(strategy.forward(batch).batch)


def resume_on_rank(rank: int, world_size: int, batch: DataProto, path: str) -> dict:
    strategy = Fsdp2Strategy(config("causal_lm", PP2))
    strategy.load_checkpoint(path)
    return train(strategy, batch, POLICY_LOSS)


def test_a_pipeline_checkpoint_loads_on_one_process_and_exports_an_hf_model(batches, tmp_path):
    """Saved by two stages after one update (global layer names, the optimizer's moments of both stages); two stages
    and one hf process each load it and train on as an uninterrupted process does (a resume without the moments
    would take other steps), and transformers loads its model directory to the stages' log-probs."""
    batch = batches["causal_lm"]
    path = str(tmp_path / "step_1")
    saved = run_on_ranks(save_on_rank, 2, (batch, path), tmp_path)[1]
    uninterrupted = create_strategy(config())
    uninterrupted.train_step(batch, POLICY_LOSS)
    want = train(uninterrupted, batch, POLICY_LOSS)
    resumed = run_on_ranks(resume_on_rank, 2, (batch, path), tmp_path)
    check_same_training(resumed, want, POLICY_METRICS, batch.batch["response_mask"])
    one = create_strategy(config())
    one.load_checkpoint(path)
    check_same_training([train(one, batch, POLICY_LOSS)], want, POLICY_METRICS, batch.batch["response_mask"])
    exported = create_strategy(config(model=path)).forward(batch)
    torch.testing.assert_close(exported.batch["log_probs"], saved["log_probs"], atol=1e-5, rtol=1e-5)


def pieces_on_rank(rank: int, world_size: int) -> list[dict]:
    """This rank's buckets of a weight sync, as plain data."""
    strategy = Fsdp2Strategy(config("causal_lm", PP2))
    return [vars(bucket) for bucket in pieces_buckets(strategy.weight_pieces(), 1 << 15, world_size)]


def test_each_stage_sends_the_weights_it_holds_and_they_assemble_to_the_whole_model(tmp_path):
    """The tied LM head goes once, as a name of the first stage's embedding (the last stage's copy is not sent)."""
    ranks = run_on_ranks(pieces_on_rank, 2, (), tmp_path)
    first, last = ([TensorBucket(**bucket) for bucket in rank] for rank in ranks)
    assert len(first) == len(last) > 2  # both stages cut their buckets at the same weights
    sent = [{name for bucket in stage for name in bucket.tensors} for stage in (first, last)]
    assert "model.embed_tokens.weight" in sent[0] and "model.norm.weight" in sent[1] and not sent[0] & sent[1]
    assert "lm_head.weight" not in sent[0] | sent[1]
    assert {name.split(".")[2] for name in sent[1] if ".layers." in name} == {"2", "3"}  # global layer indices
    assembled = {name: tensor for bucket in assembled_buckets([WeightShards(first), WeightShards(last)])
                 for name, tensor in bucket.items()}  # a weight larger than a bucket: in blocks of rows
    whole = create_strategy(config()).hf_model.state_dict()
    assert assembled.keys() == whole.keys()
    for name, tensor in whole.items():
        assert torch.equal(assembled[name], tensor), name


@pytest.mark.parametrize("overrides,workers,message", [
    pytest.param(dict(parallel=ParallelConfig(pp=3)), 3, "pp: 3 does not divide this model's 4 decoder layers",
                 id="uneven-stages"),
    pytest.param(dict(parallel=ParallelConfig(pp=8)), 8, "pp: 8 does not divide this model's 4 decoder layers",
                 id="more-stages-than-layers"),
    pytest.param(dict(packing=True), 2, "packing: true with pp > 1: .* set packing: null", id="packing"),
    pytest.param(dict(parallel=ParallelConfig(pp=2, tp=2)), 4, "set tp: 1 and cp: 1, or pp: 1", id="with-tp"),
    pytest.param(dict(name="hf"), 2, "strategy 'hf' holds a whole model on each worker", id="hf-strategy"),
])
def test_layouts_that_pipeline_stages_cannot_take_are_refused_naming_the_fix(overrides, workers, message):
    strategy = config(**{"parallel": PP2, **overrides})
    with pytest.raises(ConfigError, match=message):
        check_parallel("actor.strategy", strategy, workers)
