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
from baton.rewards import overlong_penalty
from baton.tracking import read_metrics, run_metrics
from test_pipeline_paths import EXAMPLES, TWO_STEP_DEMO

sys.path.insert(0, os.path.join(EXAMPLES, "verl_format"))
import make_data  # noqa: E402  (examples/verl_format/make_data.py)

VERL_COLUMNS = ["data_source", "prompt", "ability", "reward_model", "extra_info"]


SCORED: list[tuple[str, str, float, float]] = []  # (split, data_source, score, length) of each row verl_reward scored


def verl_reward(data_source, solution_str, ground_truth, extra_info=None):
    """verl's compute_score signature; the score is the dict's "score", the other fields are logged. The score is
    the parity of the response's character codes (or 1 for the right answer): it varies on an untrained model."""
    assert extra_info["split"] in ("train", "test") and isinstance(extra_info["a"], int)
    digits = solution_str.strip()
    score = float(digits == ground_truth or sum(map(ord, solution_str)) % 2 == 0)
    SCORED.append((extra_info["split"], data_source, score, float(len(digits))))
    return {"score": score, "length": float(len(digits)), "pred": digits}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


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
    SCORED.clear()
    summary = run_pipeline(RLVRPipeline, config)
    assert summary["num_steps"] == 2
    steps = run_metrics(str(tmp_path / "run"))
    train = [row for row in SCORED if row[0] == "train"]
    test = [row for row in SCORED if row[0] == "test"]
    assert len(train) == 2 * 16 and len(test) == 2 * 16  # 4 prompts × 4 a step; 8 held-out × 2, before and after
    for step in (1, 2):  # each step's score and the reward's own field, over the step's 16 rows
        rows = train[(step - 1) * 16:step * 16]
        assert steps[step]["critic/score/mean"] == pytest.approx(mean(r[2] for r in rows))
        assert steps[step]["reward/length/mean"] == pytest.approx(mean(r[3] for r in rows))
    assert 0 < mean(r[2] for r in train) < 1  # the scores vary
    for source in ("arithmetic/add", "arithmetic/sub"):  # both sources in 8 held-out rows of seed 0
        for step, rows in ((0, test[:16]), (2, test[16:])):
            assert steps[step][f"val-core/{source}/reward/mean@2"] == pytest.approx(
                mean(r[2] for r in rows if r[1] == source)), (step, source)


def test_the_verl_format_example_runs_for_two_steps_on_its_shipped_data(tmp_path, monkeypatch):
    for name in ("train.parquet", "val.parquet"):  # the shipped files are the script's output
        rows = pq.read_table(os.path.join(EXAMPLES, "verl_format", name)).to_pylist()
        assert rows[0]["prompt"][0]["role"] == "user" and set(rows[0]) == set(VERL_COLUMNS)
    make_data.write_parquet(str(tmp_path / "train.parquet"), make_data.make_rows(30, 0)[200:], "train")
    assert pq.read_table(tmp_path / "train.parquet").equals(pq.read_table(os.path.join(EXAMPLES, "verl_format",
                                                                                       "train.parquet")))
    overrides = [o for o in TWO_STEP_DEMO if not o.startswith("data.")]
    pipeline_cls, config = resolve(os.path.join(EXAMPLES, "verl_format.yaml"), [*overrides, f"run_dir={tmp_path / 'run'}"])
    penalties = []  # (response lengths, penalty) of each training step's rows

    def recorded_penalty(lengths, max_response_len, buffer_len, penalty_factor):
        penalty = overlong_penalty(lengths, max_response_len, buffer_len, penalty_factor)
        penalties.append((lengths.tolist(), penalty.tolist()))
        return penalty

    monkeypatch.setattr("baton.workers.roles.overlong_penalty", recorded_penalty)
    summary = run_pipeline(pipeline_cls, config)
    assert summary["rlvr"]["num_steps"] == 2
    steps = run_metrics(str(tmp_path / "run" / "rlvr"))
    assert len(penalties) == 2  # one call a training step (validation is not penalised)
    for step, (lengths, penalty) in zip((1, 2), penalties):
        # max_new_tokens 6, a buffer of 2, factor 1: 0 up to 4 tokens, then -0.5 a token
        assert penalty == [min(0.0, -(n - 4) / 2) for n in lengths]
        r = steps[step]  # the reward is the verl function's score plus DAPO's overlong penalty
        assert r["critic/score/mean"] == pytest.approx(r["reward/acc/mean"] + r["reward/overlong_reward/mean"])
        assert r["reward/overlong_reward/mean"] == pytest.approx(mean(penalty))
        assert r["reward/overlong/mean"] == pytest.approx(mean(p < 0 for p in penalty))
    validation = read_metrics(os.path.join(tmp_path, "run", "rlvr", "metrics.jsonl"))[-1]
    assert {f"val-core/arithmetic/{op}/acc/{m}@4" for op in ("add", "sub") for m in ("mean", "best", "maj")} <= {
        k.removesuffix("/mean") for k in validation}
