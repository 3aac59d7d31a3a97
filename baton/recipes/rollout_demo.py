"""The demo with its GRPO stage on the rollout system: SFT, then GRPO from its checkpoint, with the engines in
workers of their own (`rlvr.rollout_system`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.pipelines.rollout_rlvr import RolloutRLVRConfig
from baton.recipes.demo import DemoConfig, DemoPipeline, demo_rlvr_as


def rlvr_default() -> RolloutRLVRConfig:
    """The demo's GRPO stage on the rollout system: its settings, with the engines in workers of their own."""
    return demo_rlvr_as(RolloutRLVRConfig, drop=("reward",), colocate_actor_rollout=False)


@dataclass
class RolloutDemoConfig(DemoConfig):
    """The demo (SFT, then GRPO from its checkpoint) with the GRPO stage on the rollout system (`rlvr.rollout_system`)."""

    pipeline_cls: str = "baton.recipes.rollout_demo:RolloutDemoPipeline"
    rlvr: RolloutRLVRConfig = field(default_factory=rlvr_default)


class RolloutDemoPipeline(DemoPipeline):
    config_cls = RolloutDemoConfig
    second_pipeline_cls = "baton.pipelines.rollout_rlvr:RolloutRLVRPipeline"
