"""SFT then RLVR (`SFTRLVRPipeline`): the two-stage recipe, whose defaults are the demo's: SFT of the tiny model on a
weak teacher's arithmetic, then GRPO from the SFT checkpoint. Any stage can run alone (`stage`, `init_from`).

The teacher drops the carry in most of its demonstrations of a sum that carries, so SFT levels off near
the share of problems without a carry; GRPO, rewarded for the exact answer, learns to carry.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import ClassVar

from baton.config import ConfigError, import_object
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import (
    AlgorithmConfig,
    DataConfig,
    RLVRConfig,
    RoleConfig,
    SamplingConfig,
    SFTConfig,
    TrainerConfig,
)
from baton.pipelines.run_dir import list_checkpoints, previous_run, remove_previous_run, run_dir_in_use
from baton.strategy import OptimizerConfig, SchedulerConfig, StrategyConfig
from baton.tracking import plot_run


# Greedy held-out accuracy, at the sampling length of the RLVR stage, so that SFT's last figure is RLVR's first.
VAL_SAMPLING = SamplingConfig(temperature=0.0, max_new_tokens=6, num_samples_per_prompt=1)


def _demo_data() -> DataConfig:
    """Addition up to 30+30; SFT imitates a teacher that drops the carry in 8 of 10 demonstrations."""
    return DataConfig(task="arithmetic", max_operand=30, num_val_examples=200, teacher_error=0.8)


def sft_default() -> SFTConfig:
    # Long enough to reach the plateau of imitating the teacher on every seed tried; warm-up and cosine decay
    # keep the end steady. (At lr 3e-3 the loss sat at its first plateau for 450 to over 1,500 steps by seed.)
    schedule = SchedulerConfig(name="cosine", warmup_steps=50, min_lr_ratio=0.1)  # over the whole stage
    return SFTConfig(
        actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3), scheduler=schedule)),
        data=None,
        val_sampling=dataclasses.replace(VAL_SAMPLING),
        trainer=TrainerConfig(num_steps=1500, num_prompts_per_step=64, val_every_steps=250, save_every_steps=1500),
    )


def _rlvr_default() -> RLVRConfig:
    return RLVRConfig(
        actor=RoleConfig(strategy=StrategyConfig(optimizer=OptimizerConfig(lr=3e-4))),
        rollout=RoleConfig(strategy=StrategyConfig()),
        colocate_actor_rollout=True,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=6, num_samples_per_prompt=8),
        val_sampling=dataclasses.replace(VAL_SAMPLING),
        algorithm=AlgorithmConfig(adv_estimator="grpo"),
        data=None,
        trainer=TrainerConfig(num_steps=200, num_prompts_per_step=64, val_every_steps=25, save_every_steps=100),
    )


def demo_rlvr_as(config_cls, drop: tuple[str, ...] = (), **changes):
    """The demo's RLVR stage as a `config_cls` (a subclass of RLVRConfig): its settings but `pipeline_cls` and the
    fields in `drop`, with `changes`."""
    base = _rlvr_default()
    kept = {f.name: getattr(base, f.name) for f in dataclasses.fields(RLVRConfig) if f.name not in ("pipeline_cls", *drop)}
    return config_cls(**{**kept, **changes})


@dataclass
class TwoStageConfig:
    """SFT, then a second stage (`SECOND`: the field holding its config) whose model roles start from the SFT
    stage's final checkpoint. `SFTRLVRConfig` is SFT then RLVR (the main demo's); others give their own second stage.

    seed: sets every seed of the run (each stage's data order, weight init and sampling generators);
        null leaves the per-stage seeds (`sft.trainer.seed`, `rlvr.rollout.strategy.seed`, ...) as set.
        The task itself (its held-out split, the teacher's slips) is fixed by `data.seed`.
    `data` serves both stages; a stage's own `data` section, when set, replaces it for that stage.
    Each stage writes under `run_dir/<stage>` (shown as its `trainer.run_dir`).
    resume: "latest" continues an interrupted demo: a finished SFT stage is not rerun, and each stage
    resumes from its latest checkpoint.
    overwrite: a new demo into a run_dir that holds a previous one is refused; true removes that run's
        metrics, summaries, plots and checkpoints (of the stages that run) first.
    only_stage: run this stage alone (`baton run CONFIG --stage rlvr`), into its usual directory `run_dir/<stage>`;
        null runs every stage. The other stages' directories are neither read nor touched, but for the checkpoint
        the second stage starts from.
    init_from: with `only_stage` the second stage, the checkpoint it starts from: a stage directory (its latest
        checkpoint), a checkpoint directory (`.../checkpoints/step_N`) or its `actor` directory; null: the latest
        checkpoint of this run's own first stage (`run_dir/sft`).
    """

    SECOND: ClassVar[str] = "rlvr"

    pipeline_cls: str = "baton.recipes.demo:DemoPipeline"
    run_dir: str = "runs/demo"
    seed: int | None = 0
    resume: str | None = None
    overwrite: bool = False
    only_stage: str | None = None
    init_from: str | None = None
    data: DataConfig = field(default_factory=_demo_data)

    @property
    def stages(self) -> tuple[str, str]:
        return ("sft", self.SECOND)

    @property
    def stages_to_run(self) -> tuple[str, ...]:
        return self.stages if self.only_stage is None else (self.only_stage,)

    def __post_init__(self):
        if self.only_stage is not None and self.only_stage not in self.stages:
            raise ValueError(f"only_stage (--stage) {self.only_stage!r} is not a stage of this config; its stages are "
                             f"{', '.join(self.stages)}")
        if self.init_from is not None and self.only_stage != self.SECOND:
            first = self.only_stage or self.stages[0]
            raise ValueError(f"init_from (--init-from) {self.init_from!r} is the checkpoint the {self.SECOND} stage "
                             f"starts from; run that stage alone with --stage {self.SECOND} (only_stage={self.SECOND}), "
                             f"or set {first}.actor.strategy.model to start the {first} stage from a checkpoint")
        if self.resume not in (None, "latest"):
            raise ValueError(f"resume {self.resume!r} is not 'latest' or null; to resume one stage from a given "
                             f"checkpoint, set sft.trainer.resume or {self.SECOND}.trainer.resume to its path")
        for name in self.stages:
            trainer = getattr(self, name).trainer
            if (self.overwrite or trainer.overwrite) and (self.resume or trainer.resume):
                raise ValueError(f"{name} stage: overwrite=true would remove the run that resume="
                                 f"{self.resume or trainer.resume!r} continues; set one of them")
            # Its defaults, or a stage directory of a demo config as `baton config` prints it.
            defaults = (TrainerConfig.run_dir, SFTConfig().trainer.run_dir, type(getattr(self, name))().trainer.run_dir)
            if trainer.run_dir not in defaults and os.path.basename(os.path.normpath(trainer.run_dir)) != name:
                raise ValueError(f"{name}.trainer.run_dir={trainer.run_dir!r}: the demo writes each stage under its own "
                                 f"run_dir ({os.path.join(self.run_dir, name)!r}); set run_dir instead")
            trainer.run_dir = os.path.join(self.run_dir, name)
        if self.seed is not None:
            self._set_seeds(self.seed)

    def _seeded(self):
        """(key, object holding a `seed`) for every seed of the run but the task's."""
        for name in self.stages:
            stage = getattr(self, name)
            yield f"{name}.trainer.seed", stage.trainer
            for role_name in STAGE_ROLES:
                role = getattr(stage, role_name, None)
                if role is not None:
                    yield f"{name}.{role_name}.strategy.seed", role.strategy

    def _set_seeds(self, seed: int) -> None:
        for key, holder in self._seeded():
            if holder.seed not in (0, seed):  # 0: the field's default
                raise ValueError(f"{key}={holder.seed} conflicts with seed={seed}, which sets every seed of the run; "
                                 "set seed=null to choose per-stage seeds")
            holder.seed = seed

    def stage(self, name: str):
        """Stage `name`'s config with the shared data, its run directory under ours, and our resume and overwrite."""
        config = getattr(self, name)
        trainer = dataclasses.replace(config.trainer, resume=self.resume or config.trainer.resume,
                                      overwrite=self.overwrite or config.trainer.overwrite)
        return dataclasses.replace(config, data=config.data or self.data, trainer=trainer)


STAGE_ROLES = ("actor", "rollout", "reference", "critic")  # the model roles a second stage starts from the checkpoint


class TwoStagePipeline:
    """Runs a `TwoStageConfig`: SFT, then `second_pipeline_cls` (an import path) from its checkpoint; or one stage
    alone (`only_stage`), the second from `init_from` or the first stage's latest checkpoint."""

    config_cls = TwoStageConfig
    second_pipeline_cls = "baton.pipelines.rlvr:RLVRPipeline"  # imported when used

    def __init__(self, config: TwoStageConfig):
        # The stage directories are checked before any stage runs, and cleared (overwrite) before the first does, so
        # that no later resume=latest finds a checkpoint of the run replaced. A stage run alone touches its own only.
        trainers = [config.stage(name).trainer for name in config.stages_to_run]
        held = [f"{os.path.basename(t.run_dir)}/{what}" for t in trainers if t.resume is None and not t.overwrite
                for what in previous_run(t.run_dir)]
        whole_run = config.only_stage is None
        if whole_run and config.resume is None and not config.overwrite:
            held += previous_run(config.run_dir)  # the demo's own summary.json
        if held:
            raise run_dir_in_use(f"run_dir {config.run_dir!r}", ", ".join(held), "")
        self.dry_run(config)
        self.config = config
        for trainer in trainers:
            if trainer.overwrite:
                remove_previous_run(trainer.run_dir)
        if whole_run and config.overwrite:
            remove_previous_run(config.run_dir)

    @classmethod
    def pipeline_classes(cls) -> tuple[type, ...]:
        """Each stage's pipeline class, in `stages` order."""
        from baton.pipelines.sft import SFTPipeline

        return SFTPipeline, import_object(cls.second_pipeline_cls)

    @classmethod
    def dry_run(cls, config: TwoStageConfig) -> None:
        """The checks and data of every stage that runs, so that a mistake in the second shows before the first has
        run; a second stage run alone is checked with the checkpoint it starts from."""
        for name, pipeline_cls in zip(config.stages, cls.pipeline_classes()):
            if name not in config.stages_to_run:
                continue
            try:
                stage_config = cls.starting_from(config, name, cls.start_checkpoint(config, name))
                pipeline_cls.dry_run(stage_config)
            except ConfigError as e:
                raise ConfigError(f"{name} stage: {e}") from e

    @classmethod
    def start_checkpoint(cls, config: TwoStageConfig, name: str) -> str | None:
        """The model directory the second stage starts from when run alone (`init_from`, else the first stage's latest
        checkpoint); None for any other stage (its config's model) and in a whole run (the first stage's final
        checkpoint, known once it has run)."""
        if name != config.SECOND or config.only_stage != name:
            return None
        first_dir = config.stage(config.stages[0]).trainer.run_dir
        if config.init_from is None and not list_checkpoints(first_dir):
            raise ConfigError(f"no checkpoint in {first_dir} (this run's {config.stages[0]} stage) to start the {name} "
                              f"stage from; run the {config.stages[0]} stage first (--stage {config.stages[0]}), or "
                              f"give the checkpoint with --init-from")
        return init_checkpoint(config.init_from or first_dir, config.stages[0])

    @classmethod
    def starting_from(cls, config: TwoStageConfig, name: str, checkpoint: str | None):
        """Stage `name`'s config, its model roles starting from `checkpoint` (None: as configured)."""
        stage_config = config.stage(name)
        if checkpoint is None:
            return stage_config
        return dataclasses.replace(stage_config, **{
            role: from_checkpoint(getattr(stage_config, role), checkpoint)
            for role in STAGE_ROLES if hasattr(stage_config, role)})

    def run(self) -> dict:
        cfg, (first, second) = self.config, self.config.stages
        first_cls, second_cls = self.pipeline_classes()
        if cfg.only_stage == first:
            return run_pipeline(first_cls, cfg.stage(first))
        if cfg.only_stage == second:
            checkpoint = self.start_checkpoint(cfg, second)
            print(f"baton: the {second} stage alone, from {checkpoint}", file=sys.stderr)
            return run_pipeline(second_cls, self.starting_from(cfg, second, checkpoint))
        first_cfg = cfg.stage(first)
        first_summary_path = os.path.join(first_cfg.trainer.run_dir, "summary.json")
        if cfg.resume and os.path.isfile(first_summary_path):  # written when the stage finished
            with open(first_summary_path) as f:
                first_summary = json.load(f)
        else:
            first_summary = run_pipeline(first_cls, first_cfg)
        checkpoint = os.path.abspath(os.path.join(list_checkpoints(first_cfg.trainer.run_dir)[-1], "actor"))
        second_summary = run_pipeline(second_cls, self.starting_from(cfg, second, checkpoint))
        summary = {
            "wall_s": first_summary["wall_s"] + second_summary["wall_s"],
            "sft_val_accuracy": first_summary["final_val_accuracy"],
            "start_val_accuracy": second_summary["start_val_accuracy"],
            "final_val_accuracy": second_summary["final_val_accuracy"],
            first: first_summary, second: second_summary,
        }
        with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        summary["plot"] = plot_run(cfg.run_dir)
        return summary


@dataclass
class SFTRLVRConfig(TwoStageConfig):
    """SFT then RLVR (see `TwoStageConfig`), for any task; the RLVR stage's actor, rollout, reference and critic start
    from the SFT stage's final checkpoint. Its defaults are the demo's; a task's config sets its data, reward_fn,
    models and steps."""

    pipeline_cls: str = "baton.recipes.demo:SFTRLVRPipeline"
    sft: SFTConfig = field(default_factory=sft_default)
    rlvr: RLVRConfig = field(default_factory=_rlvr_default)


class SFTRLVRPipeline(TwoStagePipeline):
    """Runs an `SFTRLVRConfig`: SFT, then the RLVR stage (GRPO, or what `rlvr.algorithm` names) from its checkpoint."""

    config_cls = SFTRLVRConfig


@dataclass
class DemoConfig(SFTRLVRConfig):
    """The built-in demo (`baton run` without a config): `SFTRLVRConfig` under its earlier name, which configs may
    still give (`pipeline_cls: baton.recipes.demo:DemoPipeline`)."""

    pipeline_cls: str = "baton.recipes.demo:DemoPipeline"


class DemoPipeline(SFTRLVRPipeline):
    config_cls = DemoConfig


def init_checkpoint(path: str, first_stage: str) -> str:
    """The model directory (a checkpoint's `actor`) that `path` names: a stage directory (its latest checkpoint), a
    checkpoint directory, its `actor` directory, or a two-stage run directory (its `first_stage`'s latest); ConfigError
    naming what is missing and what to give."""
    from baton.pipelines.preflight import check_model_dir

    given = path
    if not os.path.isdir(path):
        raise ConfigError(f"init_from (--init-from) {given!r} is not a directory (looked in the working directory "
                          f"{os.getcwd()}); give a stage directory (runs/x/{first_stage}), a checkpoint directory "
                          f"(runs/x/{first_stage}/checkpoints/step_N) or its actor directory")
    if not list_checkpoints(path) and list_checkpoints(os.path.join(path, first_stage)):
        path = os.path.join(path, first_stage)
    if list_checkpoints(path):
        path = list_checkpoints(path)[-1]
    if os.path.isdir(os.path.join(path, "actor")):
        path = os.path.join(path, "actor")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"init_from (--init-from) {given!r} holds no checkpoint (no checkpoints/step_N, no actor "
                          f"directory, no config.json); give a stage directory (runs/x/{first_stage}), a checkpoint "
                          f"directory (runs/x/{first_stage}/checkpoints/step_N) or its actor directory")
    check_model_dir("init_from (--init-from)", path, [])
    return os.path.abspath(path)


def from_checkpoint(role: RoleConfig | None, checkpoint: str) -> RoleConfig | None:
    if role is None:
        return None
    return dataclasses.replace(role, strategy=dataclasses.replace(role.strategy, model=checkpoint))
