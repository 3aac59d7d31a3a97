"""Being told when training goes wrong: an lr schedule that ends before the run is refused where the config says so,
and the health monitor warns (once per kind, with a cause and a hint) on held-out accuracy falling, entropy collapsing,
KL or the rollout log-prob gap blowing up, grad-norm spikes, non-finite losses and an lr at 0 while steps remain."""

from __future__ import annotations

import os

import pytest

from baton.cli import main
from baton.config import ConfigError
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SFTConfig, TrainerConfig
from baton.strategy import OptimizerConfig, SchedulerConfig, StrategyConfig
from baton.tracking.health import HealthMonitor

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
    """The issue's case: the own-task example's GRPO stage (cosine over 150 updates then, 100 now) given 300 steps
    left the lr at 0 for the rest, and `baton config` said the checks passed."""
    assert main(["config", os.path.join(EXAMPLES, "reverse", "config.yaml"), "rlvr.trainer.num_steps=300"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert ("rlvr stage: actor.strategy.scheduler.total_steps=100: the cosine decay reaches lr 0 after 100 updates, but "
            "this run makes 300 (trainer.num_steps=300 × 1 per step), so its last 200 would train nothing; set "
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


# --- the health monitor: each warning on a synthetic metric stream --------------------------------------------------

def watch(stream: list[dict[str, float]], num_steps: int | None = None, first_val: dict | None = None) -> dict:
    """Each step's metrics (step 1, 2, ...) through one monitor; {step: the health metrics it returned}, steps with
    none left out."""
    monitor = HealthMonitor(num_steps or len(stream))
    found = {step: monitor.check(step, metrics, first_val) for step, metrics in enumerate(stream, start=1)}
    return {step: health for step, health in found.items() if health}


def healthy_grpo_step(step: int) -> dict[str, float]:
    """A GRPO step as a healthy run logs it: noisy grad norms (0 where no group had signal), entropy falling by half
    over the run, a small KL, the lr of a cosine decay that ends with the run, accuracy rising with a dip."""
    metrics = {"critic/score/mean": 0.5, "actor/pg_loss": 0.01, "actor/loss": 0.01, "actor/entropy": 2.0 - step / 50,
               "actor/grad_norm": [0.0, 1.3, 0.7, 2.9, 1.1, 0.0, 4.0, 0.9][step % 8], "actor/ppo_kl": 0.002,
               "actor/kl": 0.05, "rollout/logprob_diff/mean": 0.01, "actor/lr": 3e-4 * (1 - (step - 1) / 50)}
    if step % 10 == 0:
        metrics["val/accuracy"] = {10: 0.62, 20: 0.55, 30: 0.66, 40: 0.71, 50: 0.74}[step]
    return metrics


def test_a_healthy_stream_warns_nothing(capsys):
    assert watch([healthy_grpo_step(step) for step in range(1, 51)], first_val={"val/accuracy": 0.6}) == {}
    assert capsys.readouterr().err == ""


def test_accuracy_falling_well_below_the_start_warns_once_with_the_lr_hint(capsys):
    vals = [0.75, 0.55, 0.7, 0.55, 0.5, 0.4, 0.3]  # floor 0.8 - max(0.1, 0.2) = 0.6; one dip alone is not enough
    stream = [{"actor/loss": 0.1, "val/accuracy": value} for value in vals]
    assert watch(stream, first_val={"val/accuracy": 0.8}) == {5: {"health/accuracy_drop": 1.0}}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("baton: warning: step 5: held-out accuracy fell from 0.800 at the "
                                                   "start of this stage to 0.550, 0.500 in the last two validations")
    assert "lower actor.strategy.optimizer.lr, e.g. by 3x (GRPO on a new task: start near" in err


def test_without_accuracy_the_mean_validation_reward_is_watched_from_the_first_validation():
    stream = [{"val/reward/mean": value} for value in (2.0, 1.9, 1.4, 1.3)]  # no val before training: 2.0 is the start
    assert watch(stream) == {4: {"health/accuracy_drop": 1.0}}  # floor 2.0 - max(0.1, 0.5) = 1.5


def test_entropy_collapsing_warns_after_three_steps_below_a_tenth_of_its_first_value():
    entropies = [2.0, 0.5, 0.19, 0.15, 0.3, 0.1, 0.1, 0.1, 0.05]
    assert watch([{"actor/pg_loss": 0.0, "actor/entropy": value} for value in entropies]) == {
        8: {"health/entropy_collapse": 1.0}}
    assert watch([{"distill/loss": 0.1, "actor/entropy": value} for value in entropies]) == {}  # not a policy gradient


@pytest.mark.parametrize("key, value, says", [
    ("actor/kl", 1.5, "the policy is moving too far: actor/kl = 1.5 (limit 1)"),
    ("actor/reward_kl_penalty", 3.0, "the policy is moving too far"),
    ("actor/ppo_kl", 0.4, "actor/ppo_kl = 0.4 (limit 0.1)"),
    ("rollout/logprob_diff/mean", 0.9, "the actor's log-probs of the rollout's samples are far from the rollout's own"),
])
def test_kl_or_the_rollout_gap_blowing_up_warns_once(capsys, key, value, says):
    stream = [{key: 0.01}, {key: 0.02}, {key: value}, {key: value * 2}]
    assert watch(stream) == {3: {"health/kl_blowup": 1.0}}
    assert says in capsys.readouterr().err


def test_grad_norm_spikes_over_the_running_median_warn_when_they_repeat_not_a_nan_and_not_a_step_after_zeros():
    norms = [1.0, 0.0, 1.2, 0.8, 0.0, 0.0, 1.1, 0.9, 9.0, float("nan"), 1.0, 25.0, 30.0]  # median of nonzero: 1.0
    found = watch([{"actor/grad_norm": norm} for norm in norms])
    assert found == {10: {"health/not_finite": 1.0}, 13: {"health/grad_norm_spike": 1.0}}  # the second spike
    # one spike (a loss leaving a plateau, as in the demo's SFT), or two 50 steps apart: clipping bounds each
    assert watch([{"actor/grad_norm": norm} for norm in [1.0] * 10 + [25.0] + [1.0] * 10]) == {}
    assert watch([{"actor/grad_norm": norm} for norm in [1.0] * 10 + [25.0] + [1.0] * 49 + [25.0]]) == {}


def test_a_non_finite_loss_warns():
    assert watch([{"sft/loss": 1.0}, {"sft/loss": float("inf")}]) == {2: {"health/not_finite": 1.0}}


def test_lr_at_zero_while_steps_remain(capsys):
    """What `baton config` cannot refuse (a custom workflow's updates): the run says so when it sees lr 0."""
    stream = [{"actor/lr": 1e-3}, {"actor/lr": 5e-4}, {"actor/lr": 0.0}, {"actor/lr": 0.0}, {"actor/lr": 0.0}]
    assert watch(stream) == {3: {"health/lr_schedule_ended": 1.0}}
    assert "actor/lr is 0 with 2 of 5 steps left: the lr schedule (actor.strategy.scheduler) ended" in (
        capsys.readouterr().err)
    assert watch([{"actor/lr": 1e-3}, {"actor/lr": 0.0}]) == {}  # the last step: no step left to lose


# --- end to end: a too-high lr collapses held-out accuracy; the same task at a good lr warns nothing ---------------

def test_grpo_at_a_destructive_lr_is_told_its_accuracy_fell_and_a_good_lr_is_told_nothing(tmp_path, capfd):
    import torch

    from baton.pipelines.base import run_pipeline
    from baton.pipelines.rlvr import RLVRPipeline
    from baton.tracking import run_metrics
    from test_learning import rl_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        good = rl_config(RLVRConfig, tmp_path, seed=0, num_steps=20, lr=3e-3, run="good")  # 0.21 -> 0.96
        run_pipeline(RLVRPipeline, good)
        healthy = run_metrics(str(tmp_path / "good"))
        assert not [key for metrics in healthy.values() for key in metrics if key.startswith("health/")]
        assert "baton: warning" not in capfd.readouterr().err
        start = healthy[20]["val/accuracy"]
        assert start > 0.8

        checkpoint = str(tmp_path / "good" / "checkpoints" / "step_20" / "actor")
        bad = rl_config(RLVRConfig, tmp_path, seed=0, num_steps=4, lr=1.0, run="bad")
        bad.actor.strategy.model = bad.rollout.strategy.model = checkpoint
        bad.trainer.val_every_steps = 1
        run_pipeline(RLVRPipeline, bad)
    finally:
        torch.set_num_threads(threads)
    steps = run_metrics(str(tmp_path / "bad"))
    assert steps[0]["val/accuracy"] == pytest.approx(start)
    warned = [step for step in steps if steps[step].get("health/accuracy_drop")]
    assert warned == [2], {step: steps[step].get("val/accuracy") for step in steps}
    assert f"baton: warning: step 2: held-out accuracy fell from {start:.3f}" in capfd.readouterr().err


def test_a_monitors_state_carries_what_it_warned_of_and_its_running_figures():
    first = HealthMonitor(num_steps=10)
    for step, norm in enumerate([1.0, 1.2, 0.9, 1.1, 1.0, 50.0], 1):  # a first spike at step 6: no warning yet
        assert "health/grad_norm_spike" not in first.check(step, {"actor/grad_norm": norm,
                                                                   "actor/loss": float("nan") if step == 5 else 0.1})
    again = HealthMonitor(num_steps=10)
    again.load_state_dict(first.state_dict())
    assert again.check(7, {"actor/loss": float("nan")}) == {}  # warned before the resume: not again
    # the median and the first spike came along: the second spike warns
    assert again.check(8, {"actor/grad_norm": 60.0}) == {"health/grad_norm_spike": 1.0}


def test_a_resumed_run_does_not_warn_again_of_what_it_warned_before(tmp_path, monkeypatch):
    """Every step looks non-finite here (the check patched): the warning comes once, at step 1, and the run resumed
    from step 2's checkpoint goes on without it, since the monitor's state is in the checkpoint."""
    from baton.pipelines.base import run_pipeline
    from baton.pipelines.rlvr import RLVRPipeline
    from baton.pipelines.config import SamplingConfig
    from baton.tracking import run_metrics

    monkeypatch.setattr(HealthMonitor, "_not_finite", lambda self, metrics: "a loss is NaN (patched)")
    role = RoleConfig(strategy=StrategyConfig(name="mock"))

    def config(num_steps, **trainer):
        return RLVRConfig(actor=role, rollout=role, data=DataConfig(max_operand=9, num_val_examples=4),
                          sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                          trainer=TrainerConfig(backend="local", run_dir=str(tmp_path), num_prompts_per_step=4,
                                                num_steps=num_steps, val_every_steps=100, save_every_steps=2,
                                                progress_bar=False, **trainer))

    run_pipeline(RLVRPipeline, config(2))
    run_pipeline(RLVRPipeline, config(4, resume="latest"))
    steps = run_metrics(str(tmp_path))
    assert [step for step in sorted(steps) if "health/not_finite" in steps[step]] == [1]
