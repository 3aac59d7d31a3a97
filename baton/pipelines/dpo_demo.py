"""The DPO demo: the main demo's SFT warm-up on a weak teacher's arithmetic, then DPO from the SFT checkpoint on the
shipped preference pairs (chosen: the exact sum; rejected: a near miss, the teacher's dropped carry among them).

SFT levels off where the main demo's does, below the share of held-out sums without a carry, since the teacher's
usual answer to a sum that carries drops the carry; DPO, preferring the exact sum to such slips, learns to carry.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field

from baton.config import ConfigError
from baton.pipelines.base import list_checkpoints, previous_run, remove_previous_run, run_dir_in_use, run_pipeline
from baton.pipelines.config import DataConfig, RoleConfig, SFTConfig, TrainerConfig
from baton.pipelines.demo import _VAL_SAMPLING, _demo_data, _from_checkpoint, _sft_default
from baton.pipelines.dpo import DPOConfig, DPOPipeline, PreferenceConfig
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.tracking import plot_run

STAGES = ("sft", "dpo")


def _dpo_default() -> DPOConfig:
    return DPOConfig(
        actor=RoleConfig(strategy=StrategyConfig(optimizer=OptimizerConfig(lr=1e-4))),
        algorithm=PreferenceConfig(loss_type="sigmoid", beta=1.0),  # see examples/dpo.yaml for the betas tried
        data=None,
        val_sampling=dataclasses.replace(_VAL_SAMPLING),
        trainer=TrainerConfig(num_steps=200, num_prompts_per_step=64, val_every_steps=25, save_every_steps=100,
                              run_dir="runs/dpo"),
    )


@dataclass
class DPODemoConfig:
    """SFT then DPO; the DPO stage's actor and reference start from the SFT stage's final checkpoint.

    As `DemoConfig`: seed sets every seed of the run (null: the per-stage seeds as set; the task's held-out split
    stays fixed by data.seed); `data` serves both stages (DPO validates on its held-out split and trains on
    `dpo.pairs`); each stage writes under `run_dir/<stage>`; resume "latest" continues an interrupted demo (a
    finished SFT stage is not rerun); overwrite removes a previous demo's outputs in run_dir first.
    """

    pipeline_cls: str = "baton.pipelines.dpo_demo:DPODemoPipeline"
    run_dir: str = "runs/dpo"
    seed: int | None = 0
    resume: str | None = None
    overwrite: bool = False
    data: DataConfig = field(default_factory=_demo_data)
    sft: SFTConfig = field(default_factory=_sft_default)
    dpo: DPOConfig = field(default_factory=_dpo_default)

    def __post_init__(self):
        if self.resume not in (None, "latest"):
            raise ValueError(f"resume {self.resume!r} is not 'latest' or null; to resume one stage from a given "
                             "checkpoint, set sft.trainer.resume or dpo.trainer.resume to its path")
        defaults = {TrainerConfig.run_dir, SFTConfig().trainer.run_dir, DPOConfig().trainer.run_dir}
        for name in STAGES:
            trainer = getattr(self, name).trainer
            if (self.overwrite or trainer.overwrite) and (self.resume or trainer.resume):
                raise ValueError(f"{name} stage: overwrite=true would remove the run that resume="
                                 f"{self.resume or trainer.resume!r} continues; set one of them")
            if trainer.run_dir not in defaults and os.path.basename(os.path.normpath(trainer.run_dir)) != name:
                raise ValueError(f"{name}.trainer.run_dir={trainer.run_dir!r}: the demo writes each stage under its own "
                                 f"run_dir ({os.path.join(self.run_dir, name)!r}); set run_dir instead")
            trainer.run_dir = os.path.join(self.run_dir, name)
        if self.seed is not None:
            for key, holder in self._seeded():
                if holder.seed not in (0, self.seed):  # 0: the field's default
                    raise ValueError(f"{key}={holder.seed} conflicts with seed={self.seed}, which sets every seed of "
                                     "the run; set seed=null to choose per-stage seeds")
                holder.seed = self.seed

    def _seeded(self):
        """(key, object holding a `seed`) for every seed of the run but the task's."""
        for name in STAGES:
            stage = getattr(self, name)
            yield f"{name}.trainer.seed", stage.trainer
            for role_name in ("actor", "reference"):
                role = getattr(stage, role_name, None)
                if role is not None:
                    yield f"{name}.{role_name}.strategy.seed", role.strategy

    def stage(self, name: str):
        """Stage `name`'s config with the shared data, its run directory under ours, and our resume and overwrite."""
        config = getattr(self, name)
        trainer = dataclasses.replace(config.trainer, resume=self.resume or config.trainer.resume,
                                      overwrite=self.overwrite or config.trainer.overwrite)
        return dataclasses.replace(config, data=config.data or self.data, trainer=trainer)


class DPODemoPipeline:
    config_cls = DPODemoConfig

    def __init__(self, config: DPODemoConfig):
        # Both stage directories are checked before either stage runs, and cleared (overwrite) before the first does.
        trainers = [config.stage(name).trainer for name in STAGES]
        held = [f"{os.path.basename(t.run_dir)}/{what}" for t in trainers if t.resume is None and not t.overwrite
                for what in previous_run(t.run_dir)]
        if config.resume is None and not config.overwrite:
            held += previous_run(config.run_dir)  # the demo's own summary.json
        if held:
            raise run_dir_in_use(f"run_dir {config.run_dir!r}", ", ".join(held), "")
        self.dry_run(config)
        self.config = config
        for trainer in trainers:
            if trainer.overwrite:
                remove_previous_run(trainer.run_dir)
        if config.overwrite:
            remove_previous_run(config.run_dir)

    @classmethod
    def dry_run(cls, config: DPODemoConfig) -> None:
        """Both stages' checks and data, so that a mistake in the second shows before the first has run."""
        from baton.pipelines.sft import SFTPipeline

        for name, pipeline_cls in (("sft", SFTPipeline), ("dpo", DPOPipeline)):
            try:
                pipeline_cls.dry_run(config.stage(name))
            except ConfigError as e:
                raise ConfigError(f"{name} stage: {e}") from e

    def run(self) -> dict:
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
        dpo_cfg = cfg.stage("dpo")
        dpo_cfg = dataclasses.replace(dpo_cfg, actor=_from_checkpoint(dpo_cfg.actor, checkpoint),
                                      reference=_from_checkpoint(dpo_cfg.reference, checkpoint))
        dpo_summary = run_pipeline(DPOPipeline, dpo_cfg)
        summary = {
            "wall_s": sft_summary["wall_s"] + dpo_summary["wall_s"],
            "sft_val_accuracy": sft_summary["final_val_accuracy"],
            "start_val_accuracy": dpo_summary["start_val_accuracy"],
            "final_val_accuracy": dpo_summary["final_val_accuracy"],
            "sft": sft_summary, "dpo": dpo_summary,
        }
        with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        summary["plot"] = plot_run(cfg.run_dir)
        return summary
