"""A weight sync proves what the destination serves (fingerprints, `baton.data.shards`), and a delta sync sends only
the weights that changed while still checking every one. Local backend: the clusters' workers run in this process."""

from __future__ import annotations

import pytest
from test_strategy_distributed import TEXTS, pg_loss, train_batch

from baton import Cluster, WorkerConfig, WorkerSpec
from baton.models import load_tokenizer
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.strategy.base import LoraConfig
from baton.workers import ActorWorker, RolloutWorker
from baton.workers.weight_sync import ModelUpdatePair, WeightSyncError, probe_batch


def cluster(worker, name: str, make_manager, **strategy) -> Cluster:
    config = StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-2), **strategy)
    return Cluster(WorkerSpec(worker, (config,)), WorkerConfig(name, world_size=1), make_manager("local"))


def test_a_delta_sync_sends_the_weights_a_lora_update_changed_and_checks_them_all(make_manager):
    actor = cluster(ActorWorker, "actor", make_manager, lora=LoraConfig(target_modules=["q_proj", "v_proj"]))
    rollout = cluster(RolloutWorker, "rollout", make_manager, seed=1)  # other weights to start with
    probe = probe_batch(load_tokenizer(), TEXTS[:4], 3)
    pair = ModelUpdatePair(actor, rollout, probe=probe, delta=True, bucket_bytes=1 << 16)
    assert pair.sync()["weight_sync/sent_fraction"] == 1.0  # the destination held other weights: all of them
    assert pair.sync()["weight_sync/sent_fraction"] == 0.0  # nothing changed
    actor.train_step(train_batch(4), pg_loss)
    metrics = pair.sync()
    # 4 layers × 2 adapted projections of 4 × 12 + 2 weights (embeddings, final norm; the tied head goes with them)
    assert metrics["weight_sync/sent_fraction"] == pytest.approx(8 / 50)
    assert metrics["weight_sync/max_logprob_diff"] < 1e-5  # and the destination serves the trained model

    # A destination whose weights changed behind the sync's back is caught even where nothing is sent.
    other = cluster(ActorWorker, "other", make_manager, seed=2)
    ModelUpdatePair(other, rollout, probe=None).sync()
    with pytest.raises(WeightSyncError, match=r"other values than 'actor' holds for \d+ of 50 weights \(model.embed"):
        ModelUpdatePair.sync(pair)
