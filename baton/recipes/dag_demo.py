"""The demo with its GRPO stage run as a workflow graph: SFT, then GRPO from its checkpoint (`rlvr.workflow`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from baton.pipelines.dag import DAGConfig
from baton.recipes.demo import DemoConfig, DemoPipeline, demo_rlvr_as


def _dag_default() -> DAGConfig:
    """The demo's GRPO stage as a workflow. Its reward worker takes half a CPU instead of one, so that with the
    compute workers beside it the demo still fits a 2-core machine's local Ray (a CPU for the policy's slot)."""
    demo = demo_rlvr_as(DAGConfig)
    return dataclasses.replace(demo, reward=dataclasses.replace(demo.reward, num_cpus_per_worker=0.5))


@dataclass
class DAGDemoConfig(DemoConfig):
    """The demo (SFT, then GRPO from its checkpoint) with the GRPO stage run as a workflow graph (`rlvr.workflow`)."""

    pipeline_cls: str = "baton.recipes.dag_demo:DAGDemoPipeline"
    rlvr: DAGConfig = field(default_factory=_dag_default)


class DAGDemoPipeline(DemoPipeline):
    config_cls = DAGDemoConfig
    second_pipeline_cls = "baton.pipelines.dag:DAGPipeline"
