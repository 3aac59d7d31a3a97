"""Dispatch modes, model-parallel layouts, auto padding, custom modes, colocation and worker context, on both backends."""

import os

import pytest
import torch

from baton import (
    Cluster, DataProto, Dispatch, Execute, ResourceManager, Worker, WorkerConfig, WorkerSpec, create_clusters_parallel,
    create_colocated_clusters, register, register_dispatch_mode,
)


def batch(num_rows: int) -> DataProto:
    """Row i holds x = i (float) and uid "u{i}"."""
    return DataProto.from_dict({"x": torch.arange(num_rows, dtype=torch.float32)}, {"uid": [f"u{i}" for i in range(num_rows)]})


def tagged(data: DataProto, rank: int, scale: float = 2.0) -> DataProto:
    """One output row per input row: the input's x and uid, y = x * scale, and the rank that computed it."""
    return DataProto.from_dict(
        {"x": data.batch["x"], "y": data.batch["x"] * scale, "rank": torch.full((len(data),), rank)},
        {"uid": data.non_tensor_batch["uid"]},
    )


# ---- a shared 4-worker cluster for the dispatch modes --------------------------------------------


def _to_every_rank(layout, args, kwargs):
    return [(args, kwargs)] * layout.world_size


def _one_item_per_even_rank(layout, args, kwargs):
    """Element i of the single list argument goes to rank 2i; odd ranks get None."""
    (items,) = args
    return [((items[rank // 2] if rank % 2 == 0 else None,), {}) for rank in range(layout.world_size)]


SUM = register_dispatch_mode("test_dispatch.sum", _to_every_rank, lambda layout, outputs: sum(outputs))
EVEN = register_dispatch_mode(
    "test_dispatch.even", _one_item_per_even_rank, lambda layout, outputs: list(outputs),
    collect_ranks_fn=lambda layout: list(range(0, layout.world_size, 2)),
)


class Modes(Worker):
    def __init__(self):
        self.num_bumps = 0
        self.seen: list[list[float]] = []
        self.received = None

    @register(Dispatch.ONE_TO_ALL)
    def rank_plus(self, k):
        """Returns 10 * rank + k."""
        return 10 * self.rank + k

    @register(Dispatch.ONE_TO_ALL_ONE)
    def rank_plus_one(self, k):
        return 10 * self.rank + k

    @register(Dispatch.ALL_TO_ALL)
    def scaled(self, value, factor=1):
        return (self.rank, value * factor)

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def bump(self):
        self.num_bumps += 1
        return ("bumped", self.rank, self.num_bumps)

    @register()
    def bumps(self):
        return self.num_bumps

    @register(Dispatch.DP_COMPUTE)
    def compute(self, data, scale=2.0):
        self.seen.append(data.batch["x"].tolist())
        return tagged(data, self.rank, scale)

    @register(Dispatch.DP_COMPUTE)
    def add(self, a, b):
        return DataProto.from_dict({"sum": a.batch["x"] + b.batch["x"]})

    @register(Dispatch.DP_COMPUTE_METRIC)
    def stats(self, data):
        return {"rank": self.rank, "rows": data.batch["x"].tolist()}

    @register(Dispatch.DP_COMPUTE, auto_padding=True)
    def compute_padded(self, data):
        self.seen.append(data.batch["x"].tolist())
        return tagged(data, self.rank)

    @register(Dispatch.DP_COMPUTE, auto_padding=True)
    def drop_first_row(self, data):
        return data[1:]

    @register()
    def take_seen(self):
        seen, self.seen = self.seen, []
        return seen

    @register(SUM)
    def rank_times(self, k):
        return self.rank * k

    @register(EVEN)
    def on_even(self, item):
        self.received = item
        return (self.rank, item)

    @register()
    def last_received(self):
        return self.received

    def helper(self):
        """Not registered: stays off the cluster."""
        return "hidden"


@pytest.fixture(scope="module", params=["local", "ray"])
def modes(request):
    """A 4-worker `Modes` cluster per backend, shared by the tests that only call it (its state is per test)."""
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
    manager = ResourceManager(1, 4, backend=request.param)
    try:
        with Cluster(Modes, WorkerConfig("modes", world_size=4), manager) as cluster:
            cluster.take_seen()
            yield cluster
    finally:
        manager.shutdown()


# ---- plain modes ----------------------------------------------------------------------------------


def test_one_to_all_all_to_all_and_rank_zero(modes):
    assert modes.rank_plus(3) == [3, 13, 23, 33]
    assert modes.rank_plus(k=5) == [5, 15, 25, 35]
    assert modes.rank_plus_one(7) == 7

    assert modes.scaled([1, 2, 3, 4]) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert modes.scaled([1, 2, 3, 4], factor=[1, 1, 10, 10]) == [(0, 1), (1, 2), (2, 30), (3, 40)]
    with pytest.raises(ValueError, match="world_size=4; argument 0 is list of length 3"):
        modes.scaled([1, 2, 3])
    with pytest.raises(ValueError, match="world_size=4; factor is int"):
        modes.scaled([1, 2, 3, 4], factor=2)

    [before, *others] = modes.bumps()
    assert modes.bump() == ("bumped", 0, before + 1)  # rank 0's result, not a list
    assert modes.bump() == ("bumped", 0, before + 2)
    assert modes.bumps() == [before + 2, *others] and others == [0, 0, 0]


def test_custom_dispatch_modes(modes):
    assert modes.rank_times(2) == (0 + 1 + 2 + 3) * 2
    assert modes.on_even(["a", "b"]) == [(0, "a"), (2, "b")]
    assert modes.last_received() == ["a", None, "b", None]


def test_custom_mode_names_are_checked():
    with pytest.raises(ValueError, match="already registered"):
        register_dispatch_mode(SUM, _to_every_rank, lambda layout, outputs: outputs)
    with pytest.raises(ValueError, match=r"unknown dispatch mode 'no_such_mode'; valid: \[.*'one_to_all'.*'test_dispatch.sum'"):
        register(dispatch_mode="no_such_mode")


# ---- data parallel --------------------------------------------------------------------------------


def test_dp_compute_splits_unevenly_and_concatenates_in_order(modes):
    out = modes.compute(batch(10), scale=3.0)
    assert modes.take_seen() == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7]], [[8, 9]]]
    assert out.batch["x"].tolist() == list(range(10))
    assert out.batch["y"].tolist() == [3.0 * i for i in range(10)]
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert out.non_tensor_batch["uid"].tolist() == [f"u{i}" for i in range(10)]

    out = modes.compute(batch(3))  # rank 3 gets an empty shard
    assert modes.take_seen() == [[[0]], [[1]], [[2]], [[]]]
    assert out.batch["rank"].tolist() == [0, 1, 2]
    assert out.batch["y"].tolist() == [0.0, 2.0, 4.0]

    assert modes.stats(batch(10)) == [
        {"rank": 0, "rows": [0, 1, 2]}, {"rank": 1, "rows": [3, 4, 5]}, {"rank": 2, "rows": [6, 7]}, {"rank": 3, "rows": [8, 9]},
    ]

    assert modes.add(batch(6), b=batch(6)).batch["sum"].tolist() == [2 * i for i in range(6)]
    with pytest.raises(ValueError, match="same length"):
        modes.add(batch(6), batch(5))


def test_verl_names_alias_the_same_modes_and_verl_dp_compute_lists_are_refused(modes):
    assert Dispatch.DP_COMPUTE_PROTO is Dispatch.DP_COMPUTE  # verl's DataProto split-and-concat
    assert Dispatch.DP_COMPUTE_PROTO_WITH_FUNC is Dispatch.DP_COMPUTE  # a function argument is broadcast
    # verl's DP_COMPUTE hands worker i element i of each list; here that is ALL_TO_ALL, and a dp mode says so
    # instead of broadcasting the whole list to every worker.
    with pytest.raises(ValueError, match=r"argument 0 is a list: .*verl's Dispatch.DP_COMPUTE.*Dispatch.ALL_TO_ALL"):
        modes.stats([batch(1)] * 4)
    with pytest.raises(ValueError, match="this call has none; pass a DataProto, or .*ONE_TO_ALL"):
        modes.stats(data=3)


def test_auto_padding_repeats_first_rows_and_strips_them(modes):
    out = modes.compute_padded(batch(10))
    # 10 rows padded to 12 with copies of rows 0 and 1; every worker gets 3.
    assert modes.take_seen() == [[[0, 1, 2]], [[3, 4, 5]], [[6, 7, 8]], [[9, 0, 1]]]
    assert len(out) == 10
    assert out.batch["x"].tolist() == list(range(10))
    assert out.batch["rank"].tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    assert out.batch["y"].tolist() == modes.compute(batch(10)).batch["y"].tolist()
    modes.take_seen()

    out = modes.compute_padded(batch(8))  # already divisible: no padding
    assert modes.take_seen() == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    assert out.batch["x"].tolist() == list(range(8))

    with pytest.raises(ValueError, match="drop_first_row is registered with auto_padding but returned 2 rows for 3"):
        modes.drop_first_row(batch(10))


def test_auto_padding_is_for_dp_modes_only():
    with pytest.raises(ValueError, match="dp dispatch modes only"):
        register(Dispatch.ONE_TO_ALL, auto_padding=True)


def test_own_thread_is_for_plain_calls_not_dp_data_methods():
    with pytest.raises(ValueError, match="own_thread is for a method that waits"):
        register(Dispatch.DP_COMPUTE, own_thread=True)


# ---- how methods appear on the cluster ------------------------------------------------------------


def test_cluster_methods_keep_name_and_docstring(modes):
    assert modes.rank_plus.__name__ == "rank_plus"
    assert modes.rank_plus.__doc__ == "Returns 10 * rank + k."
    assert not hasattr(modes, "helper")
    assert modes.name == "modes" and modes.world_size == 4


class Clashing(Worker):
    @register()
    def shutdown(self):
        return "mine"


class Plain(Worker):
    @register()
    def rank_now(self):
        return self.rank


def test_method_clashing_with_cluster_is_refused(make_manager, backend):
    manager = make_manager(backend, num_devices_per_node=1)
    with pytest.raises(ValueError, match="Clashing.shutdown clashes with Cluster.shutdown; rename"):
        Cluster(Clashing, WorkerConfig("clash", world_size=1), manager)
    with pytest.raises(ValueError, match="Clashing.shutdown clashes"):
        create_colocated_clusters({"plain": Plain, "clash": Clashing}, WorkerConfig("fused", world_size=1), manager)
    # The refused clusters left no claim on the device behind.
    with Cluster(Plain, WorkerConfig("after_clash", world_size=1), manager) as cluster:
        assert cluster.rank_now() == [0]


class Wrapped(Worker):
    @torch.no_grad()
    @register(Dispatch.ONE_TO_ALL)
    def grad_enabled(self):
        """Reports whether autograd is on inside the call."""
        return torch.is_grad_enabled()


def test_a_method_wrapped_after_register_stays_a_cluster_method(make_manager):
    manager = make_manager("local", num_devices_per_node=2)
    with Cluster(Wrapped, WorkerConfig("wrapped", world_size=2), manager) as cluster:
        assert cluster.grad_enabled() == [False, False]  # the outer decorator still applies
        assert cluster.grad_enabled.__doc__ == "Reports whether autograd is on inside the call."


# ---- model-parallel layouts -----------------------------------------------------------------------


class TensorParallel(Worker):
    """Two dp groups of two tp ranks: ranks (0, 1) form dp rank 0, ranks (2, 3) dp rank 1."""

    def __init__(self):
        self.set_rank_info(dp_rank=self.rank // 2, dp_size=2, tp_rank=self.rank % 2, tp_size=2)
        self.seen: list = []

    @register(Dispatch.DP_COMPUTE)
    def compute(self, data):
        self.seen.append(data.batch["x"].tolist())
        return tagged(data, self.rank)

    @register(Dispatch.DP_DISPATCH_FIRST)
    def compute_first(self, data):
        self.seen.append(None if data is None else data.batch["x"].tolist())
        return None if data is None else tagged(data, self.rank)

    @register(Dispatch.DP_COMPUTE_METRIC)
    def shard(self, data):
        return (self.rank, data.batch["x"].tolist())

    @register()
    def set_layout(self, tp_size, dp_size=None):
        dp_size = dp_size or self.world_size // tp_size
        self.set_rank_info(dp_rank=(self.rank // tp_size) % dp_size, dp_size=dp_size, tp_rank=self.rank % tp_size, tp_size=tp_size)

    @register()
    def take_seen(self):
        seen, self.seen = self.seen, []
        return seen


def test_tensor_parallel_groups_share_a_shard_and_only_tp0_is_collected(make_manager, backend):
    with Cluster(TensorParallel, WorkerConfig("tp", world_size=4), make_manager(backend)) as cluster:
        out = cluster.compute(batch(5))
        assert cluster.take_seen() == [[[0, 1, 2]], [[0, 1, 2]], [[3, 4]], [[3, 4]]]
        assert out.batch["x"].tolist() == [0, 1, 2, 3, 4]  # each row once
        assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2]

        out = cluster.compute_first(batch(5))
        assert cluster.take_seen() == [[[0, 1, 2]], [None], [[3, 4]], [None]]
        assert out.batch["rank"].tolist() == [0, 0, 0, 2, 2]

        assert cluster.shard(batch(4)) == [(0, [0, 1]), (2, [2, 3])]

        cluster.set_layout(tp_size=1)  # plain dp over 4 ranks
        cluster.refresh_rank_info()
        assert cluster.shard(batch(4)) == [(0, [0]), (1, [1]), (2, [2]), (3, [3])]

        cluster.set_layout(tp_size=4)  # one dp group
        cluster.refresh_rank_info()
        assert cluster.shard(batch(4)) == [(0, [0, 1, 2, 3])]

        cluster.set_layout(tp_size=2, dp_size=1)  # 1 x 2 does not cover 4 workers
        cluster.refresh_rank_info()
        with pytest.raises(ValueError, match=r"multiply to world_size=4"):
            cluster.compute(batch(4))


# ---- colocation and parallel construction ---------------------------------------------------------

SHARED_WEIGHTS: dict[int, torch.Tensor] = {}  # rank -> the actor's weights, read by the rollout role in the same process


class Actor(Worker):
    def __init__(self):
        self.weights = torch.zeros(3)
        SHARED_WEIGHTS[self.rank] = self.weights

    @register()
    def pid(self):
        return os.getpid()

    @register()
    def weights_now(self):
        return (self.weights.data_ptr(), self.weights.tolist())


class Rollout(Worker):
    @register()
    def pid(self):
        return os.getpid()

    @register()
    def bump_actor_weights(self):
        """Writes into the actor's tensor in place; the actor sees it only if both roles share the process."""
        weights = SHARED_WEIGHTS[self.rank]
        weights += self.rank + 1
        return weights.data_ptr()


def test_colocated_roles_share_a_process(make_manager, backend):
    clusters = create_colocated_clusters({"actor": Actor, "rollout": Rollout}, WorkerConfig("fused", world_size=2), make_manager(backend))
    actor, rollout = clusters["actor"], clusters["rollout"]
    try:
        assert actor.name == "actor" and rollout.name == "rollout"
        actor_pids = actor.pid()
        assert rollout.pid() == actor_pids
        if backend == "ray":
            assert len(set(actor_pids)) == 2 and os.getpid() not in actor_pids

        pointers = rollout.bump_actor_weights()
        assert actor.weights_now() == [(pointers[0], [1.0, 1.0, 1.0]), (pointers[1], [2.0, 2.0, 2.0])]

        assert hasattr(actor, "weights_now") and not hasattr(actor, "bump_actor_weights")
        assert hasattr(rollout, "bump_actor_weights") and not hasattr(rollout, "weights_now")
    finally:
        actor.shutdown()


def test_a_worker_view_calls_its_rank_alone_and_cannot_restart_or_stop_alone(make_manager, backend):
    """`worker_view(rank)`: one rank of a colocated cluster as a cluster of one (how the rollout system makes each
    colocated engine a router engine of its own); its process is the whole cluster's, so it cannot restart alone."""
    from baton.distributed import ClusterStoppedError

    clusters = create_colocated_clusters({"actor": Actor, "rollout": Rollout}, WorkerConfig("fused", world_size=2), make_manager(backend))
    actor, rollout = clusters["actor"], clusters["rollout"]
    try:
        second = rollout.worker_view(1)
        assert second.world_size == 1 and second.pid() == [actor.pid()[1]]
        second.bump_actor_weights()  # rank 1 alone: + 2
        assert [weights for _, weights in actor.weights_now()] == [[0.0] * 3, [2.0] * 3]
        assert len(second.placements) == 1 and second.placements[0] == actor.placements[1]
        for stop in (second.restart, second.shutdown):
            with pytest.raises(ClusterStoppedError, match="rank 1 cannot .* alone: its process is shared"):
                stop()
        assert [weights for _, weights in actor.weights_now()] == [[0.0] * 3, [2.0] * 3]  # nothing was lost
        with pytest.raises(ValueError, match=r"ranks 0..1, not 2"):
            rollout.worker_view(2)
    finally:
        actor.shutdown()


class Tagged(Worker):
    def __init__(self, tag: str, scale: int = 1):
        self.tag = tag
        self.scale = scale

    @register()
    def describe(self):
        return (self.tag, self.rank * self.scale, self.context.device_ids)


def test_create_clusters_parallel(make_manager, backend):
    manager = make_manager(backend)
    left, right = create_clusters_parallel(
        [
            (WorkerSpec(Tagged, ("left",)), WorkerConfig("left", device_mapping=[0, 1])),
            (WorkerSpec(Tagged, ("right",), {"scale": 10}), WorkerConfig("right", device_mapping=[1, 2], share_devices_with=("left",))),
        ],
        manager,
    )
    try:
        assert left.describe() == [("left", 0, (0,)), ("left", 1, (1,))]
        assert right.describe() == [("right", 0, (1,)), ("right", 10, (2,))]
    finally:
        left.shutdown()
        right.shutdown()

    with pytest.raises(ValueError, match="device 3 is already used by cluster 'first'"):
        create_clusters_parallel(
            [
                (WorkerSpec(Tagged, ("first",)), WorkerConfig("first", device_mapping=[2, 3])),
                (WorkerSpec(Tagged, ("second",)), WorkerConfig("second", device_mapping=[3])),
            ],
            manager,
        )
    # Nothing of the refused request stays claimed.
    with Cluster(WorkerSpec(Tagged, ("third",)), WorkerConfig("third", device_mapping=[3]), manager) as third:
        assert third.describe() == [("third", 0, (3,))]


# ---- worker context -------------------------------------------------------------------------------

ENV_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "BATON_TEST_FLAG")


class Where(Worker):
    def __init__(self, greeting, *, punctuation="."):
        self.greeting = greeting + punctuation
        self.env_at_init = {key: os.environ.get(key) for key in ENV_KEYS}

    @register()
    def where(self):
        return {
            "rank": self.rank, "world_size": self.world_size, "local_rank": self.local_rank,
            "local_world_size": self.local_world_size, "master": (self.master_addr, self.master_port),
            "node_index": self.context.node_index, "device_ids": self.context.device_ids, "greeting": self.greeting,
            "env_at_init": self.env_at_init, "env_now": {key: os.environ.get(key) for key in ENV_KEYS},
        }


def test_worker_context_and_environment(make_manager, backend):
    manager = make_manager(backend, num_nodes=2, num_devices_per_node=2)
    config = WorkerConfig("where", world_size=4, env_vars={"BATON_TEST_FLAG": "on"})
    if backend == "local":
        with pytest.warns(UserWarning, match="env_vars are ignored on the local backend"):
            cluster = Cluster(WorkerSpec(Where, ("hello",), {"punctuation": "!"}), config, manager)
    else:
        cluster = Cluster(WorkerSpec(Where, ("hello",), {"punctuation": "!"}), config, manager)
    with cluster:
        infos = cluster.where()
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert {i["world_size"] for i in infos} == {4}
    assert [i["local_rank"] for i in infos] == [0, 1, 0, 1]
    assert [i["local_world_size"] for i in infos] == [2, 2, 2, 2]
    assert [i["node_index"] for i in infos] == [0, 0, 1, 1]
    assert [i["device_ids"] for i in infos] == [(0,), (1,), (2,), (3,)]
    assert {i["greeting"] for i in infos} == {"hello!"}
    [(master_addr, master_port)] = {i["master"] for i in infos}
    assert master_addr and master_port > 0

    for info in infos:
        if backend == "ray":
            expected = {
                "RANK": str(info["rank"]), "WORLD_SIZE": "4", "LOCAL_RANK": str(info["local_rank"]), "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port), "BATON_TEST_FLAG": "on",
            }
            assert info["env_at_init"] == expected and info["env_now"] == expected
        else:  # in-process workers leave the driver's environment alone
            assert info["env_now"]["BATON_TEST_FLAG"] is None
