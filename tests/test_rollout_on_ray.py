"""The rollout system (`RolloutRLVRPipeline`) on Ray, on the test session's Ray instance: its engines and the actor in
worker processes of their own (one CPU each), where the rest of the rollout system's tests run it in the driver's
process."""

from __future__ import annotations

import pytest

from baton.pipelines.base import run_pipeline
from baton.pipelines.config import RLVRConfig, RoleConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.rollout_rlvr import RolloutRLVRConfig, RolloutRLVRPipeline
from baton.rollout.config import RolloutSystemConfig
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.tracking import run_metrics
from test_rl_drivers import STEPS, assert_same_training, settings

pytestmark = pytest.mark.ray


def on_ray(run_dir, engines: int = 2, **system) -> RolloutRLVRConfig:
    """test_rl_drivers' settings with backend ray: an actor worker and `engines` engine workers of 1 CPU each."""
    fields = settings(run_dir)
    fields["trainer"].backend = "ray"
    strategy = StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3))
    fields["actor"] = RoleConfig(strategy=strategy, num_cpus_per_worker=1.0)
    fields["rollout"] = RoleConfig(strategy=strategy, world_size=engines, num_cpus_per_worker=1.0)
    return RolloutRLVRConfig(**fields, rollout_system=RolloutSystemConfig(**system))


def test_on_ray_the_sync_rollout_system_trains_as_the_loop_does_in_process(tmp_path, ray_cluster):
    """Two engines on Ray serve the step's groups; each group samples with its own seed, so which engine serves it
    does not change its tokens, and every metric at every step is the in-process loop's within 1e-5 relative."""
    loop_fields = settings(tmp_path / "loop")
    run_pipeline(RLVRPipeline, RLVRConfig(**loop_fields))
    run_pipeline(RolloutRLVRPipeline, on_ray(tmp_path / "ray", mode="sync"))
    runs = {"loop": run_metrics(str(tmp_path / "loop")), "rollout_on_ray": run_metrics(str(tmp_path / "ray"))}
    # The rollout system's own figures (router, buffer, staleness) are not the loop's: compare the loop's keys only.
    runs["rollout_on_ray"] = {step: {k: v for k, v in record.items() if k in runs["loop"][step]}
                              for step, record in runs["rollout_on_ray"].items()}
    assert_same_training(runs)


def test_on_ray_async_training_keeps_its_staleness_bound_and_uses_both_engines(tmp_path, ray_cluster):
    run_pipeline(RolloutRLVRPipeline, on_ray(tmp_path, mode="async", max_staleness=1))
    by_step = run_metrics(str(tmp_path), wall_clock=True)
    assert sorted(by_step) == STEPS
    for step in STEPS[1:]:
        record = by_step[step]
        assert record["rollout/staleness/max"] <= 1, (step, record["rollout/staleness/max"])
        assert record["rollout/num_groups"] == 4, step
        assert record["actor/grad_norm"] > 0, step
    served = [sum(by_step[step].get(f"router/engine_{i}/served", 0) for step in STEPS[1:]) for i in (0, 1)]
    assert min(served) > 0, served
