"""RLVR as a workflow graph (siiRL's model): each step runs a DAG of typed nodes instead of a fixed loop.

`DAGPipeline` builds the clusters `RLVRPipeline` builds (actor, rollout, reward, reference, critic) plus the
`ComputeWorker`s its COMPUTE nodes run on, loads the workflow (`workflow:` inline in siiRL's schema, a path to
a YAML file of it, or none: GRPO, or PPO with a critic) and runs one pass over the graph per step. With the
shipped nodes (`baton.dag.nodes`) it computes what `RLVRPipeline.run()` computes, so the same seed and config
give the same metrics; a workflow can add, remove and branch nodes.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from baton.algorithms import estimator_needs
from baton.config.loader import ConfigError
from baton.dag.compute import ComputeWorker
from baton.dag.executor import SingleControllerExecutor, WorkflowContext
from baton.dag.graph import TaskGraph, Workflow, WorkflowError
from baton.dag.loader import load_workflow
from baton.dag.multi import DAGWorker, MultiControllerExecutor
from baton.dag.turns import DeviceTurns
from baton.pipelines.config import RLVRConfig, WorkerSettings
from baton.pipelines.rlvr import RLVRPipeline

NODES = "baton.dag.nodes"
EXECUTORS = ("single_controller", "multi_controller")
MULTI_CONTROLLER_KEEPS_ROLES = (
    "trainer.offload_idle_roles=true is ignored under dag.executor multi_controller: every role of a rank lives in "
    "its DAG worker's process, which walks the whole step itself, so the driver hands no devices between roles (the "
    "actor and rollout share tensors there, as colocated in the loop; the reference and critic stay on the devices). "
    "Use dag.executor single_controller for roles that take turns")


@dataclass
class DAGSettings:
    """How the workflow runs.

    executor: "single_controller" (the driver walks the graph; data passed by reference) or "multi_controller"
        (one DAG worker per actor slot walks it on its own rows, every subgraph of a graph that splits colocated on
        those slots; see `baton.dag.multi`).
    num_compute_workers: processes for COMPUTE nodes; compute nodes that may run at the same time go to
        different ones (up to this many).
    compute: those workers' CPUs and limits.
    node_timeout_s: the longest one node may run before the step fails naming it.
    """

    executor: str = "single_controller"
    num_compute_workers: int = 1
    compute: WorkerSettings = field(default_factory=lambda: WorkerSettings(num_devices_per_worker=0,
                                                                           num_cpus_per_worker=0.25))
    node_timeout_s: float = 3600.0


@dataclass
class DAGConfig(RLVRConfig):
    """`RLVRConfig` with a workflow graph. workflow: siiRL's schema (dag_id, nodes: node_id, node_type, node_role,
    dependencies, executable_ref, config) inline, or a path to a YAML file of it; None: the RLVR loop as a graph
    (`rlvr_workflow`)."""

    pipeline_cls: str = "baton.pipelines.dag:DAGPipeline"
    workflow: dict[str, Any] | str | None = None
    dag: DAGSettings = field(default_factory=DAGSettings)

    def updates_per_step(self) -> int | None:
        """The loop's, for the default workflow; None for a custom one, whose update nodes the config does not count."""
        return super().updates_per_step() if self.workflow is None else None

    def check(self) -> None:
        super().check()
        if self.dag.executor not in EXECUTORS:
            raise ConfigError(f"dag.executor {self.dag.executor!r} is not one of {', '.join(EXECUTORS)}")
        if self.dag.executor == "multi_controller" and not self.colocate_actor_rollout:
            raise ConfigError("dag.executor multi_controller runs every role of a rank in its DAG worker's process; "
                              "set colocate_actor_rollout: true")
        if self.actor.strategy.lora is not None and (self.dag.executor == "multi_controller" or (
                self.reference is None and self.needs_reference)):
            raise ConfigError("actor.strategy.lora in a workflow: its reference (the actor with the adapter off) and "
                              "the multi-controller's weight sync do not take a LoRA actor; run it on the loop "
                              "(pipeline_cls: baton.pipelines.rlvr:RLVRPipeline), or give a `reference:` section")
        if self.dag.num_compute_workers < 1:
            raise ConfigError(f"dag.num_compute_workers={self.dag.num_compute_workers} must be >= 1")
        if self.dag.executor == "multi_controller" and self.trainer.offload_idle_roles is True:
            warnings.warn(MULTI_CONTROLLER_KEEPS_ROLES, stacklevel=2)
        try:
            self.graph()  # every workflow error before any worker starts
        except (WorkflowError, FileNotFoundError) as error:
            raise ConfigError(f"workflow: {error}") from error

    def graph(self) -> TaskGraph:
        if self.workflow is None:
            return rlvr_workflow(has_reference=self.needs_reference,
                                 has_critic=self.critic is not None and estimator_needs(self.algorithm.adv_estimator).critic,
                                 has_reward_model=self.reward_model is not None,
                                 has_baseline=estimator_needs(self.algorithm.adv_estimator).baseline_rollout)
        if isinstance(self.workflow, str):
            from baton.config.paths import find_file

            return load_workflow(find_file(self.workflow))  # from the working directory, else the config's
        return load_workflow(self.workflow)


def rlvr_workflow(has_reference: bool = False, has_critic: bool = False, has_reward_model: bool = False,
                  has_baseline: bool = False) -> TaskGraph:
    """`RLVRPipeline.run()`'s step as a graph: data → rollout (and ReMax's greedy baseline beside it) → reward (→
    reward model → its scores added) → {old log-probs, ref log-probs, values} → advantage → (critic update) → actor
    update → weight sync; the batch metrics after the actor's update, beside the weight sync (beside the update,
    their fetch and reduction of the batch slowed it on 2 cores)."""
    flow = Workflow("grpo" if not has_critic else "ppo")
    flow.add_node("data", "data_load", executable=f"{NODES}:load_prompts")
    flow.add_node("rollout", "model_inference", role="rollout", dependencies=["data"], executable=f"{NODES}:generate")
    flow.add_node("reward", "model_inference", role="reward", dependencies=["rollout"],
                  executable=f"{NODES}:compute_reward")
    rewarded = "reward"
    if has_reward_model:
        flow.add_node("reward_model", "model_inference", role="reward", dependencies=["reward"],
                      executable=f"{NODES}:reward_model_scores")
        flow.add_node("reward_sum", "compute", role="advantage", dependencies=["reward_model"],
                      executable=f"{NODES}:add_reward_model_scores")
        rewarded = "reward_sum"
    # The forward passes are independent: they run at the same time where the models are on other workers.
    flow.add_node("old_log_prob", "model_inference", role="actor", dependencies=[rewarded],
                  executable=f"{NODES}:old_log_probs", only_forward_compute=True)
    last = ["old_log_prob"]
    if has_reference:
        flow.add_node("ref_log_prob", "model_inference", role="reference", dependencies=[rewarded],
                      executable=f"{NODES}:ref_log_probs")
        last.append("ref_log_prob")
    if has_critic:
        flow.add_node("values", "model_inference", role="critic", dependencies=[rewarded],
                      executable=f"{NODES}:critic_values")
        last.append("values")
    if has_baseline:
        flow.add_node("baseline", "model_inference", role="rollout", dependencies=["data"],
                      executable=f"{NODES}:greedy_baseline")
        last.append("baseline")
    flow.add_node("advantage", "compute", role="advantage", dependencies=last, executable=f"{NODES}:compute_advantage")
    train_after = ["advantage"]
    if has_critic:
        flow.add_node("critic_train", "model_train", role="critic", dependencies=["advantage"],
                      executable=f"{NODES}:train_critic")
        train_after = ["critic_train"]
    flow.add_node("actor_train", "model_train", role="actor", dependencies=train_after, executable=f"{NODES}:train_actor")
    flow.add_node("sync", "custom", role="actor", dependencies=["actor_train"], executable=f"{NODES}:sync_weights")
    flow.add_node("metrics", "compute", dependencies=["advantage", "actor_train"],
                  executable=f"{NODES}:rollout_metrics")
    return flow.build()


class DAGPipeline(RLVRPipeline):
    config_cls = DAGConfig

    def extra_roles(self, config: DAGConfig) -> dict:
        """The graph's workers: a DAG worker fused into every actor slot (multi-controller), or the compute
        workers (single controller). Loads the graph here: RLVRPipeline builds the clusters after checking the
        config, and the DAG workers are built with the graph."""
        self.graph = config.graph()
        for node in self.graph.nodes.values():
            if node.executable == f"{NODES}:add_reward_model_scores":
                node.config.setdefault("reward_model_weight", config.reward_model_settings.weight)
        if config.dag.executor == "multi_controller":
            return {"dag": (DAGWorker, config.actor, (self.graph, config))}
        settings = ({"algorithm": config.algorithm, "reward_fn": config.reward_fn,
                     "tokenizer": config.actor.strategy.tokenizer},)  # and each step the algorithm itself (`rl`)
        return {f"compute_{i}": (ComputeWorker, config.dag.compute, settings)
                for i in range(config.dag.num_compute_workers)}

    def fused_roles(self, config: DAGConfig, roles: dict) -> dict | None:
        if config.dag.executor == "multi_controller":  # every role of a rank in its DAG worker's process
            return {"policy": ["actor", "rollout", *(r for r in roles if r not in ("actor", "rollout", "dag")), "dag"]}
        return super().fused_roles(config, roles)

    def share_devices(self, turns, never_offloaded=()) -> None:
        """As the loop's, but under the multi-controller no role takes turns (`MULTI_CONTROLLER_KEEPS_ROLES`)."""
        if self.config.dag.executor != "multi_controller":
            super().share_devices(turns, never_offloaded)

    def __init__(self, config: DAGConfig):
        super().__init__(config)
        self._check_needs()
        if config.dag.executor == "multi_controller":
            self.executor = MultiControllerExecutor(self.graph, self.clusters["dag"], self.sampler,
                                                    config.trainer.num_prompts_per_step, self.algorithm)
        else:
            compute = [self.clusters[f"compute_{i}"] for i in range(config.dag.num_compute_workers)]
            roles = {name: self.clusters.get(name) for name in
                     ("actor", "rollout", "reward", "reference", "critic", "reward_model")}
            context = WorkflowContext(
                roles, self.algorithm, config.sampling.params(), self.next_prompts, lambda: self.update_pairs[0].sync(),
                sync_every_steps=config.trainer.sync_every_steps, baseline_sampling=self.baseline_sampling,
                reward_model_weight=config.reward_model_settings.weight, timer=self.timer,
                turns=DeviceTurns(self.time_sharing.turns, self.on_device) if self.time_sharing.resident else None)
            self.executor = SingleControllerExecutor(self.graph, context, compute,
                                                     parallel=self.manager.backend != "local",
                                                     node_timeout_s=config.dag.node_timeout_s)

    def _check_needs(self) -> None:
        """The columns the configured algorithm trains on are written by some node of the workflow."""
        written = {c for node in self.graph.nodes.values() for c in node.columns()[1]}
        needs = {"old_log_probs": self.algorithm.needs_old_log_probs, "ref_log_probs": self.reference is not None,
                 "values": self.critic is not None, "rm_scores": self.reward_model is not None}
        for column, needed in needs.items():
            if needed and column not in written:
                raise ConfigError(f"workflow {self.graph.graph_id!r}: the config's algorithm needs {column!r} and no "
                                  f"node writes it; add the node (e.g. {NODES}:{_WRITER[column]})")

    def run(self) -> dict:
        tracker = self.make_tracker()
        start = time.perf_counter()
        first_val = self.first_validation()
        metrics: dict[str, float] = {}
        for step in self.training_steps(self.graph.graph_id):
            with self.timer("step"):
                node_metrics = self.executor.run_step(step)
            metrics = {**node_metrics, **self.node_timings(), **self.timings}
            if "actor/reward_kl_penalty" in metrics:  # the adaptive KL controller moves by the step's observed KL
                num_rows = self.config.trainer.num_prompts_per_step * self.config.sampling.num_samples_per_prompt
                self.algorithm.observe_kl(metrics, num_rows)
            self.algorithm.watch(step, metrics)
            self.end_step(step, metrics, "reward", "critic/score/mean")
        tracker.close()
        return self.finish(self.summary(start, first_val, metrics, final_reward=metrics.get("critic/score/mean")))

    def node_timings(self) -> dict[str, float]:
        """`timing_s/node/<id>`: each node's run time in the last step (issue to completion; multi-controller: the
        slowest rank's)."""
        return {f"timing_s/node/{node_id}": seconds for node_id, seconds in self.executor.times_s.items()}


_WRITER = {"old_log_probs": "old_log_probs", "ref_log_probs": "ref_log_probs", "values": "critic_values",
           "rm_scores": "reward_model_scores"}
