"""A new run never writes over a previous run in its run_dir: refused with the three ways on, replaced only with
`overwrite=true` (which leaves no stale checkpoint for a later resume), continued with `resume=latest`."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from baton.cli import main, resolve
from baton.config import ConfigError
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.run_dir import list_checkpoints
from baton.recipes.demo import DemoPipeline
from baton.strategy import StrategyConfig
from baton.tracking import read_metrics

MOCK = ["actor.strategy.name=mock", "rollout.strategy.name=mock", "data.max_operand=9", "data.num_val_examples=8",
        "sampling.max_new_tokens=3", "sampling.num_samples_per_prompt=2", "trainer.backend=local",
        "trainer.num_prompts_per_step=4", "trainer.progress_bar=false"]


def mock_grpo(run_dir, **trainer) -> RLVRConfig:
    role = RoleConfig(strategy=StrategyConfig(name="mock"))
    settings = dict(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, val_every_steps=2,
                    save_every_steps=2, progress_bar=False)
    return RLVRConfig(actor=role, rollout=role, data=DataConfig(max_operand=9, num_val_examples=8),
                      sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                      trainer=TrainerConfig(**{**settings, **trainer}))


def snapshot(root) -> dict[str, bytes]:
    """Every file under `root` with its contents."""
    return {os.path.relpath(os.path.join(d, name), root): open(os.path.join(d, name), "rb").read()
            for d, _, names in os.walk(root) for name in names}


def steps_logged(run_dir) -> list[int]:
    return [record["step"] for record in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]


def test_a_new_run_into_a_previous_runs_directory_is_refused_and_changes_nothing(tmp_path):
    run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=4))
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as info:
        run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=4, seed=1))
    assert str(info.value) == (
        f"trainer.run_dir {str(tmp_path)!r} holds a previous run (metrics.jsonl, samples.jsonl, summary.json, "
        "checkpoints/step_2, step_4), which a new run would overwrite. Continue it with trainer.resume=latest, keep it "
        "by choosing another trainer.run_dir=..., or replace it with trainer.overwrite=true")
    assert snapshot(tmp_path) == before


def test_the_cli_prints_the_refusal_in_one_line_without_a_traceback(tmp_path, capsys):
    command = ["run", "pipeline_cls=baton.pipelines.rlvr:RLVRPipeline", *MOCK, "trainer.num_steps=2",
               f"trainer.run_dir={tmp_path}"]
    assert main(command) == 0
    capsys.readouterr()
    assert main(command) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"baton: error: trainer.run_dir {str(tmp_path)!r} holds a previous run (")
    assert "trainer.resume=latest" in err and "trainer.overwrite=true" in err and "Traceback" not in err


def test_a_run_that_stopped_before_its_first_record_is_no_previous_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")  # what a run that failed while building its workers leaves
    (tmp_path / "error.log").write_text("an earlier failure\n")
    summary = run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=2))
    assert summary["num_steps"] == 2 and (tmp_path / "error.log").read_text() == "an earlier failure\n"


def test_overwrite_replaces_the_run_and_leaves_no_checkpoint_of_it_to_resume(tmp_path, capsys):
    run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=6))
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["step_4", "step_6"]
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "checkpoints" / "step_7.partial").mkdir()  # a save that was cut short
    (tmp_path / "tensorboard").mkdir()  # what the tensorboard sink wrote
    (tmp_path / "tensorboard" / "events.out.tfevents.1.old").write_bytes(b"old")
    capsys.readouterr()

    run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=2, overwrite=True))
    err = capsys.readouterr().err
    assert (f"baton: overwrite=true: removed the previous run's metrics.jsonl, samples.jsonl, summary.json, "
            f"metrics.png, tensorboard/, checkpoints (step_4, step_6, step_7.partial) from {tmp_path}") in err
    assert not (tmp_path / "tensorboard").exists()  # this run logs to jsonl only
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_2"]
    assert steps_logged(tmp_path) == [0, 1, 2]
    assert json.loads((tmp_path / "summary.json").read_text())["num_steps"] == 2
    assert (tmp_path / "notes.txt").read_text() == "mine"

    resumed = run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=3, resume="latest"))
    assert resumed["resumed_from_step"] == 2  # the new run's checkpoint, not the old run's step_6
    assert steps_logged(tmp_path) == [0, 1, 2, 3]


def test_resume_latest_into_a_new_directory_starts_fresh_and_into_a_run_continues_it(tmp_path):
    fresh = run_pipeline(RLVRPipeline, mock_grpo(tmp_path / "new", num_steps=2, resume="latest"))
    assert "resumed_from_step" not in fresh and steps_logged(tmp_path / "new") == [0, 1, 2]
    resumed = run_pipeline(RLVRPipeline, mock_grpo(tmp_path / "new", num_steps=4, resume="latest"))
    assert resumed["resumed_from_step"] == 2 and steps_logged(tmp_path / "new") == [0, 1, 2, 3, 4]


def test_overwrite_and_resume_together_are_refused():
    with pytest.raises(ConfigError, match="trainer.overwrite=true would remove the run that trainer.resume='latest' "
                                          "continues; set one of them"):
        resolve(None, ["pipeline_cls=baton.pipelines.rlvr:RLVRPipeline", "trainer.overwrite=true",
                       "trainer.resume=latest"])
    with pytest.raises(ConfigError, match="rlvr stage: overwrite=true would remove the run that resume='latest'"):
        resolve(None, ["rlvr.trainer.overwrite=true", "resume=latest"])


def tiny_demo(run_dir, *extra):
    settings = [f"run_dir={run_dir}", "data.max_operand=9", "data.num_val_examples=8", "sft.trainer.num_steps=1",
                "rlvr.trainer.num_steps=1", "rlvr.sampling.num_samples_per_prompt=2", "rlvr.sampling.max_new_tokens=3"]
    for stage in ("sft", "rlvr"):
        settings += [f"{stage}.trainer.backend=local", f"{stage}.trainer.progress_bar=false",
                     f"{stage}.trainer.num_prompts_per_step=4", f"{stage}.trainer.val_before_train=false"]
    return resolve(None, settings + list(extra))[1]


def test_the_demo_run_twice_is_refused_before_its_sft_stage_trains(tmp_path, capsys):
    run_pipeline(DemoPipeline, tiny_demo(tmp_path))
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as info:
        DemoPipeline(tiny_demo(tmp_path))
    assert str(info.value) == (
        f"run_dir {str(tmp_path)!r} holds a previous run (sft/metrics.jsonl, sft/samples.jsonl, sft/summary.json, "
        "sft/checkpoints/step_1, rlvr/metrics.jsonl, rlvr/samples.jsonl, rlvr/summary.json, rlvr/checkpoints/step_1, "
        "summary.json), which a new run would overwrite. Continue it with resume=latest, keep it by choosing another "
        "run_dir=..., or replace it with overwrite=true")
    assert snapshot(tmp_path) == before

    shutil.rmtree(tmp_path / "sft")  # the second stage's run alone is refused too, before the first stage runs
    with pytest.raises(ConfigError, match=r"holds a previous run \(rlvr/metrics.jsonl, rlvr/samples.jsonl, "
                                          r"rlvr/summary.json, rlvr/checkpoints/step_1, summary.json\)"):
        DemoPipeline(tiny_demo(tmp_path))
    assert not (tmp_path / "sft").exists()

    (tmp_path / "notes.txt").write_text("mine")
    capsys.readouterr()
    DemoPipeline(tiny_demo(tmp_path, "overwrite=true"))  # both stages are cleared before the first runs
    assert ("removed the previous run's metrics.jsonl, samples.jsonl, summary.json, metrics.png, checkpoints (step_1)"
            in capsys.readouterr().err)
    # What the new run writes before it trains (its config, and import_dirs.txt where earlier tests left import
    # directories on sys.path) stays; the old run's outputs are gone and the user's file is kept.
    assert sorted(p for p in snapshot(tmp_path) if p != "rlvr/import_dirs.txt") == ["notes.txt", "rlvr/config.yaml"]
