"""One RL algorithm, three drivers: the loop (`RLVRPipeline`), the rollout system in sync mode
(`RolloutRLVRPipeline`) and the workflow graph (`DAGPipeline`) train alike on the local backend, step for step, with
the same validation metric set; the features one of them used to refuse (reward models, adaptive KL, ReMax,
colocation) run in all three; colocated weight syncs share tensors (the multi-controller's, the rollout system's)."""

from __future__ import annotations

import math

from baton.pipelines.base import run_pipeline
from baton.pipelines.config import (AlgorithmConfig, DataConfig, KLControlConfig, OverlongBufferConfig, RLVRConfig,
                                    RoleConfig, SamplingConfig, TrainerConfig)
from baton.pipelines.dag import DAGConfig, DAGPipeline, DAGSettings
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig, RolloutRLVRPipeline
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.tracking import run_metrics

THIS = "test_rl_drivers"  # tests/ is on sys.path: functions here are importable by path
DRIVERS = {"loop": (RLVRPipeline, RLVRConfig), "rollout_sync": (RolloutRLVRPipeline, RolloutRLVRConfig),
           "dag": (DAGPipeline, DAGConfig)}
STEPS = [0, 1, 2, 3, 4]
# What only the rollout system logs: its groups, their staleness, partial samples, the router's counts per engine.
ROLLOUT_SYSTEM_OWN = ("rollout/num_groups", "rollout/num_partial_samples", "rollout/staleness/", "router/")
# The weight-sync probe runs on each driver's own schedule (the loop's on every sync, the rollout system's on its
# first and every probe_every_syncs-th): its figure is compared where both log it.
PROBE = "weight_sync/max_logprob_diff"


def digit_share(response: str, ground_truth: str, **fields) -> float:
    """Partial credit the untrained tiny model already earns in varying amounts, so every step has advantages and
    gradients (an exact-match reward is 0 for all of its samples)."""
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def settings(run_dir, trainer: dict | None = None, **fields) -> dict:
    role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3)))
    trainer = TrainerConfig(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, num_steps=4,
                            val_every_steps=2, save_every_steps=4, progress_bar=False, **(trainer or {}))
    return dict(actor=role, rollout=role, data=DataConfig(max_operand=9, num_val_examples=8),
                reward_fn=f"{THIS}:digit_share", sampling=SamplingConfig(max_new_tokens=4, num_samples_per_prompt=4),
                val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=4, num_samples_per_prompt=1),
                trainer=trainer, **fields)


def run_all(tmp_path, drivers=tuple(DRIVERS), **fields) -> dict[str, dict[int, dict]]:
    """Each of `drivers`' metrics by step (wall-clock figures left out), one run each."""
    out = {}
    for name in drivers:
        pipeline_cls, config_cls = DRIVERS[name]
        run_pipeline(pipeline_cls, config_cls(**settings(tmp_path / name, **fields)))
        out[name] = run_metrics(str(tmp_path / name))
    return out


def assert_same_training(runs: dict[str, dict[int, dict]], rel: float = 1e-5) -> None:
    """Every driver logs the same steps and, at every step, the same metric keys with the same values (the rollout
    system's engine batches requests continuously, so float rounding may differ in the last digits)."""
    loop = runs["loop"]
    for name, other in runs.items():
        assert sorted(other) == sorted(loop) == STEPS, name
        for step, ours in loop.items():
            theirs = {k: v for k, v in other[step].items() if not k.startswith(ROLLOUT_SYSTEM_OWN)}
            if (PROBE in ours) != (PROBE in theirs):
                ours, theirs = ({k: v for k, v in record.items() if k != PROBE} for record in (ours, theirs))
            assert theirs.keys() == ours.keys(), (name, step, sorted(set(ours) ^ set(theirs)))
            for key, value in ours.items():
                assert math.isclose(theirs[key], value, rel_tol=rel, abs_tol=1e-6), (name, step, key, value, theirs[key])
    assert any(r.get("actor/grad_norm", 0) > 0.1 for r in loop.values()), "the runs must learn for the comparison to mean much"


def test_one_grpo_config_trains_alike_as_loop_rollout_system_and_workflow(tmp_path):
    runs = run_all(tmp_path)
    assert_same_training(runs)
    assert {"val/accuracy", "val/truncated_ratio", "val/reward/num_errors",
            "val-core/unknown/reward/mean@1"} <= set(runs["rollout_sync"][0])


def test_grpo_with_a_kl_loss_trains_alike_as_loop_rollout_system_and_workflow(tmp_path):
    """A reference role and the KL loss against it (low_var_kl), in all three drivers."""
    runs = run_all(tmp_path, algorithm=AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1))
    assert_same_training(runs)
    kl = [runs["loop"][step]["actor/kl"] for step in STEPS[1:]]
    assert kl[0] == 0 < min(kl[1:]), kl  # step 1 trains the reference's own weights; then the actor has moved


def test_ppo_with_a_critic_trains_alike_as_loop_rollout_system_and_workflow(tmp_path):
    """GAE on a value model's values, the value loss, two mini-batches per step, in all three drivers."""
    runs = run_all(tmp_path, critic=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", kind="value")),
                   algorithm=AlgorithmConfig(adv_estimator="gae", num_mini_batches_per_step=2))
    assert_same_training(runs)
    assert all("critic/vf_loss" in r for r in runs["loop"].values() if r.get("actor/pg_loss") is not None)


def test_a_reward_model_adaptive_kl_and_the_overlong_penalty_run_in_all_three_alike(tmp_path):
    """The first two used to be refused by the rollout system or the workflow, the third was ignored by the rollout
    system; now the one algorithm runs them everywhere."""
    runs = run_all(tmp_path, overlong_buffer=OverlongBufferConfig(len=2),
                   reward_model=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", kind="value")),
                   algorithm=AlgorithmConfig(use_kl_in_reward=True, kl_reward_coef=0.05,
                                             kl_ctrl=KLControlConfig(type="adaptive", target_kl=1e-6, horizon=100)))
    assert_same_training(runs)
    coefs = [r["actor/reward_kl_penalty_coeff"] for r in runs["loop"].values() if "actor/reward_kl_penalty_coeff" in r]
    assert coefs[0] == 0.05 and coefs[-1] != coefs[0]  # the controller moved, and moved alike everywhere
    assert all("reward_model/score/mean" in r for step, r in runs["dag"].items() if step > 0)
    assert any(r.get("reward/overlong/mean", 0) > 0 for r in runs["rollout_sync"].values())


def test_the_multi_controller_colocated_sync_shares_the_actors_tensors(tmp_path):
    """A DAG worker's actor and rollout, both `hf` in one process, share parameters: a sync copies nothing (before,
    a class-name test that no class passed made every sync gather and load the whole state dict), and the
    rollout's parameters are the actor's own storage after training steps moved them."""
    config = DAGConfig(**settings(tmp_path, colocate_actor_rollout=True, dag=DAGSettings(executor="multi_controller")))
    config.trainer.num_steps = 2
    pipeline = DAGPipeline(config)
    try:
        worker = pipeline.clusters["dag"]._group.hosts[0]._workers["dag"]  # local backend: in this process
        rollout = worker.colocated_worker("rollout").strategy
        loads = []
        rollout.import_weights = lambda buckets: loads.append(buckets)
        pipeline.run()
        assert loads == []  # two syncs, nothing copied
        actor = worker.colocated_worker("actor").strategy.hf_model
        for (name, ours), (_, theirs) in zip(actor.named_parameters(), rollout.hf_model.named_parameters()):
            assert ours.data_ptr() == theirs.data_ptr(), name
    finally:
        pipeline.shutdown()


def test_colocated_actor_and_rollout_train_alike_in_all_three(tmp_path):
    """colocate_actor_rollout, which the rollout system used to refuse: its engines live in the actor's processes."""
    assert_same_training(run_all(tmp_path, colocate_actor_rollout=True))


def test_the_rollout_systems_colocated_engines_share_the_actors_tensors(tmp_path):
    """Each colocated engine serves its actor rank's own parameters: after training steps moved them, a sync copied
    nothing into the engine, and the engine's parameters are the actor's storage."""
    config = RolloutRLVRConfig(**settings(tmp_path, colocate_actor_rollout=True))
    config.trainer.num_steps = 2
    pipeline = RolloutRLVRPipeline(config)
    try:
        workers = pipeline.clusters["rollout"]._group.hosts[0]._workers  # local backend: in this process
        engine = workers["rollout"]
        loads = []
        engine.import_weights = lambda buckets, version=None: loads.append(version)
        pipeline.run()
        assert loads == [] and pipeline.pool.version == 2  # two syncs, nothing copied
        actor = workers["actor"].strategy.hf_model
        served = dict(engine.served.engine.model.named_parameters())
        for name, ours in actor.named_parameters():
            assert served[name].data_ptr() == ours.data_ptr(), name
    finally:
        pipeline.shutdown()


def test_remax_generates_its_greedy_baseline_in_all_three_alike(tmp_path):
    """ReMax's greedy baseline rollout: the loop's rollout worker, the rollout system's engines, a workflow node."""
    runs = run_all(tmp_path, algorithm=AlgorithmConfig(adv_estimator="remax"))
    assert_same_training(runs)
    assert all("critic/baseline_score/mean" in r for name in DRIVERS for step, r in runs[name].items() if step > 0)


def test_roles_taking_turns_on_shared_devices_train_alike_in_the_loop_and_the_workflow(tmp_path):
    """trainer.offload_idle_roles: true, with the rollout on the actor's device (both unmapped: device 0) and a
    reference beside them: the workflow executor hands the devices to each node's roles as the loop hands them to
    each phase, and the workflow (which used to refuse it) trains as the loop does. On CPU an offload frees nothing,
    but every offload and reload runs, timed."""
    runs = run_all(tmp_path, drivers=("loop", "dag"), trainer={"offload_idle_roles": True},
                   algorithm=AlgorithmConfig(use_kl_loss=True))
    assert_same_training(runs)
    for name in runs:
        steps = run_metrics(str(tmp_path / name), wall_clock=True)
        assert all(steps[step]["timing_s/offload"] > 0 and steps[step]["timing_s/reload"] > 0 for step in STEPS[1:]), name
