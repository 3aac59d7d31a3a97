"""Resource layouts: device_mapping validation, pools, overlap, and placement over two simulated nodes."""

from __future__ import annotations

import os
import threading

import pytest
import ray

from baton import Cluster, ResourceManager, ResourcePool, Worker, WorkerConfig, register
from baton.distributed import LayoutError


class Where(Worker):
    @register()
    def where(self) -> dict:
        return {
            "node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local",
            "rank": self.rank,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "devices": self.context.device_ids,
            "node_index": self.context.node_index,
        }


class Cores(Worker):
    def __init__(self):
        self.helper = threading.Thread(target=threading.Event().wait, daemon=True)  # a thread made in __init__
        self.helper.start()

    @register()
    def cores(self) -> dict:
        """Each thread's affinity: the process's, and a thread started now."""
        seen = {}
        late = threading.Thread(target=lambda: seen.update(late=sorted(os.sched_getaffinity(0))))
        late.start()
        late.join()
        tasks = sorted(int(t) for t in os.listdir("/proc/self/task"))
        return {"threads": {tid: sorted(os.sched_getaffinity(tid)) for tid in tasks}, **seen}


def local_manager(num_nodes=2, num_devices_per_node=4) -> ResourceManager:
    return ResourceManager(num_nodes, num_devices_per_node, backend="local")


@pytest.mark.parametrize(
    "config, message",
    [
        (WorkerConfig("a", device_mapping=[0, 8]), "device ids [8] are out of range"),
        (WorkerConfig("a", device_mapping=[1, 1]), "appear more than once"),
        (WorkerConfig("a", world_size=3, device_mapping=[0, 1]), "world_size=3 but device_mapping gives 2 workers"),
        (WorkerConfig("a", device_mapping=[0, 1, 2], num_devices_per_worker=2), "not a multiple of num_devices_per_worker=2"),
        (WorkerConfig("a", device_mapping=[3, 4], num_devices_per_worker=2), "would span nodes [0, 1]"),
        (WorkerConfig("a", device_mapping=[0], num_devices_per_worker=0), "take no device_mapping"),
        (WorkerConfig("a", device_mapping=[]), "is empty"),
        (WorkerConfig(""), "name is empty"),
    ],
)
def test_bad_layouts_name_the_problem(config, message):
    with pytest.raises(LayoutError) as info:
        Cluster(Where, config, local_manager())
    assert message in str(info.value)


def test_overlap_needs_share_devices_with():
    manager = local_manager()
    first = Cluster(Where, WorkerConfig("actor", device_mapping=[0, 1]), manager)
    with pytest.raises(LayoutError, match="device 1 is already used by cluster 'actor'.*share_devices_with=\\['actor'\\]"):
        Cluster(Where, WorkerConfig("rollout", device_mapping=[1, 2]), manager)
    shared = Cluster(Where, WorkerConfig("rollout", device_mapping=[1, 2], share_devices_with=("actor",)), manager)
    assert [w["devices"] for w in shared.where()] == [(1,), (2,)]
    first.shutdown()
    # Once the actor is gone its devices are free again.
    Cluster(Where, WorkerConfig("critic", device_mapping=[0]), manager).shutdown()
    shared.shutdown()


def test_local_ranks_follow_nodes():
    cluster = Cluster(Where, WorkerConfig("a", device_mapping=[2, 3, 4, 5, 6]), local_manager())
    info = cluster.where()
    assert [w["node_index"] for w in info] == [0, 0, 1, 1, 1]
    assert [w["local_rank"] for w in info] == [0, 1, 0, 1, 2]
    assert [w["local_world_size"] for w in info] == [2, 2, 3, 3, 3]


def test_pools_split_and_merge():
    manager = local_manager()
    whole = manager.pool()
    assert whole.device_ids == tuple(range(8))
    train, infer = whole.split([6, 2])
    assert (train.device_ids, infer.device_ids) == ((0, 1, 2, 3, 4, 5), (6, 7))
    a, b = train.split([3, 3])
    merged = ResourcePool.merge(b, infer)
    assert merged.device_ids == (3, 4, 5, 6, 7)
    with pytest.raises(LayoutError, match="sum to 8"):
        whole.split([4, 3])
    with pytest.raises(LayoutError, match="share devices \\[3, 4, 5\\]"):
        ResourcePool.merge(b, train)
    with pytest.raises(LayoutError, match="same ResourceManager"):
        ResourcePool.merge(a, local_manager().pool([0]))
    with pytest.raises(LayoutError, match="out of range"):
        manager.pool([9])
    # Clusters on pools: the pool gives the device mapping; world_size may take a prefix.
    on_a = Cluster(Where, WorkerConfig("x"), a)
    on_merged = Cluster(Where, WorkerConfig("y", world_size=2), merged)
    assert [w["devices"] for w in on_a.where()] == [(0,), (1,), (2,)]
    assert [w["devices"] for w in on_merged.where()] == [(3,), (4,)]
    with pytest.raises(LayoutError, match="not in the given pool"):
        Cluster(Where, WorkerConfig("z", device_mapping=[7]), a)


@pytest.mark.ray
def test_two_nodes_placement(make_manager):
    manager = make_manager("ray", num_nodes=2, num_devices_per_node=2)
    assert manager.num_devices == 4
    with Cluster(Where, WorkerConfig("gpuish", device_mapping=[0, 1, 2, 3]), manager) as cluster:
        info = cluster.where()
        nodes = [w["node"] for w in info]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]
        assert nodes[0] == ray.get_runtime_context().get_node_id()  # device 0 is on the driver's node
        assert [w["local_rank"] for w in info] == [0, 1, 0, 1]
    with Cluster(Where, WorkerConfig("reward", world_size=2, num_devices_per_worker=0), manager) as cpu_only:
        info = cpu_only.where()
        assert info[0]["node"] != info[1]["node"]  # spread over the nodes
        assert [w["devices"] for w in info] == [(), ()]


@pytest.mark.ray
def test_names_are_scoped_by_run(make_manager):
    from ray.util.placement_group import placement_group_table

    first, second = make_manager("ray", 1, 1), make_manager("ray", 1, 1)
    assert first.run_name != second.run_name
    names = {entry["name"] for entry in placement_group_table().values() if entry["state"] == "CREATED"}
    assert {f"{first.run_name}:node0", f"{second.run_name}:node0"} <= names
    # Same cluster name in two runs: no collision.
    a = Cluster(Where, WorkerConfig("actor", world_size=1), first)
    b = Cluster(Where, WorkerConfig("actor", world_size=1), second)
    assert ray.get_actor(f"{first.run_name}:actor:0") is not None
    assert ray.get_actor(f"{second.run_name}:actor:0") is not None
    a.shutdown()
    b.shutdown()


@pytest.mark.ray
def test_too_many_nodes_is_refused(make_manager):
    with pytest.raises(LayoutError, match="lower num_nodes or num_devices_per_node"):
        make_manager("ray", num_nodes=3, num_devices_per_node=2)


@pytest.mark.ray
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU affinity is Linux's")
def test_cpu_cores_pin_every_thread_of_the_worker_process(make_manager):
    core = max(os.sched_getaffinity(0))
    with Cluster(Cores, WorkerConfig("pinned", world_size=1, num_devices_per_worker=0, cpu_cores=[core]),
                 make_manager("ray")) as cluster:
        [report] = cluster.cores()
    assert report["late"] == [core]  # a thread made after the pinning inherits it
    assert set(map(tuple, report["threads"].values())) == {(core,)}  # Ray's threads and the worker's own


@pytest.mark.parametrize("cores, message", [([], "must list core numbers"), ([-1], "must list core numbers")])
def test_bad_cpu_cores_are_refused(cores, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig("a", world_size=1, cpu_cores=cores)


@pytest.mark.ray
def test_cpu_cores_past_the_nodes_cores_fail_the_workers_start_with_the_range(make_manager):
    with pytest.raises(Exception, match=r"cpu_cores \[4096\]: this node's cores are 0\.\."):
        Cluster(Cores, WorkerConfig("far", world_size=1, num_devices_per_worker=0, cpu_cores=[4096]),
                make_manager("ray"))
