"""The single-controller executor: the driver walks a workflow graph each step, with data passed by reference.

A node runs once every dependency has COMPLETED (READY → RUNNING → COMPLETED). Its input is its dependencies'
outputs joined (`JoinedData`: references to the shards where the workers keep them); a model node issues its
cluster call without waiting for data (`Cluster.call_async`) and is COMPLETED when the call has finished, which the
driver learns from the row counts alone. COMPUTE nodes run on a `ComputeWorker`. Independent branches run at
the same time (each ready node in a thread of its own) on the Ray backend; on the local backend, where every
worker shares the driver's process, nodes run one at a time in topological order, so a step is deterministic.
Where roles take turns on shared devices (`WorkflowContext.turns`), a node runs once its roles hold their devices,
and never beside a node of another turn.

A node that raises is FAILED, every node downstream of it SKIPPED, the branches already running finish, and
the step raises `DAGExecutionError` naming the node, the rank and the traceback.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from baton.dag.graph import Node, NodeStatus, NodeType, TaskGraph, WorkflowError
from baton.dag.turns import DeviceTurns
from baton.data import DataProto
from baton.distributed import CallFuture, DataProtoFuture, JoinedData, WorkerError
from baton.distributed.backend import Source
from baton.distributed.future import RenamedData
from baton.rl import RLAlgorithm
from baton.strategy import SamplingParams

Data = DataProto | DataProtoFuture | JoinedData


@dataclass
class NodeOutput:
    """What a controller-side node function returns.

    data: the columns it adds (joined to its input for the nodes downstream), or, for an executable declared
        with `node_function(output="replace")` or "filter", the whole batch they receive; None adds nothing.
    metrics: name → number for the step's metrics.
    """

    data: Data | None = None
    metrics: dict[str, float] = field(default_factory=dict)


def _untimed(name: str):
    return contextlib.nullcontext()


@dataclass
class WorkflowContext:
    """What a workflow's nodes compute with, given by whoever runs the workflow (`DAGPipeline` on the driver, a
    `DAGWorker` on each rank).

    roles: role name → handle: a `Cluster` on the driver, a rank's own worker on a DAG worker; either takes
        `call_async(method, *args)`, and a training role `train_step(batch, loss_fn, loss_unit)`.
    algorithm: the run's `RLAlgorithm` (losses, estimator, KL control): the one the loop and the rollout system use.
    sampling: the rollout's sampling parameters; baseline_sampling: ReMax's greedy ones (None: not needed).
    next_prompts: the step's prompts (the driver's seeded sampler; on a DAG worker, its rank's rows of them).
    sync_weights: the actor's weights into the rollout; every `sync_every_steps` steps.
    reward_model_weight: the weight of the reward model's score in the reward (`reward_model_settings.weight`).
    timer: `timer(name)` times a phase into `timing_s/<name>`.
    turns: the roles that take turns on shared devices (`trainer.offload_idle_roles`), given their devices before
        each node computes on them; None where no role takes turns.
    """

    roles: dict[str, Any]
    algorithm: RLAlgorithm
    sampling: SamplingParams
    next_prompts: Callable[[], Any]
    sync_weights: Callable[[], None]
    sync_every_steps: int = 1
    baseline_sampling: SamplingParams | None = None
    reward_model_weight: float = 1.0
    timer: Callable[[str], Any] = _untimed
    turns: DeviceTurns | None = None

    def on_devices(self, node: Node):
        """Held while `node` runs: its roles on their devices (see `DeviceTurns.hold`)."""
        return self.turns.hold(node.roles()) if self.turns is not None else contextlib.nullcontext()

    def compute_settings(self) -> dict[str, Any]:
        """What every COMPUTE node's config gets this step besides its own: `rl`, the algorithm as it is now (its
        KL coefficient moves)."""
        return {"rl": self.algorithm}


@dataclass
class NodeContext:
    """What a controller-side node function gets besides its input: the node, the step, and the workflow's context
    (`workflow`: the roles, the algorithm, sampling, prompts, weight sync, timers)."""

    node: Node
    step: int
    workflow: WorkflowContext | None

    @property
    def config(self) -> dict:
        return self.node.config

    @property
    def algorithm(self) -> RLAlgorithm:
        return self.workflow.algorithm

    def role(self, name: str, why: str = ""):
        """The handle of role `name`; a WorkflowError naming the node (and `why` it needs the role) if the run has
        none."""
        handle = self.workflow.roles.get(name) if self.workflow is not None else None
        if handle is None:
            raise WorkflowError(f"{self.node.where} needs the {name!r} role and this run has none{why}; "
                                "add it to the config, or remove the node")
        return handle

    def has_role(self, name: str) -> bool:
        return self.workflow is not None and self.workflow.roles.get(name) is not None


@dataclass
class NodeFailure:
    node_id: str
    error: str  # what went wrong, with the rank where a worker raised
    traceback: str


class DAGExecutionError(RuntimeError):
    """A step of a workflow failed: `failures` names each FAILED node; `skipped` the nodes that did not run."""

    def __init__(self, graph_id: str, step: int, failures: list[NodeFailure], skipped: list[str]):
        self.failures, self.skipped = failures, skipped
        lines = [f"workflow {graph_id!r} step {step}: {len(failures)} node(s) FAILED"
                 + (f"; skipped downstream: {', '.join(skipped)}" if skipped else "")]
        for failure in failures:
            lines.append(f"node {failure.node_id!r}: {failure.error}\n{failure.traceback.rstrip()}")
        super().__init__("\n".join(lines))


class SingleControllerExecutor:
    """Runs `graph` one step at a time with `context` (see `WorkflowContext`; None for a graph of plain nodes).

    compute: the `ComputeWorker` clusters; a COMPUTE node runs on `compute[i]`, i from `compute_slots` (nodes
        that may run at the same time get different workers).
    parallel: run independent ready nodes at the same time (threads); False runs them one at a time, in
        topological order (the local backend's setting).
    node_timeout_s: the longest a node may run; past it the step fails naming the node.
    """

    def __init__(self, graph: TaskGraph, context: WorkflowContext | None, compute: list | None = None, *,
                 parallel: bool = True, node_timeout_s: float = 3600.0):
        self.graph, self.context, self.compute = graph, context, list(compute or [])
        self.parallel, self.node_timeout_s = parallel, node_timeout_s
        self.compute_slots = compute_slots(graph, max(1, len(self.compute)))
        self.order = graph.topological_order()
        self.events: list[tuple[str, str, float]] = []  # (node_id, "start" | "end", time.monotonic())
        self._lock = threading.Lock()

    @property
    def times_s(self) -> dict[str, float]:
        """Each node's run time in the last step (issue to completion), from `events`."""
        times: dict[str, float] = {}
        for node_id, kind, t in self.events:
            times[node_id] = times.get(node_id, 0.0) + (t if kind == "end" else -t)
        return times

    def run_step(self, step: int) -> dict[str, float]:
        """One pass over the graph; returns the nodes' metrics (in topological order of the nodes)."""
        self.graph.reset()
        self.events = []
        outputs: dict[str, tuple[Data | None, dict]] = {}
        failures: list[NodeFailure] = []
        if self.parallel:
            self._run_parallel(step, outputs, failures)
        else:
            for node_id in self.order:
                node = self.graph.nodes[node_id]
                if node.status == NodeStatus.SKIPPED:
                    continue
                node.set_status(NodeStatus.READY)
                self._finish(node_id, self._run_node(step, node_id, outputs), outputs, failures)
        if failures:
            skipped = [i for i in self.order if self.graph.nodes[i].status == NodeStatus.SKIPPED]
            raise DAGExecutionError(self.graph.graph_id, step, failures, skipped)
        metrics: dict[str, float] = {}
        for node_id in self.order:
            metrics.update(outputs[node_id][1])
        return metrics

    def _run_parallel(self, step: int, outputs: dict, failures: list) -> None:
        nodes = self.graph.nodes
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(nodes)), thread_name_prefix="dag") as pool:
            running: dict[concurrent.futures.Future, str] = {}

            def launch_ready() -> None:
                for node_id in self.order:
                    node = nodes[node_id]
                    if node.status == NodeStatus.PENDING and all(
                            nodes[d].status == NodeStatus.COMPLETED for d in node.dependencies):
                        node.set_status(NodeStatus.READY)
                        running[pool.submit(self._run_node, step, node_id, outputs)] = node_id

            launch_ready()
            while running:
                done, _ = concurrent.futures.wait(running, timeout=self.node_timeout_s,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
                if not done:
                    stuck = ", ".join(sorted(running.values()))
                    raise TimeoutError(f"workflow {self.graph.graph_id!r} step {step}: node(s) {stuck} ran longer than "
                                       f"node_timeout_s={self.node_timeout_s:g} s")
                for future in done:
                    self._finish(running.pop(future), future.result(), outputs, failures)
                launch_ready()

    def _run_node(self, step: int, node_id: str, outputs: dict):
        """(output data, metrics) or a NodeFailure. Runs in a pool thread when parallel."""
        node = self.graph.nodes[node_id]
        node.set_status(NodeStatus.RUNNING)
        with self._lock:
            self.events.append((node_id, "start", time.monotonic()))
        holding = self.context.on_devices(node) if self.context is not None else contextlib.nullcontext()
        try:
            with holding:
                inputs = JoinedData.of(*(outputs[d][0] for d in node.dependencies))
                if node.node_type == NodeType.COMPUTE:
                    result = self._compute(node, inputs)
                elif node.node_type in (NodeType.BARRIER_SYNC, NodeType.PUT_TO_BUFFER, NodeType.GET_FROM_BUFFER):
                    # The driver holds every output by reference: its dependencies having completed is the barrier,
                    # and the data passes through as it is.
                    result = NodeOutput()
                else:
                    result = node.resolve()(NodeContext(node, step, self.context), inputs)
                    if result is None:
                        result = NodeOutput()
                    if not isinstance(result, NodeOutput):
                        raise TypeError(f"{node.executable} returned {type(result).__name__}; a {node.node_type} "
                                        "node's function returns a baton.dag.NodeOutput (or None)")
                settle(result.data, self.node_timeout_s)  # the roles keep their devices until their calls are done
            data = result.data if node.output_mode != "add" else JoinedData.of(inputs, result.data)
            return data, {k: float(v) for k, v in result.metrics.items()}
        except Exception as error:  # the node's failure, reported with its traceback; the others carry on
            if isinstance(error, WorkerError):  # the worker's own traceback says where
                return NodeFailure(node_id, f"worker {error.cluster}[rank {error.rank}] {error.what} in "
                                            f"{error.method}()", error.remote_traceback)
            return NodeFailure(node_id, f"raised {type(error).__name__}: {error}", traceback.format_exc())
        finally:
            with self._lock:
                self.events.append((node_id, "end", time.monotonic()))

    def _finish(self, node_id: str, result, outputs: dict, failures: list) -> None:
        node = self.graph.nodes[node_id]
        if isinstance(result, NodeFailure):
            node.set_status(NodeStatus.FAILED, result.error)
            failures.append(result)
            for below in self.graph.descendants(node_id):
                self.graph.nodes[below].set_status(NodeStatus.SKIPPED, f"upstream node {node_id!r} failed")
            return
        outputs[node_id] = result
        node.set_status(NodeStatus.COMPLETED)

    def _compute(self, node: Node, inputs: Data) -> NodeOutput:
        if not self.compute:
            raise RuntimeError(f"{node.where} is a compute node and this executor has no compute workers")
        if not isinstance(node.executable, str):
            raise TypeError(f"{node.where}: a compute node runs on a worker, so its executable must be an import "
                            f"path 'package.module:function', not {node.executable!r}")
        cluster = self.compute[self.compute_slots[node.node_id]]
        settings = self.context.compute_settings() if self.context is not None else {}
        handle, num_rows, metrics = cluster.run_node(node.node_id, node.executable, inputs, {**settings, **node.config})
        data = handle if isinstance(handle, DataProto) else DataProtoFuture(
            [handle], "ray", row_ranges=[(0, num_rows)], sources=[Source(cluster.name, 0, "run_node")])
        return NodeOutput(data, metrics)


def settle(data: Data | None, timeout_s: float) -> None:
    """Wait until the calls that make `data` have finished, fetching only row counts (an error raises here)."""
    if isinstance(data, JoinedData):
        for part in data.parts:
            settle(part, timeout_s)
    elif isinstance(data, RenamedData):
        settle(data.source, timeout_s)
    elif isinstance(data, DataProtoFuture) and data.length_refs is not None:
        data.shard_lengths(timeout_s)
    elif isinstance(data, CallFuture):
        data.get(timeout_s)


def compute_slots(graph: TaskGraph, num_workers: int) -> dict[str, int]:
    """compute node → worker index: the lowest index no already-placed compute node that may run at the same time
    (neither upstream nor downstream of it) has, modulo `num_workers`."""
    slots: dict[str, int] = {}
    for node_id in graph.topological_order():
        if graph.nodes[node_id].node_type != NodeType.COMPUTE:
            continue
        related = graph.ancestors(node_id) | graph.descendants(node_id)
        taken = {slot for other, slot in slots.items() if other not in related}
        slots[node_id] = next(i for i in range(len(slots) + 1) if i not in taken) % num_workers
    return slots
