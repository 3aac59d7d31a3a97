"""Sizing: Ray's CPU count, torch threads per worker process, the oversubscription warning, CPU-only fit."""

from __future__ import annotations

import os
import warnings

import pytest

from baton import Cluster, Worker, WorkerConfig, register
from baton.config import ConfigError
from baton.distributed import LayoutError, OversubscriptionWarning
from baton.distributed.worker import usable_cpu_count
from baton.pipelines.config import RLVRConfig, RoleConfig, TrainerConfig
from baton.pipelines.ray_start import start_ray


class Threads(Worker):
    @register()
    def threads(self) -> dict:
        import torch

        return {"torch": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS")}


def test_a_local_ray_gets_the_cores_this_process_may_use(monkeypatch, tmp_path):
    import ray

    monkeypatch.setenv("HOME", str(tmp_path))  # start_ray writes Ray's token where Ray would: not in the real home
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    start_ray(TrainerConfig())
    start_ray(TrainerConfig(num_cpus=7))
    assert [c["num_cpus"] for c in calls] == [usable_cpu_count(), 7]
    assert usable_cpu_count() == len(os.sched_getaffinity(0))

    # A later stage's setting cannot resize the running instance: said, not silently dropped.
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start_ray(TrainerConfig())
        start_ray(TrainerConfig(num_cpus=2))
        start_ray(TrainerConfig(num_cpus=4))
    assert [str(w.message) for w in caught] == [
        "trainer.num_cpus=4 is ignored: Ray is already running, with 2 CPUs (set it where Ray starts: in the demo, "
        "sft.trainer.num_cpus)"]
    assert len(calls) == 2


def test_the_usable_cores_follow_the_affinity_mask():
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        assert usable_cpu_count() == 1
    finally:
        os.sched_setaffinity(0, allowed)


@pytest.mark.ray
def test_threads_in_a_worker_follow_its_cpu_share_or_its_config(make_manager):
    # On a CPU-only Ray a slot is one CPU. Fits either simulated node (4 CPUs): 2 slots + 2 CPUs.
    manager = make_manager("ray", num_nodes=1, num_devices_per_node=2)
    configs = {
        "slot": WorkerConfig("slot", device_mapping=[0]),
        "two_slots": WorkerConfig("two_slots", device_mapping=[0, 1], num_devices_per_worker=2, share_devices_with=("slot",)),
        "slot_set": WorkerConfig("slot_set", device_mapping=[1], num_threads_per_worker=3, share_devices_with=("two_slots",)),
        "cpu_only": WorkerConfig("cpu_only", world_size=1, num_devices_per_worker=0, num_cpus_per_worker=2.0),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OversubscriptionWarning)  # more threads than this machine's cores
        clusters = {name: Cluster(Threads, config, manager) for name, config in configs.items()}
    try:
        threads = {name: cluster.threads()[0] for name, cluster in clusters.items()}
    finally:
        for cluster in clusters.values():
            cluster.shutdown()
    assert {name: (t["torch"], t["omp"]) for name, t in threads.items()} == {
        "slot": (1, "1"), "two_slots": (2, "2"), "slot_set": (3, "3"), "cpu_only": (2, "2")}


@pytest.mark.ray
def test_more_threads_than_cores_warns_once_naming_the_numbers(make_manager):
    cores = usable_cpu_count()
    manager = make_manager("ray", num_nodes=1, num_devices_per_node=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        within = Cluster(Threads, WorkerConfig("within", device_mapping=[0], num_threads_per_worker=cores), manager)
        # Processes that share a slot take turns on it (training and inference): the slot counts once.
        turns = Cluster(Threads, WorkerConfig("turns", device_mapping=[0], share_devices_with=("within",)), manager)
        assert not [w for w in caught if w.category is OversubscriptionWarning]
        over = Cluster(Threads, WorkerConfig("over", world_size=2, num_devices_per_worker=0, num_cpus_per_worker=0.5),
                       manager)
        more = Cluster(Threads, WorkerConfig("more", world_size=1, num_devices_per_worker=0, num_cpus_per_worker=0.5),
                       manager)
    for cluster in (within, turns, over, more):
        cluster.shutdown()
    [warning] = [w for w in caught if w.category is OversubscriptionWarning]  # once, not again for `more`
    message = str(warning.message)
    assert f"4 worker processes on node 0 run up to {cores + 2} torch threads at once" in message
    assert f"the node has {cores} CPU core(s)" in message and "num_threads_per_worker" in message


@pytest.mark.ray
def test_cpu_only_workers_that_cannot_fit_beside_the_slots_fail_at_once(make_manager):
    import ray

    manager = make_manager("ray", num_nodes=1, num_devices_per_node=2)
    [node] = [n for n in ray.nodes() if n["NodeID"] == manager.node_id(0)]
    node_cpus = node["Resources"]["CPU"]
    with pytest.raises(LayoutError, match=r"do not fit on node 0: it has .* 2 reserved for its 2 device slot\(s\).*"
                                          r"trainer\.num_cpus"):
        Cluster(Threads, WorkerConfig("reward", world_size=1, num_devices_per_worker=0,
                                      num_cpus_per_worker=node_cpus - 1), manager)
    # What fits still does: the refused cluster left nothing claimed.
    with Cluster(Threads, WorkerConfig("reward", world_size=1, num_devices_per_worker=0), manager) as fits:
        assert fits.threads()[0]["torch"] == 1


def test_on_the_local_backend_the_thread_setting_is_ignored_with_a_warning(make_manager):
    import torch

    before = torch.get_num_threads()
    with pytest.warns(UserWarning, match="num_threads_per_worker=3 is ignored on the local backend"):
        cluster = Cluster(Threads, WorkerConfig("local", world_size=1, num_threads_per_worker=3), make_manager("local"))
    assert cluster.threads()[0]["torch"] == before == torch.get_num_threads()


def test_a_role_carries_its_threads_to_its_workers_and_colocated_roles_agree():
    assert RoleConfig(num_threads_per_worker=2).worker_config("actor").num_threads_per_worker == 2
    config = RLVRConfig(actor=RoleConfig(num_threads_per_worker=2), rollout=RoleConfig(num_threads_per_worker=1),
                        colocate_actor_rollout=True)
    with pytest.raises(ConfigError, match="set it there and leave rollout's unset"):
        config.check()
    with pytest.raises(LayoutError, match="num_threads_per_worker=0 must be >= 1"):
        RoleConfig(num_threads_per_worker=0).num_workers("actor")
