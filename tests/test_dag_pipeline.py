"""DAGPipeline: RLVR run as a workflow graph trains as RLVRPipeline does; its examples, checks and `baton dag plan`."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest
import yaml

from baton.cli import main as cli_main
from baton.cli import resolve
from baton.config import ConfigError
from baton.pipelines.base import run_pipeline as run
from baton.pipelines.config import AlgorithmConfig, DataConfig, RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.dag import DAGExecutionError, NodeStatus, node_function
from baton.dag.scheduler import split_subgraphs
from baton.distributed import WorkerDiedError
from baton.pipelines.dag import DAGConfig, DAGPipeline, DAGSettings
from baton.pipelines.rlvr import RLVRPipeline
from baton.strategy import StrategyConfig
from baton.tracking import run_metrics

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def tiny(cls, run_dir, backend="local", colocate=True, **fields):
    role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"))
    trainer = TrainerConfig(backend=backend, run_dir=str(run_dir), num_prompts_per_step=4, num_steps=3,
                            val_every_steps=3, save_every_steps=3, progress_bar=False)
    return cls(actor=role, rollout=role, colocate_actor_rollout=colocate,
               data=DataConfig(max_operand=9, num_val_examples=8),
               sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
               val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
               trainer=trainer, **fields)


PPO = dict(critic=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", kind="value")),
           algorithm=AlgorithmConfig(adv_estimator="gae", use_kl_loss=True, num_mini_batches_per_step=2))


@pytest.mark.parametrize("algorithm", ["grpo", "grpo_kl", "ppo"])
def test_the_workflow_gives_rlvr_pipelines_metrics_exactly_on_the_local_backend(tmp_path, algorithm):
    fields = {"grpo": {}, "grpo_kl": {"algorithm": AlgorithmConfig(adv_estimator="grpo", use_kl_loss=True)},
              "ppo": PPO}[algorithm]
    run(RLVRPipeline, tiny(RLVRConfig, tmp_path / "loop", **fields))
    run(DAGPipeline, tiny(DAGConfig, tmp_path / "dag", **fields))
    loop, dag = run_metrics(str(tmp_path / "loop")), run_metrics(str(tmp_path / "dag"))
    assert sorted(dag) == [0, 1, 2, 3]
    assert dag == loop  # every metric, bit for bit, at every step
    assert "actor/pg_loss" in dag[3] and "val/accuracy" in dag[3]
    if algorithm == "ppo":
        assert "critic/vf_loss" in dag[3] and "actor/kl" in dag[3]


@pytest.mark.ray
def test_on_ray_with_actor_and_rollout_apart_it_matches_the_loop(tmp_path, ray_cluster):
    # The loop in-process (the same workers' arithmetic) against the workflow on Ray, its roles in four processes.
    loop = run(RLVRPipeline, tiny(RLVRConfig, tmp_path / "loop", colocate=False))
    dag = run(DAGPipeline, tiny(DAGConfig, tmp_path / "dag", backend="ray", colocate=False))
    loop_steps, dag_steps = run_metrics(str(tmp_path / "loop")), run_metrics(str(tmp_path / "dag"))
    assert sorted(dag_steps) == sorted(loop_steps) == [0, 1, 2, 3]
    for step, a in loop_steps.items():
        b = dag_steps[step]
        assert a.keys() == b.keys(), step
        assert all(a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6) for k in a), step
    assert dag["final_val_accuracy"] == pytest.approx(loop["final_val_accuracy"])
    timings = run_metrics(str(tmp_path / "dag"), wall_clock=True)[3]
    assert timings["timing_s/node/rollout"] > 0 and timings["timing_s/node/actor_train"] > 0


def response_length(response: str, ground_truth: str, **fields) -> float:
    return float(len(response))


def test_the_two_reward_branches_merge_into_the_score(tmp_path):
    _, demo = resolve(os.path.join(EXAMPLES, "dag_branches.yaml"), [])
    workflow = json.loads(json.dumps(demo.rlvr.workflow))
    branches = {node["node_id"]: node for node in workflow["nodes"]}
    # The example's rewards (exact match, an integer format) both score 0 on the untrained model: the branches get
    # rewards that do not, so the sum shows each term.
    branches["correct"]["config"] = {"reward_fn": f"{__name__}:parity_reward", "column": "correct"}
    branches["integer"]["config"] = {"reward_fn": f"{__name__}:response_length", "column": "integer"}
    config = dataclasses.replace(tiny(DAGConfig, tmp_path), workflow=workflow, dag=demo.rlvr.dag)
    run(DAGPipeline, config)
    steps = run_metrics(str(tmp_path))
    for step in (1, 2, 3):
        record = steps[step]
        assert record["reward/correct/mean"] > 0 and record["reward/integer/mean"] > 0, step
        assert record["critic/score/mean"] == pytest.approx(0.9 * record["reward/correct/mean"]
                                                            + 0.1 * record["reward/integer/mean"], abs=1e-6), step


SCORED: list[tuple[str, str, float]] = []  # (ground truth, response, score) of every row parity_reward scored


def parity_reward(response: str, ground_truth: str, **fields) -> float:
    """The parity of the response's character codes: the two samples of a prompt often differ, often not."""
    score = float(sum(map(ord, response)) % 2)
    SCORED.append((ground_truth, response, score))
    return score


def test_dynamic_sampling_keeps_the_groups_whose_rewards_differ(tmp_path):
    _, demo = resolve(os.path.join(EXAMPLES, "dag_dapo.yaml"), [])
    config = dataclasses.replace(tiny(DAGConfig, tmp_path), workflow=demo.rlvr.workflow,
                                 reward_fn=f"{__name__}:parity_reward")
    config.trainer.val_before_train, config.trainer.val_every_steps = False, 100  # validation only after the last step
    SCORED.clear()
    run(DAGPipeline, config)
    steps = run_metrics(str(tmp_path))
    assert sorted(steps) == [1, 2, 3] and len(SCORED) == 3 * 8 + 8  # 4 prompts × 2 a step, 8 to validate
    for step, record in steps.items():
        rows = SCORED[(step - 1) * 8:step * 8]
        groups = [rows[i:i + 2] for i in range(0, 8, 2)]  # a prompt's samples are adjacent rows
        assert all(a[0] == b[0] for a, b in groups)
        kept = [[a[2], b[2]] for a, b in groups if a[2] != b[2]]
        assert record["dynamic_sampling/kept_groups"] == len(kept), step
        assert record["dynamic_sampling/dropped_groups"] == 4 - len(kept), step
        assert record["dynamic_sampling/kept_all_for_lack"] == float(not kept), step
        if kept:  # the batch downstream holds the kept groups' rows only: each scores one 0 and one 1
            assert record["critic/frac_reward_zero_std"] == 0.0 and record["critic/score/mean"] == 0.5
    counts = [steps[s]["dynamic_sampling/kept_groups"] for s in steps]
    assert any(0 < n < 4 for n in counts), counts  # this seed's steps keep some groups and drop others


def test_a_workflow_missing_what_the_algorithm_needs_is_refused_before_training(tmp_path):
    _, demo = resolve(os.path.join(EXAMPLES, "dag_grpo.yaml"), [])
    config = tiny(DAGConfig, tmp_path, workflow=demo.rlvr.workflow,
                  algorithm=AlgorithmConfig(adv_estimator="grpo", use_kl_loss=True))
    with pytest.raises(ConfigError, match="needs 'ref_log_probs' and no node writes it; add the node "
                                          r"\(e.g. baton.dag.nodes:ref_log_probs\)"):
        DAGPipeline(config)


def test_workflow_errors_are_config_errors_before_any_worker_starts(tmp_path):
    with pytest.raises(ConfigError, match="workflow: .*missing.yaml does not exist"):
        tiny(DAGConfig, tmp_path, workflow=str(tmp_path / "missing.yaml")).check()
    bad = {"dag_id": "bad", "nodes": [{"node_id": "data", "node_type": "data_load",
                                       "executable_ref": "baton.dag.nodes:load_prompts"},
                                      {"node_id": "train", "node_type": "model_train", "node_role": "rollout",
                                       "dependencies": ["data"], "executable_ref": "baton.dag.nodes:train_actor"}]}
    with pytest.raises(ConfigError, match="workflow: node 'train' .*cannot have role rollout"):
        tiny(DAGConfig, tmp_path, workflow=bad).check()


def test_a_workflow_file_beside_the_config_is_found(tmp_path, monkeypatch):
    _, demo = resolve(os.path.join(EXAMPLES, "dag_grpo.yaml"), [])
    (tmp_path / "flow.yaml").write_text(yaml.safe_dump(demo.rlvr.workflow))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({"pipeline_cls": "baton.pipelines.dag:DAGPipeline",
                                                       "workflow": "flow.yaml"}))
    monkeypatch.chdir(os.path.dirname(EXAMPLES))  # not the config's directory
    _, config = resolve(str(tmp_path / "run.yaml"), [])
    assert config.graph().graph_id == "grpo"


def test_dag_plan_prints_the_table_and_draws_the_graph(tmp_path, capsys):
    png = tmp_path / "ppo.png"
    assert cli_main(["dag", "plan", os.path.join(EXAMPLES, "dag_ppo.yaml"), "--nodes", "2", "--slots-per-node", "4",
                     "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "sg1      | 4-6   | 1             | critic_train" in out  # the two updates on disjoint workers
    assert "actor_train -> metrics -> sync" in out and "(values, critic_train)" not in out
    assert png.read_bytes().startswith(b"\x89PNG")
    assert cli_main(["dag", "plan", os.path.join(EXAMPLES, "dag_ppo.yaml"), "--png", str(png)]) == 2  # not overwritten
    assert "exists" in capsys.readouterr().err


# --- the multi-controller executor ----------------------------------------------------------------------------

MULTI = DAGSettings(executor="multi_controller")


def fsdp2_pair(cls, run_dir, **fields):
    """Actor (fsdp2) and rollout (hf) colocated on two slots: two DAG workers (multi-controller)."""
    config = tiny(cls, run_dir, backend="ray", **fields)
    actor = dataclasses.replace(config.actor, world_size=2, strategy=dataclasses.replace(config.actor.strategy,
                                                                                         name="fsdp2"))
    rollout = dataclasses.replace(config.rollout, world_size=2)
    return dataclasses.replace(config, actor=actor, rollout=rollout, trainer=dataclasses.replace(
        config.trainer, num_nodes=1, num_steps=2, val_every_steps=2, save_every_steps=2))


def ppo_example_workflow() -> dict:
    """dag_ppo.yaml's graph: it splits into three subgraphs (the shared prefix, the critic's update, the actor's)."""
    _, demo = resolve(os.path.join(EXAMPLES, "dag_ppo.yaml"), [])
    return json.loads(json.dumps(demo.rlvr.workflow))


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_multi_controller_gives_the_loops_metrics_on_one_rank(tmp_path, algorithm):
    fields = {"grpo": {}, "ppo": PPO}[algorithm]
    run(RLVRPipeline, tiny(RLVRConfig, tmp_path / "loop", **fields))
    workflow = {"workflow": ppo_example_workflow()} if algorithm == "ppo" else {}
    pipeline = DAGPipeline(tiny(DAGConfig, tmp_path / "dag", dag=MULTI, **fields, **workflow))
    if algorithm == "ppo":  # the subgraphs run colocated, in turn on the one rank
        assert len(split_subgraphs(pipeline.graph)) == 3
    try:
        pipeline.run()
    finally:
        pipeline.shutdown()
    assert run_metrics(str(tmp_path / "loop")) == run_metrics(str(tmp_path / "dag"))


@pytest.mark.ray
def test_two_dag_workers_train_as_the_single_controller_does(tmp_path, ray_cluster):
    run(RLVRPipeline, fsdp2_pair(RLVRConfig, tmp_path / "loop"))
    run(DAGPipeline, fsdp2_pair(DAGConfig, tmp_path / "dag", dag=MULTI))
    loop, dag = run_metrics(str(tmp_path / "loop")), run_metrics(str(tmp_path / "dag"))
    assert sorted(dag) == sorted(loop) == [0, 1, 2]
    for step, a in loop.items():
        assert a.keys() == dag[step].keys(), step
        for key, value in a.items():
            assert dag[step][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, key)


@pytest.mark.ray
def test_a_node_failing_on_the_dag_workers_names_node_rank_and_traceback(tmp_path, ray_cluster):
    _, demo = resolve(os.path.join(EXAMPLES, "dag_grpo.yaml"), [])
    workflow = json.loads(json.dumps(demo.rlvr.workflow))
    advantage = next(n for n in workflow["nodes"] if n["node_id"] == "advantage")
    advantage["executable_ref"] = "test_dag_pipeline:broken_advantage"
    config = fsdp2_pair(DAGConfig, tmp_path, dag=MULTI, workflow=workflow)
    pipeline = DAGPipeline(config)
    try:
        with pytest.raises(DAGExecutionError) as caught:
            pipeline.executor.run_step(1)
        message = str(caught.value)
        assert "node 'advantage': rank 0 raised ValueError: advantage broke on rank 0" in message
        assert ", in broken_advantage" in message  # the worker's traceback
        status = {i: n.status for i, n in pipeline.graph.nodes.items()}
        assert status["reward"] == NodeStatus.COMPLETED and status["advantage"] == NodeStatus.FAILED
        assert {status[i] for i in ("metrics", "actor_train", "sync")} == {NodeStatus.SKIPPED}
    finally:
        pipeline.shutdown()


@node_function(reads=["token_level_scores", "response_mask", "uid"], writes=["token_level_rewards", "advantages",
                                                                              "returns"])
def broken_advantage(batch, config):
    import torch.distributed as dist

    if dist.get_rank() == 0:  # one rank fails, the other would go on into the update's collectives
        raise ValueError("advantage broke on rank 0")
    from baton.dag.nodes import compute_advantage

    return compute_advantage(batch, config)


@pytest.mark.ray
@pytest.mark.timeout(180)  # the health checks end the wait; a collective's 30-minute timeout would run past this
def test_a_killed_dag_worker_stops_the_step_within_seconds(tmp_path, ray_cluster):
    import threading

    import ray

    config = fsdp2_pair(DAGConfig, tmp_path, dag=MULTI)
    config = dataclasses.replace(config, actor=dataclasses.replace(config.actor, health_check_interval_s=0.5,
                                                                   heartbeat_timeout_s=5.0))
    pipeline = DAGPipeline(config)
    try:
        pid = ray.get(pipeline.clusters["dag"]._group.hosts[1].pid.remote())
        threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()  # rank 1, during the steps below
        with pytest.raises(WorkerDiedError, match=r"rank 1\] (died|froze)") as caught:
            for step in range(1, 50):  # a tiny step may finish before the kill lands: the next one meets it
                pipeline.executor.run_step(step)
        # What ended the wait: the health checks found the killed rank (a frozen one counts as died), not a
        # collective's timeout on rank 0 (a WorkerError that raised, not died).
        assert caught.value.died and (caught.value.cluster, caught.value.rank) == ("dag", 1)
    finally:
        pipeline.shutdown()


@pytest.mark.parametrize("name", ["dag_grpo.yaml", "dag_ppo.yaml", "dag_dapo.yaml", "dag_branches.yaml"])
def test_each_dag_example_fits_a_two_core_local_ray(name):
    """`baton run` on this machine gives Ray 2 CPUs: one for the policy's device slot, the rest for the reward and
    compute workers (which failed to place before the demo's reward worker took half a CPU)."""
    _, demo = resolve(os.path.join(EXAMPLES, name), [])
    rlvr = demo.stage("rlvr")
    cpu_only = (rlvr.reward.num_cpus_per_worker * (rlvr.reward.world_size or 1)
                + rlvr.dag.compute.num_cpus_per_worker * rlvr.dag.num_compute_workers)
    slots = {device for role in (rlvr.actor, rlvr.rollout, rlvr.reference, rlvr.critic) if role is not None
             for device in (role.device_mapping or [0])}
    assert len(slots) + cpu_only <= 2
