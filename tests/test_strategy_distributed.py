"""Strategies, role workers and weight sync across worker processes: FSDP2 on Ray (gloo), HF on both backends.

Worker processes take seconds to start on 2 cores, so each test builds its clusters once (in
parallel where it can) and runs several checks on them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from baton import (
    Cluster, DataProto, Dispatch, ResourceManager, WorkerConfig, WorkerSpec, create_clusters_parallel,
    create_colocated_clusters, register,
)
from baton.data.shared_buckets import SharedBucket
from baton.distributed import WorkerError
from baton.models import load_tokenizer
from baton.rewards import get_reward_fn
from baton.strategy import OptimizerConfig, SamplingParams, StrategyConfig
from baton.strategy.hf import HFStrategy
from baton.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, RolloutWorker
from baton.workers.weight_sync import ModelUpdatePair, WeightSyncError, assembled_buckets, on_one_host, probe_batch

TEXTS = ["12+7=19", "3*4=12", "100-1=99", "8/2=4", "5+5=10", "7*7=49", "2+2=4", "9-3=6"]
RESPONSE_LEN = 3  # the last 3 characters of each text are its "response"
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)
CALL_TIMEOUT_S = 60  # steps take well under a second: a collective that never pairs up fails the test, not hangs it


# ---- loss and reward functions (module level: workers import them by reference) -----------------


def pg_loss(outputs: dict[str, torch.Tensor], micro_batch: DataProto):
    """-sum(log p * advantage) over response tokens."""
    mask = micro_batch.batch["response_mask"]
    advantages = micro_batch.batch["advantages"].unsqueeze(-1)  # [rows, 1]
    return (-outputs["log_probs"] * advantages * mask).sum(), {}


def value_loss(outputs: dict[str, torch.Tensor], micro_batch: DataProto):
    """Squared error of the values against `returns`, summed over response tokens."""
    mask = micro_batch.batch["response_mask"]
    return ((outputs["values"] - micro_batch.batch["returns"]) ** 2 * mask).sum(), {}


def within_tolerance(response: str, ground_truth: str, tolerance) -> float:
    """A custom reward loaded by import path: 1.0 when |response - truth| <= the row's `tolerance` column."""
    return float(abs(int(response) - int(ground_truth)) <= tolerance)


# ---- helpers ---------------------------------------------------------------------------------------


def strategy_config(name: str, seed: int = 0, **kwargs) -> StrategyConfig:
    # eps=1e-6: Adam moves a weight by about lr whatever its gradient's size, so with the default 1e-8 a
    # gradient at rounding level (1e-9) moves it by lr in a direction set by summation order. A larger
    # eps keeps such weights still, so float-level differences stay float-level after the step.
    optimizer = OptimizerConfig(lr=1e-3, eps=1e-6)
    return StrategyConfig(name=name, model="tiny-qwen2", seed=seed, optimizer=optimizer, **kwargs)


def train_batch(num_rows: int, shift: int = 0) -> DataProto:
    """`num_rows` texts (starting at TEXTS[shift]) with distinct advantages; the last RESPONSE_LEN tokens are the response."""
    texts = [TEXTS[(shift + i) % len(TEXTS)] for i in range(num_rows)]
    batch = probe_batch(load_tokenizer(), texts, RESPONSE_LEN)
    batch.batch["advantages"] = torch.linspace(-1.0, 1.5, num_rows)
    return batch


def prompts_of(batch: DataProto) -> DataProto:
    """The left-padded prompt part of a `probe_batch`, for `generate`."""
    prompt_len = batch.batch["prompts"].shape[1]
    return DataProto.from_dict({"input_ids": batch.batch["prompts"], "attention_mask": batch.batch["attention_mask"][:, :prompt_len]})


def fetch_weights(shards: list) -> dict[str, torch.Tensor]:
    """The whole weights from every rank's `export_weights` (object refs on Ray, fetched and put together here)."""
    return {name: tensor.clone() for bucket in assembled_buckets(shards) for name, tensor in bucket.items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def plain_hf_log_probs(model, batch: DataProto) -> torch.Tensor:
    """log p(response tokens) [rows, response_len] from a transformers model's logits, no baton code involved."""
    input_ids, attention_mask = batch.batch["input_ids"], batch.batch["attention_mask"]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits.float()
    response_len = batch.batch["responses"].shape[1]
    log_probs = torch.log_softmax(logits[:, -response_len - 1 : -1], dim=-1)
    return log_probs.gather(-1, batch.batch["responses"].unsqueeze(-1)).squeeze(-1)


# ---- 1. data-parallel FSDP2 == one HF worker -----------------------------------------------------


@pytest.mark.ray
def test_fsdp2_on_two_workers_updates_as_one_hf_worker_on_an_uneven_batch(make_manager):
    batches = [train_batch(7, shift=step) for step in range(3)]  # 7 rows: shards of 4 and 3
    with Cluster(WorkerSpec(ActorWorker, (strategy_config("hf"),)), WorkerConfig("single", world_size=1),
                 make_manager("local")) as single:
        expected_metrics = [single.train_step(b, pg_loss)[0] for b in batches]
        expected = fetch_weights(single.export_weights())

    # One cluster without micro-batching (one pass per rank), one with a row per micro-batch (4 passes vs 3).
    whole, micro = create_clusters_parallel([
        (WorkerSpec(ActorWorker, (strategy_config("fsdp2"),)),
         WorkerConfig("fsdp", device_mapping=[0, 1], call_timeout_s=CALL_TIMEOUT_S)),
        (WorkerSpec(ActorWorker, (strategy_config("fsdp2", micro_batch_size_per_worker=1),)),
         WorkerConfig("fsdp_micro", device_mapping=[2, 3], call_timeout_s=CALL_TIMEOUT_S)),
    ], make_manager("ray"))
    try:
        initial = fetch_weights(whole.export_weights())
        for cluster in (whole, micro):
            for batch, want in zip(batches, expected_metrics):
                per_rank = cluster.train_step(batch, pg_loss)
                assert len(per_rank) == 2
                # Every rank reports the global loss and norm. These also catch a uniformly mis-scaled gradient,
                # which the weights would not show: clipping and Adam's first steps are blind to scale.
                for got in per_rank:
                    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
                    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
            diff = max_abs_diff(fetch_weights(cluster.export_weights()), expected)
            assert diff < 1e-5, f"{cluster.name}: weights differ from one worker's by up to {diff:.2e}"
        assert max_abs_diff(initial, expected) > 1e-3  # the steps did move the weights
    finally:
        whole.shutdown()
        micro.shutdown()


# ---- 2. weight sync from FSDP2 to HF rollouts ------------------------------------------------------


class CorruptingRollout(RolloutWorker):
    """A rollout whose rank `corrupt_rank` perturbs one weight after every import, before it reports the fingerprints
    of what it holds: a sync gone wrong on one worker."""

    def __init__(self, config: StrategyConfig):
        super().__init__(config)
        self.corrupt_rank: int | None = None

    @register(Dispatch.ONE_TO_ALL)
    def set_corrupt_rank(self, rank: int | None) -> None:
        self.corrupt_rank = rank

    @register(Dispatch.ONE_TO_ALL)
    def import_weights(self, buckets: list, fingerprints: bool = False) -> dict[str, int] | None:
        super().import_weights(buckets)
        if self.rank == self.corrupt_rank:
            with torch.no_grad():
                self.strategy.hf_model.model.layers[0].mlp.down_proj.weight.add_(0.05)
        return self.weight_fingerprints(sorted(self.strategy.hf_model.state_dict())) if fingerprints else None


@pytest.mark.ray
def test_weight_sync_from_fsdp2_to_hf_rollouts_is_checked(make_manager):
    import ray

    probe = probe_batch(load_tokenizer(), TEXTS[:4], RESPONSE_LEN)
    prompts = prompts_of(probe)
    rollout_config = strategy_config("hf", seed=1)  # starts from other weights than the actor
    actor, rollout_one, rollout_two = create_clusters_parallel([
        (WorkerSpec(ActorWorker, (strategy_config("fsdp2"),)),
         WorkerConfig("actor", device_mapping=[0, 1], call_timeout_s=CALL_TIMEOUT_S)),
        (WorkerSpec(RolloutWorker, (rollout_config,)), WorkerConfig("rollout_one", device_mapping=[2])),
        (WorkerSpec(CorruptingRollout, (rollout_config,)),
         WorkerConfig("rollout_two", device_mapping=[2, 3], share_devices_with=("rollout_one",))),
    ], make_manager("ray"))
    try:
        for step in range(2):
            actor.train_step(train_batch(5, shift=step), pg_loss)
        shards = actor.export_weights(1 << 16)  # every rank sends its rows; the driver holds references only
        assert len(shards) == 2 and all(len(part.buckets) > 1 for part in shards)
        assert all(isinstance(ref, ray.ObjectRef) for part in shards for ref in part.buckets)
        reference = HFStrategy(strategy_config("hf", seed=7))
        reference.import_weights(assembled_buckets(shards))
        # A sync between clusters on one node streams through the sources' shared-memory slots instead.
        assert on_one_host(actor, rollout_one)
        actor.begin_export(1 << 16, None, None, "shared_memory")
        assert all(isinstance(part.buckets[0], SharedBucket) for part in actor.next_exported())
        want = reference.generate(prompts, GREEDY).batch["responses"]

        for rollout in (rollout_one, rollout_two):
            pair = ModelUpdatePair(actor, rollout, probe=probe, bucket_bytes=1 << 16)
            with pytest.raises(WeightSyncError, match="differ by up to"):
                pair.check()
            assert not torch.equal(rollout.generate(prompts, GREEDY).batch["responses"], want)
            metrics = pair.sync()
            print(f"{rollout.name}: max log-prob diff after sync {metrics['weight_sync/max_logprob_diff']:.2e}")
            assert metrics["weight_sync/max_logprob_diff"] < 1e-5
            assert torch.equal(rollout.generate(prompts, GREEDY).batch["responses"], want)

        # Rank 1 of the two-worker rollout corrupts what it receives: the probe (split over both ranks) catches it.
        rollout_two.set_corrupt_rank(1)
        with pytest.raises(WeightSyncError, match=r"worker 1 serves other values .* \(model.layers.0.mlp.down_proj"):
            ModelUpdatePair(actor, rollout_two, probe=None).sync()  # the fingerprints, without the probe
        with pytest.raises(WeightSyncError, match="differ by up to"):
            ModelUpdatePair(actor, rollout_two, probe=probe).check()
        rollout_two.set_corrupt_rank(None)
        ModelUpdatePair(actor, rollout_two, probe=probe).sync()
    finally:
        for cluster in (actor, rollout_one, rollout_two):
            cluster.shutdown()


# ---- 3. colocated actor and rollout share tensors -------------------------------------------------


class PointerActor(ActorWorker):
    @register(Dispatch.ONE_TO_ALL)
    def parameter_pointers(self) -> dict[str, int]:
        return {name: p.data_ptr() for name, p in self.strategy.hf_model.named_parameters()}


class PointerRollout(RolloutWorker):
    @register(Dispatch.ONE_TO_ALL)
    def parameter_pointers(self) -> dict[str, int]:
        return {name: p.data_ptr() for name, p in self.strategy.hf_model.named_parameters()}


def test_colocated_rollout_shares_the_actors_tensors(backend, make_manager):
    probe = probe_batch(load_tokenizer(), TEXTS[:4], RESPONSE_LEN)
    views = create_colocated_clusters(
        {"actor": WorkerSpec(PointerActor, (strategy_config("hf"),)),
         "rollout": WorkerSpec(PointerRollout, (strategy_config("hf", seed=1),))},
        WorkerConfig("fused", world_size=1), make_manager(backend),
    )
    actor, rollout = views["actor"], views["rollout"]
    try:
        pair = ModelUpdatePair(actor, rollout, probe=probe, share_role="actor")
        with pytest.raises(WeightSyncError):
            pair.check()
        assert actor.parameter_pointers() != rollout.parameter_pointers()
        assert pair.sync()["weight_sync/max_logprob_diff"] == 0.0
        [pointers] = actor.parameter_pointers()
        assert rollout.parameter_pointers() == [pointers]

        before = rollout.compute_log_probs(probe).batch["log_probs"]
        actor.train_step(train_batch(4), pg_loss)
        after = rollout.compute_log_probs(probe).batch["log_probs"]  # no sync in between
        assert not torch.allclose(before, after)
        assert torch.equal(after, actor.compute_log_probs(probe).batch["log_probs"])
        assert rollout.parameter_pointers() == [pointers]  # the optimizer updated the shared tensors in place
        assert "weight_sync/max_logprob_diff" not in pair.sync()  # probed on the first sync only
        assert rollout.parameter_pointers() == [pointers]
    finally:
        actor.shutdown()


# ---- 4. role workers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["local", "ray"])
def roles(request):
    """The roles fused into few processes (a process start costs seconds), on each backend: the inference and
    reward roles on two workers, the training roles (which the hf strategy runs on one worker) on one."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    manager = ResourceManager(1, 3, backend=request.param)
    views = create_colocated_clusters({
        "reward": WorkerSpec(RewardWorker, ("exact_match",)),
        "custom_reward": WorkerSpec(RewardWorker, (f"{__name__}:within_tolerance",)),
        "reference": WorkerSpec(ReferenceWorker, (strategy_config("hf"),)),
        "rollout": WorkerSpec(RolloutWorker, (strategy_config("hf"),)),
    }, WorkerConfig("inference", device_mapping=[0, 1]), manager)
    views.update(create_colocated_clusters({
        "actor": WorkerSpec(ActorWorker, (strategy_config("hf"),)),
        "critic": WorkerSpec(CriticWorker, (strategy_config("hf", kind="value"),)),
    }, WorkerConfig("training", device_mapping=[2]), manager))
    yield views
    views["reward"].shutdown()
    views["actor"].shutdown()
    manager.shutdown()


def response_batch(responses: list[str], ground_truths: list[str], **columns) -> DataProto:
    """Responses tokenised from known strings (right-padded), with their ground truth and extra non-tensor columns."""
    tokenizer = load_tokenizer()
    tokenizer.padding_side = "right"
    enc = tokenizer(responses, return_tensors="pt", padding=True)
    return DataProto.from_dict(
        {"responses": enc["input_ids"], "response_mask": enc["attention_mask"]},
        {"ground_truth": np.array(ground_truths, dtype=object), **{k: np.array(v, dtype=object) for k, v in columns.items()}},
    )


def test_reward_worker_scores_decoded_responses_against_ground_truth(roles):
    batch = response_batch(["19", "18", " 19 ", "190", "7"], ["19", "19", "19", "19", "7"])  # 3 + 2 rows
    out = roles["reward"].compute_rewards(batch)
    assert out.batch["scores"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert list(out.non_tensor_batch["response_text"]) == ["19", "18", " 19 ", "190", "7"]
    token_level = out.batch["token_level_scores"]  # the score on each row's last response token, 0 elsewhere
    assert token_level.shape == batch.batch["responses"].shape
    lengths = batch.batch["response_mask"].sum(-1)
    for row, (score, length) in enumerate(zip(out.batch["scores"], lengths)):
        expected = torch.zeros(token_level.shape[1])
        expected[length - 1] = score
        assert torch.equal(token_level[row], expected)


def test_reward_worker_loads_a_custom_reward_by_import_path(roles):
    batch = response_batch(["19", "18", "15", "7"], ["19", "19", "19", "9"], tolerance=[0, 1, 1, 2])
    assert roles["custom_reward"].compute_rewards(batch).batch["scores"].tolist() == [1.0, 1.0, 0.0, 1.0]


def test_unknown_reward_name_is_a_value_error(backend, make_manager):
    with pytest.raises(ValueError, match="unknown reward 'no_such_reward'"):
        get_reward_fn("no_such_reward")
    with pytest.raises(WorkerError, match="unknown reward 'no_such_reward'") as info:
        Cluster(WorkerSpec(RewardWorker, ("no_such_reward",)), WorkerConfig("reward", world_size=1, num_devices_per_worker=0),
                make_manager(backend))
    assert isinstance(info.value.__cause__, ValueError)


def test_reference_log_probs_equal_the_actors_with_the_same_config(roles):
    probe = probe_batch(load_tokenizer(), TEXTS[:5], RESPONSE_LEN)
    reference = roles["reference"].compute_log_probs(probe)  # two workers: 3 + 2 rows
    actor = roles["actor"].compute_log_probs(probe)  # one worker: 5 rows
    assert reference.batch["log_probs"].shape == (5, RESPONSE_LEN)
    torch.testing.assert_close(reference.batch["log_probs"], actor.batch["log_probs"], atol=1e-6, rtol=0)
    torch.testing.assert_close(reference.batch["entropy"], actor.batch["entropy"], atol=1e-6, rtol=0)
    assert bool((reference.batch["log_probs"] < 0).all())


def test_hf_training_roles_refuse_several_workers(make_manager):
    """One independent model per worker would silently drift apart under data-parallel steps."""
    for worker, config in [(ActorWorker, strategy_config("hf")), (CriticWorker, strategy_config("hf", kind="value"))]:
        with pytest.raises(WorkerError, match="use strategy 'fsdp2' or world_size=1") as info:
            Cluster(WorkerSpec(worker, (config,)), WorkerConfig("trainer", world_size=2), make_manager("local", num_devices_per_node=2))
        assert isinstance(info.value.__cause__, ValueError)


def test_critic_computes_values_and_trains(roles):
    batch = probe_batch(load_tokenizer(), TEXTS[:5], RESPONSE_LEN)
    batch.batch["returns"] = torch.linspace(-1.0, 1.0, 5).unsqueeze(-1).expand(5, RESPONSE_LEN).contiguous()
    critic = roles["critic"]
    values = critic.compute_values(batch).batch["values"]
    assert values.shape == (5, RESPONSE_LEN) and values.dtype == torch.float32
    error_before = float(((values - batch.batch["returns"]) ** 2).sum())
    for _ in range(3):
        [metrics] = critic.train_step(batch, value_loss)
    assert metrics["loss"] > 0
    error_after = float(((critic.compute_values(batch).batch["values"] - batch.batch["returns"]) ** 2).sum())
    assert error_after < error_before


def test_rollout_splits_prompts_over_workers_and_returns_n_samples_per_prompt_in_order(roles):
    probe = probe_batch(load_tokenizer(), TEXTS[:3], RESPONSE_LEN)  # 3 prompts: 2 on rank 0, 1 on rank 1
    prompts = prompts_of(probe).union(DataProto(non_tensor_batch={"uid": np.array(["a", "b", "c"], dtype=object)}))
    out = roles["rollout"].generate(prompts, dataclasses.replace(GREEDY, n=2))
    assert len(out) == 6
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "b", "b", "c", "c"]
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(2, 0))
    # Each worker generated its own prompts: the same as one in-process strategy on the whole batch.
    whole = HFStrategy(strategy_config("hf")).generate(prompts, dataclasses.replace(GREEDY, n=2))
    assert torch.equal(out.batch["responses"], whole.batch["responses"])
    assert torch.equal(out.batch["response_mask"], whole.batch["response_mask"])


# ---- 5. FSDP2 checkpoints: plain HF format, exact resume -----------------------------------------


@pytest.mark.ray
def test_fsdp2_checkpoint_opens_in_transformers_and_resumes_exactly(make_manager, tmp_path):
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "step2")
    probe = probe_batch(load_tokenizer(), TEXTS[:4], RESPONSE_LEN)
    batches = [train_batch(5, shift=step) for step in range(4)]
    original, resumed = create_clusters_parallel([
        (WorkerSpec(ActorWorker, (strategy_config("fsdp2"),)),
         WorkerConfig("original", device_mapping=[0, 1], call_timeout_s=CALL_TIMEOUT_S)),
        (WorkerSpec(ActorWorker, (strategy_config("fsdp2", seed=1),)),  # other initial weights: the checkpoint must replace them
         WorkerConfig("resumed", device_mapping=[2, 3], call_timeout_s=CALL_TIMEOUT_S)),
    ], make_manager("ray"))
    try:
        for batch in batches[:2]:
            original.train_step(batch, pg_loss)
        original.save_checkpoint(path)
        actor_log_probs = original.compute_log_probs(probe).batch["log_probs"]
        # Two more steps: the first one's loss depends on the weights only, the second's on the optimizer state too.
        want = [original.train_step(batch, pg_loss) for batch in batches[2:]]
        want_weights = fetch_weights(original.export_weights())

        model = AutoModelForCausalLM.from_pretrained(path).eval()
        torch.testing.assert_close(plain_hf_log_probs(model, probe), actor_log_probs, atol=1e-5, rtol=0)

        resumed.load_checkpoint(path)
        assert [resumed.train_step(batch, pg_loss) for batch in batches[2:]] == want
        diff = max_abs_diff(fetch_weights(resumed.export_weights()), want_weights)
        assert diff == 0.0, f"resumed weights differ from the uninterrupted run's by up to {diff:.2e}"
    finally:
        original.shutdown()
        resumed.shutdown()
