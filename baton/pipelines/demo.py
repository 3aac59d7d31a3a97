"""The two-stage demo: SFT warm-up of the tiny model on arithmetic, then GRPO from the SFT checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from baton.pipelines.base import list_checkpoints, run_pipeline
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
        data=None,
        trainer=TrainerConfig(num_steps=300, num_prompts_per_step=64, val_every_steps=100, save_every_steps=300),
    )


def _rlvr_default() -> RLVRConfig:
    return RLVRConfig(
        actor=RoleConfig(strategy=StrategyConfig(optimizer=OptimizerConfig(lr=3e-4))),
        rollout=RoleConfig(strategy=StrategyConfig()),
        colocate_actor_rollout=True,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=6, num_samples_per_prompt=8),
        val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=6, num_samples_per_prompt=1),
        algorithm=AlgorithmConfig(adv_estimator="grpo"),
        data=None,
        trainer=TrainerConfig(num_steps=300, num_prompts_per_step=64, val_every_steps=50, save_every_steps=100),
    )


@dataclass
class DemoConfig:
    """SFT then RLVR; the RLVR stage's actor, rollout, reference and critic start from the SFT stage's final checkpoint.

    `data` serves both stages; a stage's own `data` section, when set, replaces it for that stage.
    resume: "latest" continues an interrupted demo: a finished SFT stage is not rerun, and each stage
    resumes from its latest checkpoint.
    """

    pipeline_cls: str = "baton.pipelines.demo:DemoPipeline"
    run_dir: str = "runs/demo"
    resume: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    sft: SFTConfig = field(default_factory=_sft_default)
    rlvr: RLVRConfig = field(default_factory=_rlvr_default)

    def __post_init__(self):
        if self.resume not in (None, "latest"):
            raise ValueError(f"resume {self.resume!r} is not 'latest' or null; to resume one stage from a given "
                             "checkpoint, set sft.trainer.resume or rlvr.trainer.resume to its path")

    def stage(self, name: str):
        """Stage `name`'s config with the shared data, its run directory under ours, and our resume."""
        config = getattr(self, name)
        trainer = dataclasses.replace(config.trainer, run_dir=os.path.join(self.run_dir, name),
                                      resume=self.resume or config.trainer.resume)
        return dataclasses.replace(config, data=config.data or self.data, trainer=trainer)

    def check(self) -> None:
        """Both stages' checks, so that a mistake in the second shows before the first has run."""
        self.stage("sft").check()
        self.stage("rlvr").check()


class DemoPipeline:
    config_cls = DemoConfig

    def __init__(self, config: DemoConfig):
        config.check()
        self.config = config

    def run(self) -> dict:
        from baton.pipelines.rlvr import RLVRPipeline
        from baton.pipelines.sft import SFTPipeline

        cfg = self.config
        sft_cfg = cfg.stage("sft")
        sft_summary_path = os.path.join(sft_cfg.trainer.run_dir, "summary.json")
        if cfg.resume and os.path.isfile(sft_summary_path):  # written when the stage finished
            with open(sft_summary_path) as f:
                sft_summary = json.load(f)
        else:
            sft_summary = run_pipeline(SFTPipeline, sft_cfg)
        checkpoint = os.path.abspath(os.path.join(list_checkpoints(sft_cfg.trainer.run_dir)[-1], "actor"))
        rlvr_cfg = cfg.stage("rlvr")
        rlvr_cfg = dataclasses.replace(
            rlvr_cfg, actor=_from_checkpoint(rlvr_cfg.actor, checkpoint), rollout=_from_checkpoint(rlvr_cfg.rollout, checkpoint),
            reference=_from_checkpoint(rlvr_cfg.reference, checkpoint), critic=_from_checkpoint(rlvr_cfg.critic, checkpoint),
        )
        rlvr_summary = run_pipeline(RLVRPipeline, rlvr_cfg)
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


def _from_checkpoint(role: RoleConfig | None, checkpoint: str) -> RoleConfig | None:
    if role is None:
        return None
    return dataclasses.replace(role, strategy=dataclasses.replace(role.strategy, model=checkpoint))
