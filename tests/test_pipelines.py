"""The pipelines end to end, in-process: GRPO on the mock and the tiny model, SFT, config errors."""

from __future__ import annotations

import json
import os

import pytest

from baton.cli import resolve
from baton.config import ConfigError
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, SFTConfig, TrainerConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.sft import SFTPipeline
from baton.strategy import StrategyConfig


def small_trainer(run_dir, **kwargs) -> TrainerConfig:
    return TrainerConfig(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, val_every_steps=2,
                         save_every_steps=2, progress_bar=False, **kwargs)


def run(pipeline_cls, config) -> dict:
    pipeline = pipeline_cls(config)
    try:
        return pipeline.run()
    finally:
        pipeline.shutdown()


@pytest.mark.parametrize("strategy", ["mock", "hf"])
def test_grpo_runs_end_to_end(tmp_path, strategy):
    role = RoleConfig(strategy=StrategyConfig(name=strategy, model="tiny-qwen2"))
    config = RLVRConfig(actor=role, rollout=role, colocate_actor_rollout=strategy == "hf",
                        data=DataConfig(max_operand=9, num_val_examples=8),
                        sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                        val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                        trainer=small_trainer(tmp_path, num_steps=2))
    summary = run(RLVRPipeline, config)
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in records] == [0, 1, 2]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr", "response_length/mean",
                "timing_s/gen", "perf/throughput", "val/accuracy"):
        assert key in records[-1], key
    assert 0.0 <= summary["final_val_accuracy"] <= 1.0
    assert os.path.isdir(tmp_path / "checkpoints" / "step_2" / "actor")
    assert os.path.isfile(tmp_path / "summary.json") and os.path.isfile(summary["plot"])


def test_sft_lowers_the_loss_and_keeps_the_last_checkpoints(tmp_path):
    config = SFTConfig(actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2")),
                       data=DataConfig(max_operand=9, num_val_examples=8),
                       trainer=small_trainer(tmp_path, num_steps=6, keep_last_checkpoints=2))
    config.trainer.num_prompts_per_step = 16
    run(SFTPipeline, config)
    losses = [json.loads(line)["sft/loss"] for line in open(tmp_path / "metrics.jsonl") if "sft/loss" in line]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_4", "step_6"]


def test_gae_without_a_critic_is_refused_before_training(tmp_path):
    config = RLVRConfig(trainer=small_trainer(tmp_path, num_steps=1))
    config.algorithm.adv_estimator = "gae"
    with pytest.raises(ValueError, match="adv_estimator 'gae' needs a critic"):
        run(RLVRPipeline, config)


def test_config_typos_name_the_nearest_key():
    with pytest.raises(ConfigError, match="did you mean 'sft.trainer.num_steps'"):
        resolve(None, ["sft.trainer.num_step=3"])
    pipeline_cls, config = resolve(None, ["rlvr.actor.strategy.optimizer.lr=1e-3", "data.max_operand=12"])
    assert config.rlvr.actor.strategy.optimizer.lr == 1e-3 and config.data.max_operand == 12
    with pytest.raises(ConfigError, match="trainer.backend"):
        resolve(None, ["sft.trainer.backend=slurm"])


def test_a_nested_override_keeps_the_parents_defaults_for_that_section():
    # The demo's SFT trainer defaults (64 prompts per step) differ from TrainerConfig's own (32).
    _, config = resolve(None, ["sft.trainer.num_steps=7"])
    assert config.sft.trainer.num_steps == 7
    assert config.sft.trainer.num_prompts_per_step == 64


def test_resume_continues_exactly(tmp_path):
    """4 steps straight, or 2 steps then a resumed run of 2 more: same metrics and same weights."""
    from safetensors.torch import load_file

    def config(run_dir, num_steps, resume=None):
        role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"))
        return RLVRConfig(actor=role, rollout=role, colocate_actor_rollout=True,
                          data=DataConfig(max_operand=9, num_val_examples=8),
                          sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                          val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                          trainer=small_trainer(run_dir, num_steps=num_steps, resume=resume))

    run(RLVRPipeline, config(tmp_path / "straight", 4))
    run(RLVRPipeline, config(tmp_path / "split", 2))
    run(RLVRPipeline, config(tmp_path / "split", 4, resume="latest"))

    def records(run_dir):
        rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        return {r["step"]: {k: v for k, v in r.items() if not k.startswith(("timing_s/", "perf/"))} for r in rows}

    straight, split = records(tmp_path / "straight"), records(tmp_path / "split")
    assert sorted(split) == [0, 1, 2, 3, 4]
    assert split == straight
    weights = [load_file(d / "checkpoints" / "step_4" / "actor" / "model.safetensors")
               for d in (tmp_path / "straight", tmp_path / "split")]
    assert all((weights[0][k] == weights[1][k]).all() for k in weights[0])
