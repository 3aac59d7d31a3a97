"""The two-stage demo: SFT warm-up of the tiny model on arithmetic, then GRPO from the SFT checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from baton.pipelines.base import list_checkpoints
from baton.pipelines.config import (
    AlgorithmConfig,
    DataConfig,
    RLVRConfig,
    RoleConfig,
    SamplingConfig,
    SFTConfig,
    TrainerConfig,
)
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.tracking import plot_run


def _sft_default() -> SFTConfig:
    return SFTConfig(
        actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=3e-3))),
        trainer=TrainerConfig(num_steps=300, num_prompts_per_step=64, val_every_steps=100, save_every_steps=300),
    )


def _rlvr_default() -> RLVRConfig:
    return RLVRConfig(
        actor=RoleConfig(strategy=StrategyConfig(optimizer=OptimizerConfig(lr=5e-4))),
        rollout=RoleConfig(strategy=StrategyConfig()),
        colocate_actor_rollout=True,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=6, num_samples_per_prompt=8),
        val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=6, num_samples_per_prompt=1),
        algorithm=AlgorithmConfig(adv_estimator="grpo"),
        trainer=TrainerConfig(num_steps=300, num_prompts_per_step=64, val_every_steps=50, save_every_steps=100),
    )


@dataclass
class DemoConfig:
    """SFT then RLVR; the RLVR stage's actor, rollout and reference start from the SFT stage's final checkpoint."""

    pipeline_cls: str = "baton.pipelines.demo:DemoPipeline"
    run_dir: str = "runs/demo"
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=_sft_default)
    rlvr: RLVRConfig = field(default_factory=_rlvr_default)


class DemoPipeline:
    config_cls = DemoConfig

    def __init__(self, config: DemoConfig):
        self.config = config

    def run(self) -> dict:
        from baton.pipelines.rlvr import RLVRPipeline
        from baton.pipelines.sft import SFTPipeline

        cfg = self.config
        sft_cfg = dataclasses.replace(cfg.sft, data=cfg.data,
                                      trainer=dataclasses.replace(cfg.sft.trainer, run_dir=os.path.join(cfg.run_dir, "sft")))
        sft = SFTPipeline(sft_cfg)
        try:
            sft_summary = sft.run()
        finally:
            sft.shutdown()
        checkpoint = os.path.abspath(os.path.join(list_checkpoints(sft.checkpoint_root)[-1], "actor"))
        rlvr_cfg = dataclasses.replace(
            cfg.rlvr, data=cfg.data,
            actor=_from_checkpoint(cfg.rlvr.actor, checkpoint), rollout=_from_checkpoint(cfg.rlvr.rollout, checkpoint),
            reference=_from_checkpoint(cfg.rlvr.reference, checkpoint) if cfg.rlvr.reference else None,
            trainer=dataclasses.replace(cfg.rlvr.trainer, run_dir=os.path.join(cfg.run_dir, "rlvr")),
        )
        rlvr = RLVRPipeline(rlvr_cfg)
        try:
            rlvr_summary = rlvr.run()
        finally:
            rlvr.shutdown()
        summary = {
            "wall_s": sft_summary["wall_s"] + rlvr_summary["wall_s"],
            "start_val_accuracy": rlvr_summary["start_val_accuracy"],
            "final_val_accuracy": rlvr_summary["final_val_accuracy"],
            "sft": sft_summary, "rlvr": rlvr_summary,
        }
        with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        summary["plot"] = plot_run(cfg.run_dir)
        return summary


def _from_checkpoint(role: RoleConfig, checkpoint: str) -> RoleConfig:
    return dataclasses.replace(role, strategy=dataclasses.replace(role.strategy, model=checkpoint))
