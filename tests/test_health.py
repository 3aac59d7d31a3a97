"""Being told when training goes wrong: an lr schedule that ends before the run is refused where the config says so."""

from __future__ import annotations

import os

import pytest

from baton.cli import main
from baton.config import ConfigError
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SFTConfig, TrainerConfig
from baton.strategy import OptimizerConfig, SchedulerConfig, StrategyConfig

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def decaying(total_steps, name="cosine", min_lr_ratio=0.0) -> RoleConfig:
    schedule = SchedulerConfig(name=name, warmup_steps=1, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
    return RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3), scheduler=schedule))


def grpo(actor: RoleConfig, num_steps: int, num_mini_batches: int = 1) -> RLVRConfig:
    config = RLVRConfig(actor=actor, rollout=RoleConfig(), data=DataConfig(max_operand=9, num_val_examples=4),
                        trainer=TrainerConfig(num_steps=num_steps, num_prompts_per_step=4, backend="local"))
    config.algorithm.num_mini_batches_per_step = num_mini_batches
    return config


# --- the lr schedule against the run's updates (issue 34, item 2) ---------------------------------------------------

def test_baton_config_refuses_more_steps_than_an_explicit_schedule_spans(capsys):
    """The issue's case: the own-task example's GRPO stage (cosine over 150 updates) given 300 steps left the lr at 0
    for the last 150, and `baton config` said the checks passed."""
    assert main(["config", os.path.join(EXAMPLES, "reverse", "config.yaml"), "rlvr.trainer.num_steps=300"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ("rlvr stage: actor.strategy.scheduler.total_steps=150: the cosine decay reaches lr 0 after 150 updates, but "
            "this run makes 300 (trainer.num_steps=300 × 1 per step), so its last 150 would train nothing; set "
            "actor.strategy.scheduler.total_steps=300, remove it") in err


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_a_schedule_shorter_than_the_updates_is_refused_counting_mini_batches(name):
    grpo(decaying(8, name), num_steps=4, num_mini_batches=2).check()  # 4 steps × 2 mini-batches: exactly 8 updates
    with pytest.raises(ConfigError, match=r"actor.strategy.scheduler.total_steps=6: the .* decay reaches lr 0 after 6 "
                                          r"updates, but this run makes 8 \(trainer.num_steps=4 × 2 per step\).* last 2"):
        grpo(decaying(6, name), num_steps=4, num_mini_batches=2).check()


def test_sft_dpo_and_distill_refuse_it_too():
    from baton.pipelines.distill import DistillConfig
    from baton.pipelines.dpo import DPOConfig

    for config_cls in (SFTConfig, DPOConfig, DistillConfig):
        config = config_cls(actor=decaying(5), trainer=TrainerConfig(num_steps=9, num_prompts_per_step=4))
        with pytest.raises(ConfigError, match=r"total_steps=5: .* this run makes 9 \(trainer.num_steps=9, one update "
                                              r"each\), so its last 4 would train nothing"):
            config.check()


def test_schedules_that_keep_training_pass():
    grpo(decaying(10), num_steps=10).check()  # spans the run exactly
    grpo(decaying(4, min_lr_ratio=0.1), num_steps=10).check()  # decays to a floor, then holds it: trains
    grpo(decaying(None), num_steps=10).with_run_schedules().check()  # unset: spans the run
    grpo(RoleConfig(), num_steps=10).check()  # constant


def test_a_custom_workflow_is_not_refused_its_updates_are_not_the_configs_to_count():
    from baton.pipelines.dag import DAGConfig

    config = DAGConfig(actor=decaying(3), rollout=RoleConfig(), data=DataConfig(max_operand=9, num_val_examples=4),
                       trainer=TrainerConfig(num_steps=6, num_prompts_per_step=4, backend="local"))
    with pytest.raises(ConfigError, match="total_steps=3"):  # the default workflow: the loop's updates
        config.check()
    assert config.updates_per_step() == 1
    config.workflow = {"dag_id": "custom", "nodes": []}  # any graph of its own
    assert config.updates_per_step() is None  # the run warns at lr 0 instead (test_lr_at_zero_while_steps_remain)


def test_an_unknown_schedule_name_is_refused_in_the_config():
    with pytest.raises(ValueError, match="scheduler name 'cosin' is not one of 'constant', 'linear', 'cosine'"):
        SchedulerConfig(name="cosin")
