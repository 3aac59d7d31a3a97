"""The Tracker's sinks: metrics.jsonl and samples.jsonl always (kept up to the resumed step on a resume, removed by
overwrite=true), and the optional tensorboard, wandb and mlflow sinks read back from what their packages wrote."""

from __future__ import annotations

import os

import pytest

from baton.pipelines.run_dir import previous_run, remove_previous_run
from baton.tracking import Tracker, run_samples

ROWS = [{"step": 0, "split": "val", "prompt": "2+3=", "response": "5", "ground_truth": "5", "reward": 1.0,
         "source": "val.jsonl"},
        {"step": 0, "split": "val", "prompt": "4+4=", "response": "9 | 1\nx", "ground_truth": "8", "reward": 0.0},
        {"step": 0, "split": "train", "prompt": "1+1=", "response": "2", "ground_truth": None, "reward": None}]


def test_log_samples_writes_one_json_line_per_row_with_the_step(tmp_path):
    tracker = Tracker(str(tmp_path))
    tracker.log_samples(ROWS, step=3)
    tracker.log_samples([{**ROWS[0], "reward": float("nan")}], step=4)
    tracker.close()
    rows = run_samples(str(tmp_path))
    assert [r["step"] for r in rows] == [3, 3, 3, 4]
    assert rows[0] == {**ROWS[0], "step": 3}  # the extra key is kept
    assert rows[2]["ground_truth"] is None and rows[2]["split"] == "train"
    assert rows[3]["reward"] is None  # NaN is not JSON


def test_a_resumed_run_keeps_the_samples_up_to_its_checkpoint_and_appends(tmp_path):
    tracker = Tracker(str(tmp_path))
    for step in (2, 4, 6):
        tracker.log_samples(ROWS[:1], step=step)
    tracker.close()  # interrupted after step 6; the last checkpoint is step 4
    tracker = Tracker(str(tmp_path), resumed_from_step=4)
    tracker.log_samples(ROWS[:1], step=6)
    tracker.close()
    assert [r["step"] for r in run_samples(str(tmp_path))] == [2, 4, 6]


def test_samples_jsonl_is_a_previous_runs_record_and_overwrite_removes_it(tmp_path):
    tracker = Tracker(str(tmp_path))
    tracker.log_samples(ROWS, step=1)
    tracker.close()
    os.remove(tmp_path / "metrics.jsonl")  # only the samples show that a run wrote here
    assert previous_run(str(tmp_path)) == ["samples.jsonl"]
    remove_previous_run(str(tmp_path))
    assert not (tmp_path / "samples.jsonl").exists() and previous_run(str(tmp_path)) == []
