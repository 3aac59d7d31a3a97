"""Failures surface as errors that name cluster, rank and method; nothing hangs."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from baton import Cluster, Dispatch, Worker, WorkerConfig, register
from baton.distributed import CallTimeoutError, ClusterStoppedError, LayoutError, WorkerDiedError, WorkerError
from conftest import wait_until


class Fragile(Worker):
    @register()
    def pid(self) -> int:
        return os.getpid()

    @register()
    def fail_on_rank_one(self) -> int:
        if self.rank == 1:
            raise ZeroDivisionError("rank one cannot divide")
        return self.rank

    @register(blocking=False)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.ONE_TO_ALL_ONE)
    def sleep_blocking(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register()
    def lose_a_peer_in_a_collective(self) -> int:
        """Rank 1 dies; rank 0 raises first, as a gloo collective does when its peer's socket closes."""
        if self.rank == 1:
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        raise ConnectionResetError("Connection reset by peer")


class BrokenInit(Worker):
    def __init__(self):
        if self.rank == 1:
            raise RuntimeError("cannot load the model")


def test_raising_worker_names_cluster_rank_method_and_traceback(make_manager, backend):
    with Cluster(Fragile, WorkerConfig("fragile", world_size=2), make_manager(backend)) as cluster:
        with pytest.raises(WorkerError) as info:
            cluster.fail_on_rank_one()
        error = info.value
        assert (error.cluster, error.rank, error.method) == ("fragile", 1, "fail_on_rank_one")
        assert "worker fragile[rank 1] raised in fail_on_rank_one()" in str(error)
        assert "ZeroDivisionError: rank one cannot divide" in str(error)
        assert "fail_on_rank_one" in error.remote_traceback and "raise ZeroDivisionError" in error.remote_traceback
        assert isinstance(error.__cause__, ZeroDivisionError)
        assert cluster.pid()  # the cluster still works after a raising call


def test_raising_constructor_is_reported(make_manager, backend):
    with pytest.raises(WorkerError, match=r"broken\[rank 1\] raised in __init__\(\)(.|\n)*cannot load the model"):
        Cluster(BrokenInit, WorkerConfig("broken", world_size=2), make_manager(backend))


# In the tests below the calls sleep an hour and the call timeout is 30 minutes: a pytest timeout catches a wait
# that the death or the timeout under test did not end.


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_killed_worker_fails_a_pending_call_within_seconds(make_manager):
    with Cluster(Fragile, WorkerConfig("victim", world_size=2), make_manager("ray")) as cluster:
        pids = cluster.pid()
        future = cluster.sleep(3600)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerDiedError) as info:
            future.get()
        assert (info.value.cluster, info.value.rank, info.value.method) == ("victim", 1, "sleep")
        assert "died in sleep()" in str(info.value) and "processes were stopped" in str(info.value)
        with pytest.raises(ClusterStoppedError, match=r"after victim\[rank 1\]\.sleep died; call restart\(\)"):
            cluster.pid()


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_killed_worker_fails_a_blocking_call_within_seconds(make_manager):
    with Cluster(Fragile, WorkerConfig("victim", world_size=2), make_manager("ray")) as cluster:
        pids = cluster.pid()
        # Killed before or after the call reaches it, rank 0 dies with the call pending.
        threading.Timer(0.5, os.kill, (pids[0], signal.SIGKILL)).start()
        with pytest.raises(WorkerDiedError, match=r"victim\[rank 0\] died in sleep_blocking"):
            cluster.sleep_blocking(3600)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_peer_that_died_is_the_cause_when_another_rank_raised_first(make_manager):
    """A rank killed inside a collective makes rank 0's collective raise before the death is seen; the error
    reported is the death (it names the rank to look at and stops the cluster), not rank 0's transport error."""
    config = WorkerConfig("peers", world_size=2, health_check_interval_s=0.5)
    with Cluster(Fragile, config, make_manager("ray")) as cluster:
        with pytest.raises(WorkerDiedError, match=r"peers\[rank 1\] died in lose_a_peer_in_a_collective"):
            cluster.lose_a_peer_in_a_collective()


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_health_monitor_sees_an_idle_worker_die(make_manager):
    with Cluster(Fragile, WorkerConfig("idle", world_size=2, health_check_interval_s=0.5), make_manager("ray")) as cluster:
        pid = cluster.pid()[1]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: cluster._group.monitor.check() is not None, "the health monitor to notice the dead worker")
        lost = cluster._group.monitor.check()
        assert lost.rank == 1 and not lost.frozen and "worker process died" in lost.reason
        with pytest.raises(WorkerDiedError, match=r"idle\[rank 1\] died in sleep_blocking"):
            cluster.sleep_blocking(3600)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_call_timeout_names_the_pending_ranks(make_manager):
    config = WorkerConfig("slow", world_size=2, call_timeout_s=1.0)
    with Cluster(Fragile, config, make_manager("ray")) as cluster:
        with pytest.raises(CallTimeoutError, match=r"slow\[rank 0\]\.sleep_blocking.*raise the cluster's call_timeout_s"):
            cluster.sleep_blocking(3600)


@pytest.mark.ray
def test_unplaceable_worker_is_refused_with_advice(make_manager):
    # More CPUs than the node has beside the manager's reserved slots: refused before any process starts.
    config = WorkerConfig("greedy", world_size=1, num_devices_per_worker=0, num_cpus_per_worker=64)
    with pytest.raises(LayoutError, match="'greedy': 1 CPU-only worker\\(s\\) × 64 CPU do not fit(.|\n)*fewer or smaller"):
        Cluster(Fragile, config, make_manager("ray"))


@pytest.mark.ray
def test_worker_waiting_for_busy_resources_times_out_with_advice(make_manager):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Two slots, so the worker has CPUs to ask for on either simulated node: the manager takes the 4-CPU
    # second node when the head is busy (CI once did, and a 4-slot reservation there left 0 to ask for).
    manager = make_manager("ray", num_nodes=1, num_devices_per_node=2)
    [node] = [n for n in ray.nodes() if n["NodeID"] == manager.node_id(0)]
    spare = node["Resources"]["CPU"] - 2  # what the 2 reserved slots leave
    assert spare >= 1, node
    # Fits beside the reserved slots, but something else holds those CPUs now: waits, then times out.
    class Holder:
        pass

    holder = ray.remote(num_cpus=spare, scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))(
        Holder).remote()
    try:
        ray.get(holder.__ray_ready__.remote())
        config = WorkerConfig("waiting", world_size=1, num_devices_per_worker=0, num_cpus_per_worker=spare,
                              start_timeout_s=2.0)
        with pytest.raises(CallTimeoutError, match="not started after 2 s(.|\n)*ask for fewer CPUs per worker"):
            Cluster(Fragile, config, manager)
    finally:
        ray.kill(holder)
