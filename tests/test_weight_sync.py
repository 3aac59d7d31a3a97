"""A weight sync proves what the destination serves (fingerprints, `baton.data.shards`), and a delta sync sends only
the weights that changed while still checking every one (local backend: the clusters' workers run in this process);
between nodes a sync goes through the object store or, asked to, through gloo groups of its own (Ray, two nodes)."""

from __future__ import annotations

import pytest
from test_strategy_distributed import CALL_TIMEOUT_S, TEXTS, pg_loss, strategy_config, train_batch

from baton import Cluster, WorkerConfig, WorkerSpec, create_clusters_parallel
from baton.config import ConfigError
from baton.models import load_tokenizer
from baton.pipelines.config import RoleConfig, TrainerConfig
from baton.pipelines.policy import connect_policy
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.strategy.base import LoraConfig
from baton.workers import ActorWorker, RolloutWorker
from baton.rollout.engine_worker import EngineWorker
from baton.workers.weight_sync import ModelUpdatePair, WeightSyncError, check_fingerprints, probe_batch


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


def test_the_trainer_config_sets_the_pipelines_sync_transport_and_delta(make_manager):
    with pytest.raises(ConfigError, match="trainer.weight_sync_transport 'pigeon' is not one of"):
        TrainerConfig(weight_sync_transport="pigeon")
    clusters = {"actor": cluster(ActorWorker, "actor", make_manager), "rollout": cluster(RolloutWorker, "rollout",
                                                                                          make_manager, seed=1)}
    role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"))
    pair = connect_policy(clusters, role, role, False, None, load_tokenizer(), TrainerConfig(weight_sync_delta=True))
    assert pair.delta and pair.transport == "object_store" and pair.num_syncs == 1  # synced once as it connects
    assert pair.sync()["weight_sync/sent_fraction"] == 0.0


def test_a_sync_without_fingerprints_delivers_the_weights_and_leaves_the_check_to_the_probe(make_manager):
    with pytest.raises(ValueError, match="weight_sync_delta sends the weights whose fingerprint changed: it needs"):
        TrainerConfig(weight_sync_delta=True, weight_sync_fingerprints=False)
    actor = cluster(ActorWorker, "actor", make_manager)
    rollout = cluster(RolloutWorker, "rollout", make_manager, seed=1)
    probe = probe_batch(load_tokenizer(), TEXTS[:4], 3)
    pair = ModelUpdatePair(actor, rollout, probe=probe, fingerprints=False, bucket_bytes=1 << 16)
    actor.train_step(train_batch(4), pg_loss)
    assert pair.sync()["weight_sync/max_logprob_diff"] < 1e-5
    [mine] = actor.piece_fingerprints()
    assert check_fingerprints("actor", rollout, mine) == 50  # every weight delivered, though none was checked


def test_a_transport_that_cannot_work_is_refused(make_manager):
    actor = cluster(ActorWorker, "actor", make_manager)
    rollout = cluster(RolloutWorker, "rollout", make_manager)
    with pytest.raises(ValueError, match="weight-sync transport 'pigeon': choose one of auto, shared_memory"):
        ModelUpdatePair(actor, rollout, transport="pigeon")
    with pytest.raises(ValueError, match="'collective' joins the workers' processes in a group: it needs the ray"):
        ModelUpdatePair(actor, rollout, transport="collective")
    assert ModelUpdatePair(actor, rollout).transport == "object_store"  # in one process: handed over as they are


@pytest.mark.ray
def test_a_sync_between_nodes_goes_through_the_object_store_or_gloo_groups_and_is_checked(make_manager):
    actor, rollout, engine = create_clusters_parallel([
        (WorkerSpec(ActorWorker, (strategy_config("fsdp2"),)),
         WorkerConfig("actor", device_mapping=[0, 1], call_timeout_s=CALL_TIMEOUT_S)),
        (WorkerSpec(RolloutWorker, (strategy_config("hf", seed=1),)),
         WorkerConfig("rollout", device_mapping=[2, 3], call_timeout_s=CALL_TIMEOUT_S)),
        (WorkerSpec(EngineWorker, (strategy_config("hf", seed=2),)),
         WorkerConfig("engine", device_mapping=[2], share_devices_with=("rollout",), call_timeout_s=CALL_TIMEOUT_S)),
    ], make_manager("ray", num_nodes=2, num_devices_per_node=2))
    try:
        probe = probe_batch(load_tokenizer(), TEXTS[:4], 3)
        assert ModelUpdatePair(actor, rollout).transport == "object_store"  # the actor and rollout share no node
        # Two fsdp2 ranks broadcast their rows, each in its group with both rollout workers; then into an engine.
        pair = ModelUpdatePair(actor, rollout, probe, transport="collective", bucket_bytes=1 << 16)
        for step in range(2):
            actor.train_step(train_batch(5, shift=step), pg_loss)
            assert pair.sync()["weight_sync/max_logprob_diff"] < 1e-5
        to_engine = ModelUpdatePair(actor, engine, probe, transport="collective", bucket_bytes=1 << 16)
        assert to_engine.sync()["weight_sync/max_logprob_diff"] < 1e-5
    finally:
        for each in (actor, rollout, engine):
            each.shutdown()
