"""Liveness: a frozen worker or a timed-out call fails within its bound and stops the cluster; restart() brings it back.

Also: a busy worker is not taken for frozen, a DataProto method returning something else is named,
Ray's colour codes stay out of error messages, and the settings load from a role's YAML.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest
import torch

from baton import Cluster, DataProto, Dispatch, Worker, WorkerConfig, create_colocated_clusters, register
from baton.config import load_config
from baton.distributed import CallTimeoutError, ClusterStoppedError, WorkerError, WorkerFrozenError
from baton.pipelines.config import RoleConfig
from conftest import wait_until


class Sleeper(Worker):
    def __init__(self):
        self.calls = 0
        self.signalled = threading.Event()
        self.released = threading.Event()
        self.busy = False

    @register()
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL_ONE)
    def sleep_blocking(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(blocking=False)
    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    @register(blocking=False)
    def busy_until_released(self, how: str) -> int:
        """Keeps the call thread busy until `release()`: "spin" in pure Python (holds the GIL but lets other threads
        in at every switch interval), "matmul" in torch ops in native code, or "wait" blocked. Returns its rounds."""
        self.released.clear()
        self.busy = True
        a = torch.randn(256, 256)  # [256, 256]
        count = 0
        try:
            while not self.released.is_set():
                if how == "matmul":
                    a = torch.tanh(a @ a)
                elif how == "wait":
                    self.released.wait()
                count += 1
        finally:
            self.busy = False
        return count

    @register(own_thread=True)
    def is_busy(self) -> bool:
        return self.busy

    @register(own_thread=True)
    def release(self) -> None:
        self.released.set()

    @register()
    def count_call(self) -> int:
        self.calls += 1
        return self.calls

    @register()
    def divide(self, x: int) -> float:
        return x / self.rank

    @register(Dispatch.DP_COMPUTE)
    def stats(self, data: DataProto) -> dict:
        return {"loss": float(data.batch["x"].sum())}

    @register(Dispatch.ONE_TO_ALL_ONE, blocking=False, own_thread=True)
    def wait_for_signal(self, timeout_s: float) -> bool:
        """A long poll: waits for `signal` (a plain call) in the thread of its own."""
        return self.signalled.wait(timeout_s)

    @register(Dispatch.ONE_TO_ALL_ONE)
    def signal(self) -> None:
        self.signalled.set()


def _resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


class CountedHeartbeats:
    """Stands in for one worker's actor handle in its cluster's health monitor and keeps the heartbeats it sends."""

    def __init__(self, actor):
        self.actor, self.sent = actor, []

    @property
    def heartbeat(self):
        return self

    def remote(self):
        ref = self.actor.heartbeat.remote()
        self.sent.append(ref)
        return ref

    def num_answered(self) -> int:
        import ray

        return len(ray.wait(list(self.sent), num_returns=len(self.sent), timeout=0)[0]) if self.sent else 0


@pytest.mark.ray
@pytest.mark.timeout(120)  # the call sleeps an hour and the call timeout is 30 minutes: only the heartbeat ends it
def test_frozen_worker_fails_the_pending_call_within_its_bound_and_restart_recovers(make_manager):
    config = WorkerConfig("frozen", world_size=2, heartbeat_timeout_s=2.0, health_check_interval_s=0.5)
    with Cluster(Sleeper, config, make_manager("ray")) as cluster:
        pids = cluster.pid()
        # Stopped before or after the call reaches it, rank 1 leaves the pending call's heartbeats unanswered.
        threading.Timer(0.5, os.kill, (pids[1], signal.SIGSTOP)).start()
        try:
            with pytest.raises(WorkerFrozenError) as info:
                cluster.sleep_blocking(3600)
        finally:
            _resume(pids[1])
        error = info.value
        assert (error.cluster, error.rank, error.method) == ("frozen", 1, "sleep_blocking")
        assert "worker frozen[rank 1] froze in sleep_blocking()" in str(error)
        assert "no heartbeat answered for" in str(error) and "heartbeat_timeout_s=2" in str(error)
        assert "restart()" in str(error) and error.died

        with pytest.raises(ClusterStoppedError, match=r"cannot run pid\(\).*after frozen\[rank 1\]\.sleep_blocking froze"):
            cluster.pid()
        cluster.restart()
        assert cluster.sleep_blocking(0) == 0
        assert not set(cluster.pid()) & set(pids)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_busy_worker_is_not_taken_for_frozen(make_manager):
    # Each kind of busy call runs until the monitor has had 8 heartbeats answered since it began: 8 rounds at least
    # 0.25 s apart outlast heartbeat_timeout_s. Heartbeats answered only between calls would leave the call busy
    # until the monitor took the worker for frozen (1 s of silence): the wait below then ends on check().
    config = WorkerConfig("busy", world_size=1, heartbeat_timeout_s=1.0, health_check_interval_s=0.25)
    with Cluster(Sleeper, config, make_manager("ray")) as cluster:
        monitor = cluster._group.monitor
        counted = monitor._actors[0] = CountedHeartbeats(monitor._actors[0])
        try:
            for how in ("spin", "matmul", "wait"):
                call = cluster.busy_until_released(how)
                wait_until(lambda: cluster.is_busy() == [True], f"the worker to start its {how} call")
                first = counted.num_answered()
                wait_until(lambda: counted.num_answered() >= first + 8 or monitor.check() is not None,
                           f"8 heartbeats answered during the {how} call")
                assert monitor.check() is None, f"busy in {how}, the worker was taken for lost: {monitor.check()}"
                assert cluster.is_busy() == [True], f"the {how} call ended before it was released"
                cluster.release()
                assert call.get()[0] > 0
        finally:
            monitor._actors[0] = counted.actor


@pytest.mark.ray
@pytest.mark.timeout(120)  # the calls sleep an hour: only the call timeout (1 s) ends the wait
def test_timed_out_call_does_not_block_the_next_call(make_manager):
    config = WorkerConfig("slow", world_size=2, call_timeout_s=1.0)
    with Cluster(Sleeper, config, make_manager("ray")) as cluster:
        assert cluster.count_call() == [1, 1]
        unfinished = cluster.sleep(3600)
        with pytest.raises(CallTimeoutError, match=r"slow\[rank 0\]\.sleep_blocking.*processes were stopped"):
            cluster.sleep_blocking(3600)
        # Nothing waits behind the stuck call: a result still pending on the stopped processes, and a new call,
        # fail at once and say why (waiting, the first would time out itself: CallTimeoutError).
        with pytest.raises(ClusterStoppedError, match=r"slow\[rank 0\]\.sleep: the result is lost"):
            unfinished.get()
        with pytest.raises(ClusterStoppedError, match=r"cannot run count_call\(\).*after slow\[rank 0\]\.sleep_blocking timed out"):
            cluster.count_call()

        cluster.restart()
        assert cluster.count_call() == [1, 1]  # fresh workers: their state was rebuilt by the constructor
        with pytest.raises(WorkerError) as info:
            cluster.divide(1)
        assert (info.value.rank, info.value.method) == (0, "divide")
        assert "ZeroDivisionError" in str(info.value)


@pytest.mark.ray
def test_a_call_issued_while_an_own_thread_method_waits_runs_at_once(make_manager):
    # The waiting method returns True only if `signal`, issued after it, ran while it waited: in the worker's call
    # thread it would have queued behind the wait until the timeout (False).
    with Cluster(Sleeper, WorkerConfig("poller", world_size=1), make_manager("ray")) as cluster:
        waiting = cluster.wait_for_signal(60.0)
        cluster.signal()
        assert waiting.get() is True
        assert cluster.count_call() == [1]


def test_restart_rebuilds_every_colocated_role_and_shutdown_is_final(make_manager):
    # On Ray, the frozen and timeout tests above restart; here the contract, on the in-process backend.
    views = create_colocated_clusters({"a": Sleeper, "b": Sleeper}, WorkerConfig("pair", world_size=2),
                                      make_manager("local"))
    try:
        assert views["a"].count_call() == [1, 1] and views["b"].count_call() == [1, 1]
        assert views["a"].count_call() == [2, 2]
        views["b"].restart()  # the processes are shared: both roles are built again
        assert views["a"].count_call() == [1, 1] and views["b"].count_call() == [1, 1]
    finally:
        views["a"].shutdown()
    with pytest.raises(ClusterStoppedError, match=r"'b' cannot run count_call\(\).*by shutdown\(\)"):
        views["b"].count_call()
    with pytest.raises(ClusterStoppedError, match="was shut down and cannot restart"):
        views["a"].restart()


def test_blocking_dataproto_method_returning_a_dict_names_cluster_and_method(make_manager, backend):
    data = DataProto.from_dict({"x": torch.arange(4.0).reshape(4, 1)})  # [4, 1]
    with Cluster(Sleeper, WorkerConfig("stats", world_size=2), make_manager(backend)) as cluster:
        with pytest.raises(TypeError) as info:
            cluster.stats(data)
        message = str(info.value)
        assert "cluster 'stats' rank 0: Sleeper.stats is registered with a DataProto dispatch mode" in message
        assert "returned a dict with keys ['loss']" in message
        assert "Dispatch.DP_COMPUTE_METRIC" in message


@pytest.mark.ray
def test_worker_error_from_ray_has_no_colour_codes(make_manager):
    with Cluster(Sleeper, WorkerConfig("plain", world_size=2), make_manager("ray")) as cluster:
        with pytest.raises(WorkerError) as info:
            cluster.divide(1)
    assert "ray::" in str(info.value)  # Ray's own header, which it colours for terminals
    assert "\x1b" not in str(info.value) and "\x1b" not in info.value.remote_traceback


def test_colour_codes_are_stripped_from_every_worker_error():
    error = WorkerError("c", 0, "m", "\x1b[36mray::WorkerHost.call()\x1b[39m (pid=1)\n\x1b[1;31mValueError\x1b[0m: no")
    assert error.remote_traceback == "ray::WorkerHost.call() (pid=1)\nValueError: no"
    assert "\x1b" not in str(error)


def test_role_config_liveness_settings_load_from_yaml_and_reach_the_worker_config(tmp_path):
    defaults = RoleConfig().worker_config("actor")
    assert (defaults.call_timeout_s, defaults.heartbeat_timeout_s, defaults.health_check_interval_s) == (1800.0, 60.0, 2.0)
    assert defaults.env_vars == {}

    path = tmp_path / "actor.yaml"
    path.write_text("call_timeout_s: 600\nheartbeat_timeout_s: 20\nhealth_check_interval_s: 1\n"
                    "env_vars: {NCCL_DEBUG: INFO}\n")
    role = load_config(RoleConfig, path, ["heartbeat_timeout_s=30"])
    config = role.worker_config("actor")
    assert (config.call_timeout_s, config.heartbeat_timeout_s, config.health_check_interval_s) == (600.0, 30.0, 1.0)
    assert config.env_vars == {"NCCL_DEBUG": "INFO"}


@pytest.mark.parametrize("settings, message", [
    ({"heartbeat_timeout_s": 2.0, "health_check_interval_s": 2.0}, "heartbeat_timeout_s=2 must exceed health_check_interval_s=2"),
    ({"call_timeout_s": 0.0}, "call_timeout_s=0.0 must be > 0"),
    ({"health_check_interval_s": -1.0}, "0 turns the heartbeat off"),
])
def test_bad_liveness_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        WorkerConfig("actor", world_size=1, **settings)
