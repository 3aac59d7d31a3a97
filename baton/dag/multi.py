"""The multi-controller executor: one DAG worker per device slot walks the workflow itself (siiRL's DAG workers).

Each DAG worker process holds this rank of every model role (actor, rollout, reward, and reference and critic
where the config has them, fused into one process per slot) and runs every node of the graph on its own rows:
the step's prompts are cut by rank, a node's input is the local output of the nodes before it (the local cache:
producer and consumer have the same data-parallel layout), and the ranks meet only in the models' collectives
(the update's all-reduce, the weight gather of the sync). The driver sends each step the prompt indices (the
sampler, and with it exact resume, stays there), gets back per-rank metrics and statuses, and never holds a
batch: its memory does not grow with the batch.

After every node the ranks agree (an all-reduce of a failure flag) whether all of them completed it, so a node
that raises on one rank fails the step on every rank before any enters the next node's collectives; a rank whose
process dies is found by the cluster's health checks, which stop the others within seconds.

Every role is on every rank, so a graph that splits into subgraphs (`baton.dag.scheduler.split_subgraphs`:
branches with models of their own, such as PPO's critic and actor updates) runs colocated (`schedule(...,
colocate=True)`): the subgraphs take turns on the ranks, in the graph's topological order, and an edge between
two of them stays in the rank's local cache (one data-parallel layout). Subgraphs on disjoint workers, whose
edges need the data buffer (object references keyed by consumer node, rows re-cut for another layout), are not
built: the single-controller executor runs branches on their roles' own workers at the same time.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from typing import Any

import numpy as np

from baton.algorithms import estimator_needs
from baton.dag.executor import DAGExecutionError, NodeContext, NodeFailure, NodeOutput, WorkflowContext
from baton.dag.graph import NodeStatus, NodeType, TaskGraph
from baton.data import DataProto
from baton.distributed import Dispatch, JoinedData, Worker, register
from baton.rl import RLAlgorithm
from baton.strategy import SamplingParams
from baton.strategy.capabilities import can_share_weights

STATUS_RANK = {NodeStatus.FAILED: 3, NodeStatus.SKIPPED: 2, NodeStatus.PENDING: 1, NodeStatus.COMPLETED: 0}


class LocalRole:
    """Another role's worker in this process, called as the shipped nodes and the algorithm call a cluster."""

    def __init__(self, worker: Worker):
        self.worker = worker

    def call_async(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)

    def compute_log_probs(self, batch: DataProto) -> DataProto:
        return self.worker.compute_log_probs(batch)

    def compute_values(self, batch: DataProto) -> DataProto:
        return self.worker.compute_values(batch)

    def train_step(self, batch: DataProto, loss_fn, loss_unit: str = "token") -> list[dict]:
        return [self.worker.train_step(batch, loss_fn, loss_unit)]


class DAGWorker(Worker):
    """Runs `graph` on this rank's rows, a step per `run_step` call, with a `WorkflowContext` of its own: this rank's
    roles (as `LocalRole`s), an `RLAlgorithm` built from the config (its KL coefficient set by the driver each step),
    this rank's rows of the step's prompts and an in-process weight sync."""

    def __init__(self, graph: TaskGraph, config):
        from baton.datasets import collate_prompts
        from baton.datasets.load import load_datasets

        self.graph, self.config = graph, config
        self.train_data, _, self.tokenizer = load_datasets(config.data, config.actor.strategy.tokenizer)
        self.algorithm = RLAlgorithm(config.algorithm, config.reward_fn)  # the driver's, built from the same config
        self.settings = {"algorithm": config.algorithm, "reward_fn": config.reward_fn,
                         "tokenizer": config.actor.strategy.tokenizer}
        self._collate = collate_prompts
        self._prompts: tuple[list[int], int] = ([], 0)
        self._context: WorkflowContext | None = None

    def context(self) -> WorkflowContext:
        """Built on first use: the fused roles exist only once every worker of the process is constructed."""
        if self._context is None:
            roles = {}
            for name in ("actor", "rollout", "reward", "reference", "critic", "reward_model"):
                try:
                    roles[name] = LocalRole(self.colocated_worker(name))
                except ValueError:
                    pass  # not a role of this run
            config = self.config
            self._context = WorkflowContext(
                roles, self.algorithm, config.sampling.params(), self.next_prompts, self.sync_weights,
                sync_every_steps=config.trainer.sync_every_steps, baseline_sampling=baseline_sampling(config),
                reward_model_weight=config.reward_model_settings.weight)
        return self._context

    def next_prompts(self) -> DataProto:
        """This rank's rows of the step's prompts: the driver's indices collated as the single controller does,
        then cut as its dispatch would cut them."""
        indices, uid_offset = self._prompts
        prompts = self._collate(self.train_data, indices, self.tokenizer, self.config.data.max_prompt_len,
                                uid_offset=uid_offset, seed=self.config.trainer.seed,
                                num_samples=self.config.sampling.num_samples_per_prompt)
        return prompts.chunk(self.world_size)[self.rank]

    def sync_weights(self) -> None:
        """The actor's weights into this rank's rollout: shared tensors where both backends can share them in
        process (`Capabilities.shares_weights`: nothing is copied), else gathered parameter by parameter (every rank
        takes part) and loaded."""
        actor, rollout = self.colocated_worker("actor").strategy, self.colocated_worker("rollout").strategy
        if can_share_weights(self.config.actor.strategy.name, self.config.rollout.strategy.name):
            rollout.share_weights_from(actor)
            return
        full = {}
        for name, tensor in actor.hf_model.state_dict().items():
            full[name] = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu()
        rollout.import_weights([full])

    @register(Dispatch.ONE_TO_ALL)
    def run_step(self, step: int, prompt_indices: list[int], uid_offset: int,
                 algorithm_state: dict | None = None) -> dict[str, Any]:
        """One pass over the graph on this rank: {"metrics", "statuses" (node → status), "failure" (or None),
        "times_s" (node → seconds)}. algorithm_state: the driver's algorithm's (its KL coefficient)."""
        self._prompts = (list(prompt_indices), uid_offset)
        self.algorithm.load_state_dict(algorithm_state or {})
        self.graph.reset()
        outputs: dict[str, DataProto | None] = {}
        metrics: dict[str, float] = {}
        times: dict[str, float] = {}
        failure = None
        order = self.graph.topological_order()
        for index, node_id in enumerate(order):
            node = self.graph.nodes[node_id]
            node.set_status(NodeStatus.RUNNING)
            start = time.perf_counter()
            try:
                output, node_metrics = self._run_node(step, node, outputs)
            except Exception as error:  # reported to the driver with the rank; the peers stop with it
                failure = {"node_id": node_id, "rank": self.rank, "error": f"raised {type(error).__name__}: {error}",
                           "traceback": traceback.format_exc()}
            times[node_id] = time.perf_counter() - start
            if self._any_rank_failed(failure is not None):
                if failure is not None:
                    node.set_status(NodeStatus.FAILED, failure["error"])
                else:
                    node.set_status(NodeStatus.SKIPPED, "a peer rank failed this node")
                for later in order[index + 1:]:
                    self.graph.nodes[later].set_status(NodeStatus.SKIPPED, f"node {node_id!r} failed")
                break
            outputs[node_id] = output
            metrics.update(node_metrics)
            node.set_status(NodeStatus.COMPLETED)
        return {"metrics": metrics, "statuses": {i: n.status.value for i, n in self.graph.nodes.items()},
                "failure": failure, "times_s": times}

    def _run_node(self, step: int, node, outputs: dict) -> tuple[DataProto | None, dict[str, float]]:
        inputs = JoinedData.of(*(outputs[d] for d in node.dependencies))
        batch = inputs.get() if isinstance(inputs, JoinedData) else inputs
        if node.node_type == NodeType.COMPUTE:
            with self._whole_batch_statistics():  # e.g. PPO's advantages, whitened over the whole batch
                result = node.resolve()(batch, {**self.settings, **self.context().compute_settings(), **node.config})
            data, node_metrics = result if isinstance(result, tuple) else (result, {})
        elif node.node_type == NodeType.BARRIER_SYNC:
            self._barrier()
            data, node_metrics = None, {}
        elif node.node_type in (NodeType.PUT_TO_BUFFER, NodeType.GET_FROM_BUFFER):
            data, node_metrics = None, {}  # colocated: every node's input is already in this rank's cache
        else:
            result = node.resolve()(NodeContext(node, step, self.context()), batch) or NodeOutput()
            data, node_metrics = result.data, result.metrics
            if data is not None and not isinstance(data, DataProto):
                data = data.get()  # e.g. RenamedData over a local DataProto
        if node.output_mode == "add":
            data = JoinedData.of(batch, data)
            data = data.get() if isinstance(data, JoinedData) else data
        return data, {k: float(v) for k, v in (node_metrics or {}).items()}

    def _whole_batch_statistics(self):
        import torch.distributed as dist

        from baton.algorithms.utils import batch_statistics_over

        if self.world_size > 1 and dist.is_initialized():
            return batch_statistics_over()
        return contextlib.nullcontext()

    def _any_rank_failed(self, failed: bool) -> bool:
        import torch
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return failed
        flag = torch.tensor([float(failed)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _barrier(self) -> None:
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_initialized():
            dist.barrier()


class MultiControllerExecutor:
    """The driver's side: a step is one `run_step` call on every DAG worker; their metrics are combined
    (`combine_rank_metrics`), their statuses merged into `graph`'s, and a failure raised as DAGExecutionError
    naming node, rank and traceback."""

    def __init__(self, graph: TaskGraph, workers, sampler, num_prompts_per_step: int, algorithm: RLAlgorithm):
        self.graph, self.workers, self.sampler, self.algorithm = graph, workers, sampler, algorithm
        self.num_prompts_per_step = num_prompts_per_step
        self.times_s: dict[str, float] = {}

    def run_step(self, step: int) -> dict[str, float]:
        num_prompts = self.num_prompts_per_step
        indices = [int(i) for i in self.sampler.next_indices(num_prompts)]
        results = self.workers.run_step(step, indices, (step - 1) * num_prompts, self.algorithm.state_dict())
        for node_id, node in self.graph.nodes.items():
            worst = max((NodeStatus(r["statuses"][node_id]) for r in results), key=STATUS_RANK.__getitem__)
            node.set_status(worst)
        self.times_s = {node_id: max(r["times_s"].get(node_id, 0.0) for r in results) for node_id in self.graph.nodes}
        failures = [NodeFailure(r["failure"]["node_id"], f"rank {r['failure']['rank']} {r['failure']['error']}",
                                r["failure"]["traceback"]) for r in results if r["failure"]]
        if failures:
            skipped = [i for i, n in self.graph.nodes.items() if n.status == NodeStatus.SKIPPED]
            raise DAGExecutionError(self.graph.graph_id, step, failures, skipped)
        return combine_rank_metrics([r["metrics"] for r in results])


def combine_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """One value per metric from every rank's: the max of `…/max`, the min of `…/min`, the sum of counts
    (`num_…`, `total_…`, `…_groups`), else the mean (ranks hold equal shares of the rows)."""
    out = {}
    for key in dict.fromkeys(k for metrics in per_rank for k in metrics):
        values = [m[key] for m in per_rank if key in m]
        leaf = key.rsplit("/", 1)[-1]
        if leaf == "max":
            out[key] = max(values)
        elif leaf == "min":
            out[key] = min(values)
        elif leaf.startswith(("num_", "total_")) or leaf.endswith("_groups"):
            out[key] = float(sum(values))
        else:
            out[key] = float(np.mean(values))
    return out


def baseline_sampling(config) -> SamplingParams | None:
    """ReMax's greedy sampling (one response per prompt), where the estimator needs a baseline rollout."""
    if not estimator_needs(config.algorithm.adv_estimator).baseline_rollout:
        return None
    return SamplingParams(temperature=0.0, max_new_tokens=config.sampling.max_new_tokens, n=1)
