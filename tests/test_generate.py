"""GeneratePipeline (rollout-only data generation): rows per prompt, resumed runs write what an uninterrupted one
does, the rejection-sampling and preference-pair files feed SFT and DPO, and bad settings are refused."""

from __future__ import annotations

import os

import pytest

from baton.config import ConfigError
from baton.datasets.preference import PreferenceDataset
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RoleConfig, SamplingConfig, SFTConfig, TrainerConfig
from baton.pipelines.generate import (GenerateConfig, GeneratePipeline, preference_pairs, read_rows,
                                      rejection_sampling)
from baton.pipelines.sft import SFTPipeline
from baton.strategy import StrategyConfig
from baton.tracking import read_metrics

THIS = "test_generate"  # tests/ is on sys.path: the reward below is importable by path


def odd_length(response: str, ground_truth: str, **fields) -> float:
    """A reward that tells the tiny untrained model's responses apart: 1 for an odd number of characters."""
    return float(len(response) % 2)


def tiny(run_dir, **fields) -> GenerateConfig:
    return GenerateConfig(
        rollout=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2")), reward_fn=f"{THIS}:odd_length",
        data=DataConfig(max_operand=9, num_val_examples=8),
        trainer=TrainerConfig(backend="local", run_dir=str(run_dir), progress_bar=False),
        **{"max_prompts": 6, "num_prompts_per_chunk": 4, "sampling": SamplingConfig(max_new_tokens=3, num_samples_per_prompt=3),
           "sft_output": "rft.jsonl", "dpo_output": "pairs.parquet", **fields})


def test_rows_per_prompt_and_the_sft_and_dpo_files(tmp_path):
    summary = run_pipeline(GeneratePipeline, tiny(tmp_path))
    rows = read_rows(str(tmp_path / "rollouts.jsonl"))
    assert [row["index"] for row in rows] == list(range(6)) and summary["num_prompts"] == 6
    for row in rows:
        assert {"prompt", "answer", "responses", "rewards", "finish_reasons", "log_probs"} <= row.keys()
        assert len(row["responses"]) == len(row["rewards"]) == len(row["log_probs"]) == 3
        assert all(len(lp) <= 3 and all(v <= 0.0 for v in lp) for lp in row["log_probs"])
        assert row["rewards"] == [float(len(text) % 2) for text in row["responses"]]
    assert [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl"))] == [1, 2]  # two chunks: 4 prompts, then 2
    rewards = [r for row in rows for r in row["rewards"]]
    assert summary["generate/reward/mean"] == pytest.approx(sum(rewards) / len(rewards))

    rft, pairs = read_rows(summary["sft_output"]), read_rows(summary["dpo_output"])
    assert rft == rejection_sampling(rows) and pairs == preference_pairs(rows)
    assert summary["num_rows/sft_output"] == len(rft) and summary["num_rows/dpo_output"] == len(pairs)
    assert rft and pairs, "the odd-length reward should give this run both kinds of rows"

    # The same files feed SFT (data.task files, response_key response) and DPO (PreferenceDataset).
    sft = SFTConfig(actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2")),
                    data=DataConfig(task="files", train_path=summary["sft_output"], response_key="response"))
    train, _, _ = SFTPipeline.load_data(sft)
    assert len(train) == len(rft)
    dataset = PreferenceDataset.from_file(summary["dpo_output"])
    assert len(dataset) == len(pairs)


def test_an_interrupted_run_resumes_to_the_same_files(tmp_path, monkeypatch):
    run_pipeline(GeneratePipeline, tiny(tmp_path / "whole", max_prompts=10))
    original = GeneratePipeline.generate_chunk

    def fail_at_step_2(self, step):
        if step == 2:
            raise RuntimeError("interrupted")
        return original(self, step)

    monkeypatch.setattr(GeneratePipeline, "generate_chunk", fail_at_step_2)
    with pytest.raises(RuntimeError, match="interrupted"):
        run_pipeline(GeneratePipeline, tiny(tmp_path / "parts", max_prompts=10))
    monkeypatch.setattr(GeneratePipeline, "generate_chunk", original)
    with pytest.raises(ConfigError, match="previous run"):  # a new run would overwrite it: refused
        run_pipeline(GeneratePipeline, tiny(tmp_path / "parts", max_prompts=10))
    config = tiny(tmp_path / "parts", max_prompts=10)
    config.trainer.resume = "latest"
    summary = run_pipeline(GeneratePipeline, config)
    assert summary["resumed_from_step"] == 1
    for name in ("rollouts.jsonl", "rft.jsonl", "pairs.parquet"):
        assert read_rows(str(tmp_path / "parts" / name)) == read_rows(str(tmp_path / "whole" / name)), name


def test_resuming_with_other_settings_is_refused(tmp_path):
    run_pipeline(GeneratePipeline, tiny(tmp_path))
    config = tiny(tmp_path, sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=4))
    config.trainer.resume = "latest"
    with pytest.raises(ConfigError, match=r"parts made with other settings \(sampling\)"):
        GeneratePipeline(config)


@pytest.mark.parametrize("fields,message", [
    (dict(split="test"), "split 'test' is not one of"),
    (dict(output="rollouts.csv"), r"output 'rollouts.csv' must end in one of \('.jsonl', '.parquet'\)"),
    (dict(dpo_output="rollouts.jsonl"), "dpo_output and output are the same file"),
    (dict(num_prompts_per_chunk=0), "num_prompts_per_chunk=0 must be >= 1"),
])
def test_bad_settings_are_refused_before_anything_starts(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        GeneratePipeline(tiny(tmp_path, **fields))


def test_an_existing_output_outside_the_run_is_not_overwritten(tmp_path):
    kept = tmp_path / "kept.jsonl"
    kept.write_text('{"mine": 1}\n')
    with pytest.raises(ConfigError, match="exists; keep it by choosing another path"):
        GeneratePipeline(tiny(tmp_path / "run", output=str(kept)))
    assert kept.read_text() == '{"mine": 1}\n'


def test_rejection_sampling_and_preference_pairs_by_hand():
    rows = [{"prompt": "1+1=", "answer": "2", "responses": ["2", "3", "2", "22"], "rewards": [1.0, 0.0, 1.0, 0.5]},
            {"prompt": "2+2=", "answer": "4", "responses": ["5", "6"], "rewards": [0.0, 0.0]}]
    assert rejection_sampling(rows) == [{"prompt": "1+1=", "answer": "2", "response": "2", "reward": 1.0}]
    assert rejection_sampling(rows, min_reward=0.5, per_prompt=3) == [
        {"prompt": "1+1=", "answer": "2", "response": "2", "reward": 1.0},
        {"prompt": "1+1=", "answer": "2", "response": "22", "reward": 0.5}]  # the second "2" is a duplicate
    assert preference_pairs(rows) == [{"prompt": "1+1=", "chosen": "2", "rejected": "3", "chosen_reward": 1.0,
                                       "rejected_reward": 0.0}]  # equal rewards: no pair
    assert os.path.basename(__file__) == f"{THIS}.py"
