"""The single-controller executor on both backends: data by reference, parallel branches, failures."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from baton import Cluster
from baton.dag import DAGExecutionError, NodeOutput, NodeStatus, SingleControllerExecutor, Workflow, node_function
from baton.dag.compute import ComputeWorker
from baton.dag.executor import WorkflowContext, compute_slots
from baton.dag.turns import DeviceTurns
from baton.data import DataProto
from baton.distributed import DataProtoFuture, JoinedData, WorkerConfig, WorkerSpec
from baton.distributed.future import RenamedData

HERE = "test_dag_executor"  # tests/ is on the workers' PYTHONPATH (conftest)


@node_function(writes=["x", "uid"])
def load(ctx, batch):
    return NodeOutput(DataProto.from_dict({"x": torch.arange(8, dtype=torch.float32)}, {"uid": list(range(8))}))


@node_function(reads=["x"], writes=["double"])
def double(batch: DataProto, config: dict):
    return DataProto.from_dict({"double": batch.batch["x"] * 2})


@node_function(reads=["x"], writes=lambda config: [config["column"]])
def plus_one(batch: DataProto, config: dict):
    """Writes x + 1 into its column. With `meet` (a directory) in its config, it first says there that it started and
    waits (at most 60 s) until the node `other` says so too; the metric `<column>/met_other` is whether it did."""
    metrics = {}
    if "meet" in config:
        open(os.path.join(config["meet"], config["column"]), "w").close()
        other = os.path.join(config["meet"], config["other"])
        deadline = time.monotonic() + 60
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.01)
        metrics[f"{config['column']}/met_other"] = float(os.path.exists(other))
    return DataProto.from_dict({config["column"]: batch.batch["x"] + 1}), metrics


@node_function(reads=["a", "b", "double"])
def total(batch: DataProto, config: dict):
    return DataProto(), {"total": float((batch.batch["a"] + batch.batch["b"] + batch.batch["double"]).sum())}


@node_function(reads=["x"], writes=lambda config: [config["column"]])
def fails(batch: DataProto, config: dict):
    raise ValueError("the node's own bug")


@node_function(reads=["x"], writes=lambda config: [config["column"]])
def dies(batch: DataProto, config: dict):
    os.kill(os.getpid(), signal.SIGKILL)


_MADE: list[Cluster] = []


@pytest.fixture(autouse=True)
def shut_down_clusters(make_manager):
    """Every cluster a test made is stopped after it (the manager's shutdown frees their slots only)."""
    yield
    while _MADE:
        _MADE.pop().shutdown()


def compute_clusters(manager, n, **settings):
    clusters = [Cluster(WorkerSpec(ComputeWorker, ({},)), WorkerConfig(
        f"compute_{i}", world_size=1, num_devices_per_worker=0, num_cpus_per_worker=0.5, **settings), manager)
        for i in range(n)]
    _MADE.extend(clusters)
    return clusters


def branches(second=f"{HERE}:plus_one", meet: str | None = None):
    """load → {a, b} (two compute nodes at the same time) → total, with double beside them; with `meet` (a
    directory), a and b each wait there for the other to start."""
    a_meets, b_meets = ({"meet": meet, "other": "b"}, {"meet": meet, "other": "a"}) if meet else ({}, {})
    return (Workflow("branches").add_node("data", "data_load", executable=load)
            .add_node("double", "compute", dependencies=["data"], executable=f"{HERE}:double")
            .add_node("a", "compute", dependencies=["data"], executable=f"{HERE}:plus_one",
                      config={"column": "a", **a_meets})
            .add_node("b", "compute", dependencies=["data"], executable=second,
                      config={"column": "b", **b_meets})
            .add_node("total", "compute", dependencies=["a", "b", "double"], executable=f"{HERE}:total").build())


def test_compute_slots_give_parallel_nodes_different_workers():
    graph = branches()
    assert compute_slots(graph, 3) == {"double": 0, "a": 1, "b": 2, "total": 0}
    assert compute_slots(graph, 2) == {"double": 0, "a": 1, "b": 0, "total": 0}


def test_a_step_merges_the_branches_and_sets_every_status(make_manager, backend):
    manager = make_manager(backend, num_devices_per_node=1)
    graph = branches()
    executor = SingleControllerExecutor(graph, context=None, compute=compute_clusters(manager, 2),
                                        parallel=backend == "ray")
    metrics = executor.run_step(1)
    x = torch.arange(8, dtype=torch.float32)
    assert metrics["total"] == float((2 * (x + 1) + 2 * x).sum())
    assert {n.status for n in graph.nodes.values()} == {NodeStatus.COMPLETED}
    executor.run_step(2)  # statuses reset each step
    assert {n.status for n in graph.nodes.values()} == {NodeStatus.COMPLETED}


@pytest.mark.ray
def test_on_ray_the_driver_never_fetches_a_nodes_data(make_manager, monkeypatch):
    manager = make_manager("ray", num_devices_per_node=1)
    executor = SingleControllerExecutor(branches(), context=None, compute=compute_clusters(manager, 2))

    def refuse(self, timeout_s=None):
        raise AssertionError(f"the driver fetched {type(self).__name__} data")

    for cls in (DataProtoFuture, JoinedData, RenamedData):
        monkeypatch.setattr(cls, "get", refuse)  # in this (the driver's) process only; workers fetch as usual
    assert executor.run_step(1)["total"] == 128.0  # sum of 2 (x + 1) + 2 x over x = 0..7


@pytest.mark.ray
def test_parallel_branches_run_at_the_same_time_on_their_workers(make_manager, tmp_path):
    # Each branch waits for the other to start before it ends: run one after the other, the first waits in vain.
    manager = make_manager("ray", num_devices_per_node=1)
    executor = SingleControllerExecutor(branches(meet=str(tmp_path)), context=None,
                                        compute=compute_clusters(manager, 2))
    metrics = executor.run_step(1)
    assert metrics["a/met_other"] == metrics["b/met_other"] == 1.0
    assert metrics["total"] == 128.0


def test_a_failing_node_fails_its_dependants_and_names_node_rank_and_traceback(make_manager, backend):
    manager = make_manager(backend, num_devices_per_node=1)
    graph = branches(second=f"{HERE}:fails")
    executor = SingleControllerExecutor(graph, context=None, compute=compute_clusters(manager, 2),
                                        parallel=backend == "ray")
    with pytest.raises(DAGExecutionError) as caught:
        executor.run_step(3)
    status = {i: n.status for i, n in graph.nodes.items()}
    assert status == {"data": NodeStatus.COMPLETED, "double": NodeStatus.COMPLETED, "a": NodeStatus.COMPLETED,
                      "b": NodeStatus.FAILED, "total": NodeStatus.SKIPPED}
    message = str(caught.value)
    assert "workflow 'branches' step 3: 1 node(s) FAILED; skipped downstream: total" in message
    assert "node 'b': worker compute_0[rank 0] raised in run_node()" in message
    assert "the node's own bug" in message and ", in fails" in message  # the worker's traceback
    assert [f.node_id for f in caught.value.failures] == ["b"] and caught.value.skipped == ["total"]


@pytest.mark.ray
@pytest.mark.timeout(120)  # the node timeout is an hour: the death (a died or froze error below) ends the step
def test_a_killed_worker_fails_the_step_within_seconds(make_manager):
    manager = make_manager("ray", num_devices_per_node=1)
    clusters = compute_clusters(manager, 2, health_check_interval_s=0.5, heartbeat_timeout_s=5.0)
    graph = branches(second=f"{HERE}:dies")
    executor = SingleControllerExecutor(graph, context=None, compute=clusters)
    # Another node running on the same worker may be the call that sees the death first: then 'b' reads that the
    # cluster was stopped after it.
    with pytest.raises(DAGExecutionError, match=r"node 'b': (worker compute_0\[rank 0\] (died|froze) in run_node\(\)|"
                                                r"raised ClusterStoppedError: compute_0\[rank 0\]\.run_node: the result is "
                                                r"lost: .* stopped after compute_0\[rank 0\]\.run_node (died|froze))"):
        executor.run_step(1)
    assert graph.nodes["b"].status == NodeStatus.FAILED and graph.nodes["total"].status == NodeStatus.SKIPPED


def test_a_controller_node_that_returns_the_wrong_type_is_named(make_manager):
    def wrong(ctx, batch):
        return {"not": "a NodeOutput"}

    graph = (Workflow("w").add_node("data", "data_load", executable=load)
             .add_node("bad", "custom", dependencies=["data"], executable=wrong).build())
    executor = SingleControllerExecutor(graph, context=None, compute=[], parallel=False)
    with pytest.raises(DAGExecutionError, match="returned dict; a custom node's function returns a baton.dag.NodeOutput"):
        executor.run_step(1)


@node_function(roles=["rollout"])
def weight_sync(ctx, batch):
    """A controller node on the actor's role that computes on the rollout too (as the shipped weight sync)."""
    return busy(ctx, batch)


class Ran:
    """What the `busy` nodes of a step did: the order they started in, and which ran at the same time."""

    def __init__(self):
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        self.started: list[str] = []
        self.running: set[str] = set()
        self.beside: set[frozenset[str]] = set()  # pairs of nodes that ran at the same time
        self.events: dict[str, threading.Event] = {}

    def event(self, node_id: str) -> threading.Event:
        with self.lock:
            return self.events.setdefault(node_id, threading.Event())


RAN = Ran()


def busy(ctx, batch):
    """Notes in RAN when it runs. Its node's config: `meet` (node ids) waits until each has started, `beside` (node
    ids) until one of them runs (at most 60 s; an AssertionError if not); `sleep_s` holds it that long after."""
    me = ctx.node.node_id
    with RAN.lock:
        RAN.beside.update(frozenset((me, other)) for other in RAN.running)
        RAN.running.add(me)
        RAN.started.append(me)
    RAN.event(me).set()
    try:
        for other in ctx.config.get("meet", []):
            assert RAN.event(other).wait(60), f"{me} waited in vain for {other} to start"
        beside = ctx.config.get("beside", [])
        deadline = time.monotonic() + 60
        while beside and not RAN.running & set(beside):
            assert time.monotonic() < deadline, f"{me} waited in vain for one of {beside} to run"
            time.sleep(0.01)
        time.sleep(ctx.config.get("sleep_s", 0.0))
    finally:
        with RAN.lock:
            RAN.running.discard(me)
    return NodeOutput()


def test_nodes_of_roles_taking_turns_on_shared_devices_never_run_beside_another_turns():
    """Two branches run at the same time on threads: the rollout's node waits for the actor's turn (actor and
    reference, whose nodes run together) to end, or the other way round; the reward, which takes no turns, runs beside
    either; each hold hands the devices over once, the weight sync holding actor and rollout alone."""
    handed: list[tuple[str, ...]] = []
    turns = DeviceTurns([["rollout"], ["actor", "reference"]], lambda *roles: handed.append(roles))
    context = WorkflowContext({}, None, None, None, None, turns=turns)
    # The turn's two nodes each wait for the other to start; the reward waits for one of the turns to run; the
    # nodes stay 0.5 s after, time for a node of the other turn to start beside them were the turns not kept.
    slow = {"sleep_s": 0.5}
    graph = (Workflow("turns").add_node("data", "data_load", executable=load)
             .add_node("generate", "model_inference", role="rollout", dependencies=["data"], executable=busy,
                       config=slow)
             .add_node("log_probs", "model_inference", role="actor", dependencies=["data"], executable=busy,
                       config={**slow, "meet": ["ref_log_probs"]})
             .add_node("ref_log_probs", "model_inference", role="reference", dependencies=["data"], executable=busy,
                       config={**slow, "meet": ["log_probs"]})
             .add_node("score", "model_inference", role="reward", dependencies=["data"], executable=busy,
                       config={"beside": ["generate", "log_probs"]})
             .add_node("sync", "custom", role="actor", dependencies=["generate", "log_probs", "ref_log_probs", "score"],
                       executable=weight_sync).build())
    RAN.clear()
    SingleControllerExecutor(graph, context, compute=[], parallel=True).run_step(1)

    def beside(a: str, b: str) -> bool:
        return frozenset((a, b)) in RAN.beside

    assert not beside("generate", "log_probs") and not beside("generate", "ref_log_probs")
    assert beside("log_probs", "ref_log_probs")  # one turn: together
    assert beside("score", "generate") or beside("score", "log_probs")
    assert not beside("sync", "score") and RAN.started[-1] == "sync"
    first, second = (("rollout",), ("actor", "reference")) \
        if RAN.started.index("generate") < RAN.started.index("log_probs") else (("actor", "reference"), ("rollout",))
    assert handed == [first, second, ("rollout", "actor")]
