"""The RLVR paths the README promises beyond plain GRPO: PPO with a critic, a KL loss against a reference, several
epochs and mini-batches (the old log-prob pass), weight sync every k steps; and the example configs, run for 2 steps."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator

import pytest
import torch
import yaml
from safetensors.torch import load_file

from baton.algorithms import (ADV_ESTIMATORS, POLICY_LOSSES, estimator_needs, policy_loss_spec,
                              register_adv_estimator)
from baton.cli import resolve
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import AlgorithmConfig, DataConfig, RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.run_dir import checkpoint_path
from baton.rl import StaleSamplesWarning
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.tracking.tracker import read_metrics

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def length_reward(response: str, ground_truth: str, **fields) -> float:
    """Varies between samples of an untrained model (exact match would score them all 0: no signal, no update)."""
    return float(len(response.strip()) % 3 == 0)


def tiny_rlvr(run_dir, num_steps=3, algorithm=None, **config) -> RLVRConfig:
    role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3)))
    trainer = TrainerConfig(backend="local", run_dir=str(run_dir), num_steps=num_steps, num_prompts_per_step=4,
                            val_every_steps=100, save_every_steps=1, keep_last_checkpoints=10, progress_bar=False,
                            **config.pop("trainer", {}))
    return RLVRConfig(**{"actor": role, "rollout": role, "data": DataConfig(max_operand=9, num_val_examples=4),
                         "sampling": SamplingConfig(max_new_tokens=3, num_samples_per_prompt=4),
                         "algorithm": algorithm or AlgorithmConfig(), "trainer": trainer,
                         "reward_fn": f"{__name__}:length_reward", **config})


def metrics_of(run_dir) -> list[dict]:
    return [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if r["step"] > 0]


def weights(run_dir, step: int, role: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(checkpoint_path(str(run_dir), step), role, "model.safetensors"))


def test_ppo_trains_a_critic_with_gae_and_the_value_loss(tmp_path):
    critic = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", kind="value", optimizer=OptimizerConfig(lr=1e-3)))
    run_pipeline(RLVRPipeline, tiny_rlvr(tmp_path, critic=critic, algorithm=AlgorithmConfig(adv_estimator="gae")))
    records = metrics_of(tmp_path)
    assert all(r["critic/vf_loss"] > 0 and r["critic/grad_norm"] > 0 for r in records)
    assert "timing_s/values" in records[0] and "timing_s/update_critic" in records[0]
    before, after = weights(tmp_path, 1, "critic"), weights(tmp_path, 3, "critic")
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the critic itself was stepped
    assert (tmp_path / "checkpoints" / "step_3" / "critic").is_dir()


def test_a_kl_loss_against_the_reference_is_zero_at_first_and_grows(tmp_path):
    algorithm = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.1)
    run_pipeline(RLVRPipeline, tiny_rlvr(tmp_path, num_steps=3, algorithm=algorithm))
    kl = [r["actor/kl"] for r in metrics_of(tmp_path)]
    assert kl[0] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert kl[-1] > 1e-6  # and moves away from it


def test_several_epochs_and_mini_batches_use_old_log_probs_and_step_off_policy(tmp_path):
    on_policy = tmp_path / "on"
    run_pipeline(RLVRPipeline, tiny_rlvr(on_policy, num_steps=1))
    assert metrics_of(on_policy)[0]["actor/ppo_kl"] == 0.0 and "timing_s/old_log_prob" not in metrics_of(on_policy)[0]

    off_policy = tmp_path / "off"
    algorithm = AlgorithmConfig(num_ppo_epochs=2, num_mini_batches_per_step=2)
    run_pipeline(RLVRPipeline, tiny_rlvr(off_policy, num_steps=1, algorithm=algorithm))
    record = metrics_of(off_policy)[0]
    assert "timing_s/old_log_prob" in record
    assert record["actor/ppo_kl"] != 0.0  # the last of 4 updates sees weights 3 updates past the old log-probs


def test_sync_every_k_steps_syncs_only_on_those_steps_and_measures_the_stale_gap(tmp_path):
    with pytest.warns(StaleSamplesWarning, match="sync_every_steps=2: the rollout samples with weights up to 1 update"):
        run_pipeline(RLVRPipeline, tiny_rlvr(tmp_path, num_steps=4, colocate_actor_rollout=False,
                                             trainer=dict(sync_every_steps=2)))
    records = metrics_of(tmp_path)
    assert [r["step"] for r in records if "timing_s/sync" in r] == [2, 4]
    gap = [r["rollout/logprob_diff/mean"] for r in records]
    # Steps 1 and 3 sample with the actor's weights (numerics only); steps 2 and 4 with weights one update old.
    assert max(gap[0], gap[2]) < 1e-4 < min(gap[1], gap[3]), gap
    assert records[1]["rollout/is_ratio/max"] > 1.0 > records[1]["rollout/is_ratio/min"]


TWO_STEP_DEMO = ["sft.trainer.num_steps=2", "rlvr.trainer.num_steps=2", "data.max_operand=9", "data.num_val_examples=4",
                 *[f"{stage}.trainer.{key}" for stage in ("sft", "rlvr")
                   for key in ("backend=local", "progress_bar=false", "num_prompts_per_step=4")],
                 "rlvr.sampling.num_samples_per_prompt=2"]


@pytest.fixture
def spied() -> Iterator[list[tuple[str, str, dict]]]:
    """Every advantage estimator and policy loss wrapped, for one test, to record each call: (kind, name, keyword
    arguments). Only a call with the local backend (in this process) is seen."""
    calls: list[tuple[str, str, dict]] = []

    def recording(kind: str, name: str, fn):
        @functools.wraps(fn)  # the signature stays the function's: compute_advantages passes what it names
        def wrapper(*args, **kwargs):
            calls.append((kind, name, kwargs))
            return fn(*args, **kwargs)

        return wrapper

    estimators = {name: (ADV_ESTIMATORS.get(name), estimator_needs(name)) for name in ADV_ESTIMATORS.names()}
    losses = {name: policy_loss_spec(name) for name in POLICY_LOSSES.names()}
    registered = {name: ADV_ESTIMATORS.pop(name) for name in estimators}, {
        name: POLICY_LOSSES.pop(name) for name in losses}
    for name, (fn, needs) in estimators.items():
        register_adv_estimator(name, needs)(recording("estimator", name, fn))
    for name, spec in losses.items():
        POLICY_LOSSES[name] = dataclasses.replace(spec, fn=recording("policy_loss", name, spec.fn))
    yield calls
    for registry, entries in zip((ADV_ESTIMATORS, POLICY_LOSSES), registered):
        for name, entry in entries.items():
            registry.pop(name)
            registry[name] = entry


# What each example's path runs, per step: its estimator with these arguments, its policy loss with these.
EXAMPLE_PATHS = {
    "ppo.yaml": ("gae", {"gamma": 1.0, "lam": 1.0}, "vanilla", {"loss_agg_mode": "token-mean"}),
    "dapo.yaml": ("grpo", {"norm_adv_by_std": True}, "vanilla",
                  {"loss_agg_mode": "token-mean", "clip_ratio_low": 0.2, "clip_ratio_high": 0.28}),
    "dr_grpo.yaml": ("grpo", {"norm_adv_by_std": False}, "vanilla",
                     {"loss_agg_mode": "seq-mean-token-sum-norm", "loss_scale_factor": 6.0}),
    "gspo.yaml": ("grpo", {"norm_adv_by_std": True}, "gspo",
                  {"loss_agg_mode": "seq-mean-token-mean", "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}),
    "remax.yaml": ("remax", {}, "vanilla", {"loss_agg_mode": "token-mean"}),
    "gdpo.yaml": ("gdpo", {"reward_weights": [0.2, 1.0]}, "vanilla",
                  {"loss_agg_mode": "token-mean"}),
}


@pytest.mark.parametrize("name", list(EXAMPLE_PATHS))
def test_the_algorithm_examples_run_for_two_steps_with_their_settings(tmp_path, name, spied):
    pipeline_cls, config = resolve(os.path.join(EXAMPLES, name), [*TWO_STEP_DEMO, f"run_dir={tmp_path}"])
    summary = run_pipeline(pipeline_cls, config)
    assert summary["rlvr"]["num_steps"] == 2
    wanted = yaml.safe_load(open(os.path.join(EXAMPLES, name)))["rlvr"]["algorithm"]
    ran = yaml.safe_load(open(tmp_path / "rlvr" / "config.yaml"))["algorithm"]
    assert {k: ran[k] for k in wanted} == wanted  # the stage ran with the example's settings
    estimator, estimator_args, policy_loss, loss_args = EXAMPLE_PATHS[name]
    estimated = [(n, kwargs) for kind, n, kwargs in spied if kind == "estimator"]
    assert [n for n, _ in estimated] == [estimator] * 2  # once a step, the example's estimator
    for _, kwargs in estimated:
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items() if k in estimator_args} == (
            estimator_args)
    losses = [(n, kwargs) for kind, n, kwargs in spied if kind == "policy_loss"]
    assert losses and {n for n, _ in losses} == {policy_loss}  # every update ran the example's policy loss
    for _, kwargs in losses:
        assert {k: kwargs[k] for k in loss_args} == loss_args
    records = metrics_of(tmp_path / "rlvr")
    assert len(records) == 2
    for record, (_, kwargs) in zip(records, estimated):
        if name == "ppo.yaml":  # GAE ran on the critic's values, and the critic was trained
            assert tuple(kwargs["values"].shape) == tuple(kwargs["response_mask"].shape)
            assert record["critic/vf_loss"] > 0
        if name == "remax.yaml":  # the greedy baseline was generated, scored and given to the estimator
            assert "timing_s/gen_max" in record
            assert float(kwargs["reward_baselines"].mean()) == pytest.approx(record["critic/baseline_score/mean"])
        if name == "gdpo.yaml":  # the reward's parts, in gdpo_reward_keys' order, reached the estimator and metrics
            parts = kwargs["reward_components"]  # [rows, 2]: format, correct
            assert parts.shape[1] == 2
            assert float(parts[:, 0].mean()) == pytest.approx(record["reward/format/mean"])
            assert float(parts[:, 1].mean()) == pytest.approx(record["reward/correct/mean"]) == record["critic/score/mean"]
    if name == "ppo.yaml":
        assert (tmp_path / "rlvr" / "checkpoints" / "step_2" / "critic").is_dir()


def test_the_transform_example_runs(tmp_path):
    overrides = ["num_steps=2", "num_rows_per_step=50", "trainer.backend=local", "trainer.progress_bar=false"]
    pipeline_cls, config = resolve(os.path.join(EXAMPLES, "transform.yaml"), [*overrides, f"trainer.run_dir={tmp_path}"])
    summary = run_pipeline(pipeline_cls, config)
    assert summary["rows"] == 100 and summary["accuracy"] == 1.0  # the evaluators compute every sum right


def test_the_transform_examples_progress_is_lines_off_a_terminal(tmp_path, capsys):
    """Its progress goes through baton.tracking.progress as the training loop's does: lines, no carriage returns."""
    overrides = ["num_steps=2", "num_rows_per_step=10", "trainer.backend=local", f"trainer.run_dir={tmp_path}"]
    run_pipeline(*resolve(os.path.join(EXAMPLES, "transform.yaml"), overrides))
    err = capsys.readouterr().err
    assert "transform: step 2/2 (100%)" in err and "\r" not in err, err
