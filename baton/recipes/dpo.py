"""The DPO demo: the main demo's SFT warm-up on a weak teacher's arithmetic, then DPO from the SFT checkpoint on the
shipped preference pairs (chosen: the exact sum; rejected: a near miss, the teacher's dropped carry among them).

SFT levels off where the main demo's does, below the share of held-out sums without a carry, since the teacher's
usual answer to a sum that carries drops the carry; DPO, preferring the exact sum to such slips, learns to carry.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from baton.pipelines.config import RoleConfig, SFTConfig, TrainerConfig
from baton.pipelines.dpo import DPOConfig, PreferenceConfig
from baton.recipes.demo import VAL_SAMPLING, TwoStageConfig, TwoStagePipeline, sft_default
from baton.strategy import OptimizerConfig, StrategyConfig


def _dpo_default() -> DPOConfig:
    return DPOConfig(
        actor=RoleConfig(strategy=StrategyConfig(optimizer=OptimizerConfig(lr=1e-4))),
        algorithm=PreferenceConfig(loss_type="sigmoid", beta=1.0),  # see examples/dpo.yaml for the betas tried
        data=None,
        val_sampling=dataclasses.replace(VAL_SAMPLING),
        trainer=TrainerConfig(num_steps=200, num_prompts_per_step=64, val_every_steps=25, save_every_steps=100,
                              run_dir="runs/dpo"),
    )


@dataclass
class DPODemoConfig(TwoStageConfig):
    """SFT then DPO (see `TwoStageConfig`); the DPO stage's actor and reference start from the SFT stage's final
    checkpoint. `data` serves both stages: DPO validates on its held-out split and trains on `dpo.pairs`."""

    SECOND: ClassVar[str] = "dpo"

    pipeline_cls: str = "baton.recipes.dpo:DPODemoPipeline"
    run_dir: str = "runs/dpo"
    sft: SFTConfig = field(default_factory=sft_default)
    dpo: DPOConfig = field(default_factory=_dpo_default)


class DPODemoPipeline(TwoStagePipeline):
    config_cls = DPODemoConfig
    second_pipeline_cls = "baton.pipelines.dpo:DPOPipeline"
