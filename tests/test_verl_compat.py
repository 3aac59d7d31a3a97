"""Coming from verl: a parquet file in verl's exact layout and a reward written with verl's signature train
unchanged, and examples/verl_format.yaml (its shipped data, made by examples/verl_format/make_data.py) runs."""

from __future__ import annotations

import os
import sys

import pyarrow.parquet as pq
import pytest

from baton.cli import resolve
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.strategy import OptimizerConfig, StrategyConfig
from baton.tracking.tracker import read_metrics
from test_pipeline_paths import EXAMPLES, TWO_STEP_DEMO, metrics_of

sys.path.insert(0, os.path.join(EXAMPLES, "verl_format"))
import make_data  # noqa: E402  (examples/verl_format/make_data.py)

VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


def verl_reward(data_source, solution_str, ground_truth, extra_info=None):
    """verl's compute_score signature; the score is the dict's "score", the other fields are logged."""
    assert extra_info["split"] in ("train", "test") and isinstance(extra_info["a"], int)
    digits = solution_str.strip()
    return {"score": float(digits == ground_truth), "length": float(len(digits)), "pred": digits}


def test_a_verl_layout_parquet_trains_two_grpo_steps_with_a_verl_signature_reward(tmp_path):
    rows = make_data.make_rows(max_operand=9, seed=0)
    make_data.write_parquet(str(tmp_path / "train.parquet"), rows[8:], "train")
    make_data.write_parquet(str(tmp_path / "val.parquet"), rows[:8], "test")
    assert pq.read_table(tmp_path / "train.parquet").column_names == VERL_COLUMNS

    role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2", optimizer=OptimizerConfig(lr=1e-3)))
    config = RLVRConfig(
        actor=role, rollout=role, reward_fn=f"{__name__}:verl_reward",
        data=DataConfig(task="files", train_path=str(tmp_path / "train.parquet"), val_path=str(tmp_path / "val.parquet"),
                        answer_key="reward_model.ground_truth", max_prompt_len=24),
        sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=4),
        val_sampling=SamplingConfig(temperature=1.0, max_new_tokens=3, num_samples_per_prompt=2),
        trainer=TrainerConfig(backend="local", run_dir=str(tmp_path / "run"), num_steps=2, num_prompts_per_step=4,
                              val_every_steps=2, save_every_steps=2, progress_bar=False))
    summary = run_pipeline(RLVRPipeline, config)
    assert summary["num_steps"] == 2
    records = metrics_of(tmp_path / "run")
    assert all(0 <= r["critic/score/mean"] <= 1 and r["reward/length/mean"] > 0 for r in records[:2])
    validation = [r for r in records if any(k.startswith("val-core/") for k in r)][-1]
    for source in ("arithmetic/add", "arithmetic/sub"):  # both sources in 8 held-out rows of seed 0
        assert 0 <= validation[f"val-core/{source}/reward/mean@2"] <= 1


def test_the_verl_format_example_runs_for_two_steps_on_its_shipped_data(tmp_path):
    for name in ("train.parquet", "val.parquet"):  # the shipped files are the script's output
        rows = pq.read_table(os.path.join(EXAMPLES, "verl_format", name)).to_pylist()
        assert rows[0]["prompt"][0]["role"] == "user" and set(rows[0]) == set(VERL_COLUMNS)
    make_data.write_parquet(str(tmp_path / "train.parquet"), make_data.make_rows(30, 0)[200:], "train")
    assert pq.read_table(tmp_path / "train.parquet").equals(pq.read_table(os.path.join(EXAMPLES, "verl_format",
                                                                                       "train.parquet")))
    overrides = [o for o in TWO_STEP_DEMO if not o.startswith("data.")]
    pipeline_cls, config = resolve(os.path.join(EXAMPLES, "verl_format.yaml"), [*overrides, f"run_dir={tmp_path / 'run'}"])
    summary = run_pipeline(pipeline_cls, config)
    assert summary["rlvr"]["num_steps"] == 2
    records = metrics_of(tmp_path / "run" / "rlvr")
    for r in records[:2]:  # the reward is the verl function's score plus DAPO's overlong penalty (0 or less)
        assert r["critic/score/mean"] == pytest.approx(r["reward/acc/mean"] + r["reward/overlong_reward/mean"])
        assert r["reward/overlong_reward/mean"] <= 0 and 0 <= r["reward/overlong/mean"] <= 1
    validation = read_metrics(os.path.join(tmp_path, "run", "rlvr", "metrics.jsonl"))[-1]
    assert {f"val-core/arithmetic/{op}/acc/{m}@4" for op in ("add", "sub") for m in ("mean", "best", "maj")} <= {
        k.removesuffix("/mean") for k in validation}
