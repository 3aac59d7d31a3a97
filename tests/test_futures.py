"""Non-blocking calls: CallFuture, DataProtoFuture, and one cluster's output feeding another's input off the driver."""

from types import SimpleNamespace

import pytest
import torch

from baton import (
    Cluster, DataProto, DataProtoFuture, Dispatch, ResourceManager, Worker, WorkerConfig, materialize_concat, register,
)
from baton.distributed import CallFuture


def batch(num_rows: int) -> DataProto:
    """Row i holds x = i (float) and uid "u{i}"."""
    return DataProto.from_dict({"x": torch.arange(num_rows, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(num_rows)]})


class Stage(Worker):
    """One step of a dataflow: y becomes 10 * y + x (y starts at 0), tagged with the rank that computed the row."""

    def __init__(self):
        self.seen: list = []

    def _step(self, data: DataProto, stage: str) -> DataProto:
        self.seen.append(data.batch["x"].tolist())
        previous = data.batch["y"] if "y" in data.batch else torch.zeros(len(data))
        return DataProto.from_dict(
            {"x": data.batch["x"], "y": previous * 10 + data.batch["x"], f"{stage}_rank": torch.full((len(data),), self.rank)},
            {"uid": data.non_tensor_batch["uid"]},
        )

    @register(Dispatch.DP_COMPUTE, blocking=False)
    def produce(self, data):
        return self._step(data, "producer")

    @register(Dispatch.DP_COMPUTE, blocking=False, auto_padding=True)
    def produce_padded(self, data):
        return self._step(data, "producer")

    @register(Dispatch.DP_COMPUTE, blocking=False, auto_padding=True)
    def drop_first_row_padded(self, data):
        return data[1:]

    @register(Dispatch.DP_COMPUTE)
    def consume(self, data):
        return self._step(data, "consumer")

    @register(Dispatch.DP_COMPUTE, auto_padding=True)
    def consume_padded(self, data):
        return self._step(data, "consumer")

    @register(Dispatch.DP_COMPUTE, materialize_futures=False)
    def consume_lazily(self, data):
        received = type(data).__name__
        out = self._step(data.get(), "consumer")
        out.meta_info["received"] = received
        return out

    @register(Dispatch.DP_COMPUTE)
    def add(self, a, b):
        return DataProto.from_dict({"sum": a.batch["x"] + b.batch["x"]})

    @register(Dispatch.ONE_TO_ALL)
    def total(self, data):
        return float(data.batch["x"].sum())

    @register(Dispatch.ONE_TO_ALL, blocking=False)
    def rank_squared(self):
        return self.rank**2

    @register(Dispatch.DP_COMPUTE_METRIC, blocking=False)
    def count(self, data):
        return len(data)

    @register()
    def take_seen(self):
        seen, self.seen = self.seen, []
        return seen


def expected(num_rows: int, stages: int) -> list[float]:
    """y after `stages` steps: x * (1 + 10 + 100 + ...)."""
    return [float(x * sum(10**i for i in range(stages))) for x in range(num_rows)]


@pytest.fixture(scope="module", params=["local", "ray"])
def stage_clusters(request):
    """Clusters of 3, 2 and 4 workers time-sharing four devices, per backend; shared by this module's tests."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    manager = ResourceManager(1, 4, backend=request.param)
    clusters = []
    try:
        for name, world_size, share in [("p3", 3, ()), ("c2", 2, ("p3",)), ("c4", 4, ("p3", "c2"))]:
            clusters.append(Cluster(Stage, WorkerConfig(name, world_size=world_size, share_devices_with=share), manager))
        yield SimpleNamespace(backend=request.param, p3=clusters[0], c2=clusters[1], c4=clusters[2])
    finally:
        for cluster in clusters:
            cluster.shutdown()
        manager.shutdown()


@pytest.fixture
def stages(stage_clusters):
    """The shared clusters, with what their workers saw in earlier tests forgotten."""
    for cluster in (stage_clusters.p3, stage_clusters.c2, stage_clusters.c4):
        cluster.take_seen()
    return stage_clusters


def test_non_blocking_calls_return_futures(stages):
    p3, c2, c4 = stages.p3, stages.c2, stages.c4
    future = p3.rank_squared()
    assert isinstance(future, CallFuture)
    assert future.get() == [0, 1, 4]
    metric = c2.count(batch(5))
    assert isinstance(metric, CallFuture) and metric.get() == [3, 2]

    future = p3.produce(batch(10))
    assert isinstance(future, DataProtoFuture)
    assert future.shard_lengths() == [4, 3, 3]
    assert len(future) == 10
    data = future.get()
    assert data.batch["y"].tolist() == expected(10, 1)
    assert data.batch["producer_rank"].tolist() == [0] * 4 + [1] * 3 + [2] * 3
    assert data.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(10)]

    tail = DataProto.from_dict(
        {"x": torch.tensor([10.0, 11.0]), "y": torch.tensor([7.0, 8.0]), "producer_rank": torch.tensor([9, 9])}, {"uid": ["t0", "t1"]}
    )
    both = materialize_concat([future, tail])
    assert both.batch["y"].tolist() == expected(10, 1) + [7.0, 8.0]
    assert both.batch["producer_rank"].tolist() == [0] * 4 + [1] * 3 + [2] * 3 + [9, 9]
    assert both.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(10)] + ["t0", "t1"]


def test_future_feeds_a_cluster_of_another_size(stages):
    p3, c2, c4 = stages.p3, stages.c2, stages.c4
    future = p3.produce(batch(10))  # shards of 4, 3, 3 rows
    direct = c2.consume(future.get())
    c2.take_seen()

    chained = c2.consume(future)  # 3 producers -> 2 consumers: 5 rows each
    assert c2.take_seen() == [[[0, 1, 2, 3, 4]], [[5, 6, 7, 8, 9]]]
    assert chained.equals(direct)
    assert chained.batch["y"].tolist() == expected(10, 2)
    assert chained.batch["consumer_rank"].tolist() == [0] * 5 + [1] * 5
    assert chained.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(10)]
    assert p3.take_seen() == [[[0, 1, 2, 3]], [[4, 5, 6]], [[7, 8, 9]]]  # produced once, read twice

    # 2 -> 4 with auto padding: c2's 10 rows (5, 5) are padded to 12 and re-split into 3 per consumer.
    relayed = c2.produce(future)
    assert relayed.shard_lengths() == [5, 5]
    out = c4.consume_padded(relayed)
    assert c4.take_seen() == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]], [[9, 0, 1]]]
    assert len(out) == 10
    assert out.batch["y"].tolist() == expected(10, 3)
    assert out.batch["consumer_rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(10)]
    c2.take_seen()

    # 3 rows over 4 consumers: one consumer gets an empty slice of a remote shard.
    out = c4.consume(p3.produce(batch(3)))
    assert c4.take_seen() == [[[0]], [[1]], [[2]], [[]]]
    assert out.batch["y"].tolist() == expected(3, 2)

    # A padded producer's future hides its padding rows from consumers.
    padded = p3.produce_padded(batch(10))  # 10 rows padded to 12: shards of 4
    assert padded.shard_lengths() == [4, 4, 4] and len(padded) == 10
    out = c2.consume(padded)
    assert c2.take_seen() == [[[0, 1, 2, 3, 4]], [[5, 6, 7, 8, 9]]]
    assert out.batch["y"].tolist() == expected(10, 2)
    assert len(padded.get()) == 10

    # In a non-dp call the whole future is materialised on every worker.
    assert c2.total(future) == [45.0, 45.0]


def test_materialize_futures_false_hands_the_future_to_the_worker(stages):
    p3, c2, c4 = stages.p3, stages.c2, stages.c4
    out = c2.consume_lazily(p3.produce(batch(6)))
    assert out.meta_info["received"] == "DataProtoFuture"
    assert out.batch["y"].tolist() == expected(6, 2)
    assert out.batch["consumer_rank"].tolist() == [0, 0, 0, 1, 1, 1]


def test_future_and_data_of_different_lengths_are_refused(stages):
    p3, c2, c4 = stages.p3, stages.c2, stages.c4
    future = p3.produce(batch(6))
    assert c2.add(future, batch(6)).batch["sum"].tolist() == [2.0 * i for i in range(6)]
    with pytest.raises(ValueError, match="same length"):
        c2.add(future, batch(5))


def test_padded_future_of_a_row_dropping_method_is_refused(stages):
    p3, c2, c4 = stages.p3, stages.c2, stages.c4
    message = r"drop_first_row_padded is registered with auto_padding but returned shards of \[3, 3, 3\] rows for \[4, 4, 4\]"
    future = p3.drop_first_row_padded(batch(10))  # 10 rows padded to 12; stripping 2 would drop real rows
    with pytest.raises(ValueError, match=message):
        future.get()
    with pytest.raises(ValueError, match=message):
        c2.consume(future)


def test_on_ray_the_driver_never_fetches_chained_data(stages, monkeypatch):
    if stages.backend != "ray":
        pytest.skip("on the local backend the workers run in the driver's process")
    p3, c2, c4 = stages.p3, stages.c2, stages.c4
    driver_unpickled = []
    unpickle = DataProto.__setstate__

    def counting_unpickle(self, state):
        driver_unpickled.append(len(state["batch"]["x"]) if "x" in state["batch"] else None)
        unpickle(self, state)

    def refuse(self, timeout_s=None):
        raise AssertionError("the driver fetched a DataProtoFuture")

    with monkeypatch.context() as patch:
        patch.setattr(DataProto, "__setstate__", counting_unpickle)
        patch.setattr(DataProtoFuture, "get", refuse)
        future = p3.produce(batch(10))
        assert future.shard_lengths() == [4, 3, 3]
        out = c4.consume(future)
        lazily = c2.consume_lazily(future)
    assert out.batch["y"].tolist() == expected(10, 2)
    assert lazily.batch["y"].tolist() == expected(10, 2)
    # The driver unpickled only the consumers' outputs (4 + 2 shards), never the producers' shards.
    assert sorted(driver_unpickled) == sorted([3, 3, 2, 2, 5, 5])
