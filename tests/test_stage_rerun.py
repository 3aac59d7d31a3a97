"""One stage of a two-stage config run alone (`baton run CONFIG --stage rlvr --init-from runs/x/sft`), what is refused
before anything starts, and what a failed run advises."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from baton.cli import main, rerun_advice, resolve
from baton.pipelines.run_dir import list_checkpoints
from baton.recipes.demo import DemoPipeline
from baton.tracking import run_metrics


def tiny(run_dir) -> list[str]:
    """The demo on tiny settings (as tests/test_pipelines.py's resumed demo): 2 SFT steps, 1 GRPO step."""
    settings = [f"run_dir={run_dir}", "data.max_operand=9", "data.num_val_examples=8"]
    for stage in ("sft", "rlvr"):
        settings += [f"{stage}.trainer.backend=local", f"{stage}.trainer.progress_bar=false",
                     f"{stage}.trainer.num_prompts_per_step=4", f"{stage}.trainer.save_every_steps=1"]
    return settings + ["sft.trainer.num_steps=2", "rlvr.sampling.num_samples_per_prompt=2",
                       "rlvr.sampling.max_new_tokens=3", "rlvr.trainer.num_steps=1"]


def stage_model(stage_dir) -> str:
    """The actor model that the stage's own config.yaml records."""
    import yaml

    with open(os.path.join(stage_dir, "config.yaml")) as f:
        return yaml.safe_load(f)["actor"]["strategy"]["model"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    """A run directory whose sft stage ran alone (`--stage sft`)."""
    run_dir = tmp_path_factory.mktemp("first")
    assert main(["run", "--stage", "sft", *tiny(run_dir)]) == 0
    return run_dir


def test_the_sft_stage_runs_alone_and_writes_only_its_own_directory(sft_run):
    assert sorted(os.listdir(sft_run)) == ["sft"]
    assert [os.path.basename(p) for p in list_checkpoints(str(sft_run / "sft"))] == ["step_1", "step_2"]


def test_the_rlvr_stage_reruns_alone_from_another_runs_sft_checkpoint(sft_run, tmp_path, capsys):
    sft_metrics = run_metrics(str(sft_run / "sft"))
    for lr in ("1e-4", "3e-4"):  # two tuning attempts, each its own run directory, SFT never run again
        run_dir = tmp_path / f"lr{lr}"
        code = main(["run", "--stage", "rlvr", "--init-from", str(sft_run / "sft"), *tiny(run_dir),
                     f"rlvr.actor.strategy.optimizer.lr={lr}"])
        assert code == 0, capsys.readouterr().err
        assert sorted(os.listdir(run_dir)) == ["rlvr"]
        assert sorted(run_metrics(str(run_dir / "rlvr"))) == [0, 1]
        assert stage_model(run_dir / "rlvr") == str(sft_run / "sft" / "checkpoints" / "step_2" / "actor")
        summary = json.loads(capsys.readouterr().out)
        assert summary["start_val_accuracy"] is not None and summary["num_steps"] == 1
    assert run_metrics(str(sft_run / "sft")) == sft_metrics and len(sft_metrics) == 3  # not run again


def test_the_rlvr_stage_alone_starts_from_the_runs_own_sft_or_a_given_checkpoint(sft_run, tmp_path):
    step_1 = sft_run / "sft" / "checkpoints" / "step_1"
    for init_from, expected in [([], "step_2"), (["--init-from", str(step_1)], "step_1"),
                                (["--init-from", str(step_1 / "actor")], "step_1"),
                                (["--init-from", str(sft_run)], "step_2")]:  # a two-stage run directory: its sft's
        _, config = resolve(None, tiny(sft_run), "rlvr", init_from[1] if init_from else None)
        checkpoint = DemoPipeline.start_checkpoint(config, "rlvr")
        assert checkpoint == str(sft_run / "sft" / "checkpoints" / expected / "actor")


def test_a_stage_rerun_into_its_own_directory_is_refused_until_overwrite_which_clears_that_stage_only(
        sft_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(sft_run / "sft", run_dir / "sft")
    sft_files = sorted(os.listdir(run_dir / "sft"))
    assert main(["run", "--stage", "rlvr", *tiny(run_dir)]) == 0  # from the run's own sft stage
    assert stage_model(run_dir / "rlvr") == str(run_dir / "sft" / "checkpoints" / "step_2" / "actor")
    capsys.readouterr()
    assert main(["run", "--stage", "rlvr", *tiny(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "holds a previous run (rlvr/metrics.jsonl" in err and "sft/" not in err, err
    assert main(["run", "--stage", "rlvr", *tiny(run_dir), "overwrite=true"]) == 0
    assert sorted(os.listdir(run_dir / "sft")) == sft_files and sorted(run_metrics(str(run_dir / "rlvr"))) == [0, 1]


@pytest.mark.parametrize("args, message", [
    (["--stage", "grpo"], "only_stage (--stage) 'grpo' is not a stage of this config; its stages are sft, rlvr"),
    (["--init-from", "runs/x/sft"], "is the checkpoint the rlvr stage starts from; run that stage alone with --stage rlvr"),
    (["--stage", "sft", "--init-from", "runs/x/sft"], "set sft.actor.strategy.model to start the sft stage"),
    (["--stage", "rlvr", "--init-from", "{tmp}/missing"], "is not a directory"),
    (["--stage", "rlvr", "--init-from", "{tmp}"], "holds no checkpoint (no checkpoints/step_N, no actor directory"),
    (["--stage", "rlvr"], "no checkpoint in {tmp}/sft (this run's sft stage) to start the rlvr stage from; run the sft "
                          "stage first (--stage sft), or give the checkpoint with --init-from"),
    (["--stage", "rlvr", "pipeline_cls=baton.pipelines.rlvr:RLVRPipeline"], "--stage: baton.pipelines.rlvr:RLVRPipeline "
                                                                             "runs a single stage"),
])
def test_a_stage_rerun_that_cannot_run_is_refused_in_one_line(tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main(["config", *args, f"run_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("baton: error: ") and err.count("\n") == 1, err
    assert message.replace("{tmp}", str(tmp_path)) in err
    assert os.listdir(tmp_path) == []


def test_a_failed_second_stage_without_a_checkpoint_is_rerun_alone_not_resumed(sft_run, tmp_path):
    # The sft stage finished (its summary and checkpoints); rlvr failed before its first checkpoint.
    (sft_run / "sft" / "summary.json").exists() or pytest.fail("the sft stage wrote no summary")
    _, config = resolve(None, tiny(sft_run))
    advice = rerun_advice(config)
    assert "resume=latest" not in advice and "--stage rlvr overwrite=true" in advice
    _, single = resolve(None, ["pipeline_cls=baton.pipelines.sft:SFTPipeline", f"trainer.run_dir={sft_run / 'sft'}"])
    assert rerun_advice(single) == ("rerun the same command with trainer.resume=latest (it continues from "
                                    f"{os.path.join('checkpoints', 'step_2')})")
    _, empty = resolve(None, tiny(tmp_path))
    assert rerun_advice(empty) == "rerun the same command"


def test_the_own_task_example_checks_a_stage_rerun_written_as_its_docs_write_it(sft_run, tmp_path, capsys):
    # Options between the config and the overrides, as docs/own-task.md and examples/reverse/config.yaml give them.
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "reverse",
                          "config.yaml")
    code = main(["config", config, "--stage", "rlvr", "--init-from", str(sft_run / "sft"), f"run_dir={tmp_path}",
                 "rlvr.actor.strategy.optimizer.lr=3e-4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "pipeline_cls: baton.recipes.demo:SFTRLVRPipeline" in out and "only_stage: rlvr" in out
    assert "lr: 0.0003" in out and "checks passed" in err


@pytest.mark.parametrize("example, stage, role", [("dpo.yaml", "dpo", "actor"), ("distill.yaml", "distill", "teacher"),
                                                  ("agentic.yaml", "rlvr", "actor"), ("dag_grpo.yaml", "rlvr", "actor")])
def test_the_other_recipes_second_stage_is_checked_alone_from_a_checkpoint(sft_run, tmp_path, capsys, example, stage,
                                                                           role):
    config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", example)
    pipeline_cls, resolved = resolve(config, [f"run_dir={tmp_path}"], stage, str(sft_run / "sft"))
    pipeline_cls.dry_run(resolved)
    started = pipeline_cls.starting_from(resolved, stage, pipeline_cls.start_checkpoint(resolved, stage))
    assert getattr(started, role).strategy.model == str(sft_run / "sft" / "checkpoints" / "step_2" / "actor")
