"""What is refused before Ray starts, how the CLI reports a failed run, and the run's own records after a resume."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from baton.cli import main
from baton.config import ConfigError
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, SFTConfig, TrainerConfig
from baton.pipelines.preflight import check_machine
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.run_dir import list_checkpoints
from baton.pipelines.sft import SFTPipeline
from baton.strategy import StrategyConfig
from baton.tracking.tracker import read_metrics
from test_run_ux import mock_grpo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sft_config(run_dir, model="tiny-qwen2", **actor) -> SFTConfig:
    return SFTConfig(actor=RoleConfig(strategy=StrategyConfig(model=model), **actor),
                     data=DataConfig(max_operand=9, num_val_examples=8),
                     trainer=TrainerConfig(num_steps=2, num_prompts_per_step=4, run_dir=str(run_dir), progress_bar=False))


def test_a_model_path_that_does_not_exist_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"actor.strategy.model: '.*missing' is neither a model name .* nor an existing"):
        SFTPipeline(sft_config(tmp_path / "run", model=str(tmp_path / "missing")))
    assert not (tmp_path / "run").exists()  # refused before the run directory was made


@pytest.mark.parametrize("files, message", [
    ({}, "has no config.json; is it an HF model directory"),
    ({"config.json": "{not json"}, "cannot read .*config.json"),
    ({"config.json": "{}"}, "has no model_type"),
    ({"config.json": '{"model_type": "qwen2"}'}, "has a config.json but no weights"),
])
def test_a_model_directory_that_cannot_load_is_refused_by_name(tmp_path, files, message):
    model = tmp_path / "model"
    model.mkdir()
    for name, text in files.items():
        (model / name).write_text(text)
    with pytest.raises(ConfigError, match=message):
        SFTPipeline.dry_run(sft_config(tmp_path, model=str(model)))


def test_a_relative_model_path_is_found_beside_the_config_and_kept_absolute(tmp_path, monkeypatch):
    from baton.config import add_config_dir

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    add_config_dir(str(tmp_path / "cfg" / "run.yaml"))
    assert StrategyConfig(model="model").model == str(tmp_path / "cfg" / "model")
    assert StrategyConfig(model="tiny-qwen2").model == "tiny-qwen2"  # a name stays a name


def test_training_one_model_on_several_hf_workers_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"'hf' with 4 actor workers.*actor.strategy.name=fsdp2"):
        SFTPipeline.dry_run(sft_config(tmp_path, world_size=4))
    config = RLVRConfig(rollout=RoleConfig(world_size=2), data=DataConfig(max_operand=9, num_val_examples=8),
                        sampling=SamplingConfig(num_samples_per_prompt=2), trainer=TrainerConfig(num_prompts_per_step=4, num_cpus=4))
    RLVRPipeline.dry_run(config)  # several hf rollout replicas are fine: they do not train


def test_more_workers_than_the_machine_has_cpus_is_refused_before_ray(tmp_path, monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)  # as in a fresh `baton run`: no Ray running yet
    config = sft_config(tmp_path, world_size=2)
    config.actor.strategy.name = "fsdp2"
    with pytest.raises(ConfigError, match=r"need 3 CPU\(s\): 2 device slot\(s\) .* and 1 for CPU-only workers \(reward: 1 × 1\), but a local "
                                          r"Ray instance with trainer.num_cpus=2 has 2"):
        check_machine(config, TrainerConfig(num_cpus=2))
    check_machine(config, TrainerConfig(num_cpus=3))
    with pytest.raises(ConfigError, match="a local Ray instance has one node; join a cluster with --ray-address"):
        check_machine(config, TrainerConfig(num_nodes=2))


def test_baton_config_is_a_dry_run_that_reports_what_run_would_refuse(tmp_path):
    base = [sys.executable, "-m", "baton.cli", "config", f"run_dir={tmp_path}", "sft.trainer.num_cpus=2"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ok = subprocess.run(base, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert ok.returncode == 0, ok.stderr
    assert "pipeline_cls: baton.recipes.demo:DemoPipeline" in ok.stdout and "checks passed" in ok.stderr
    refused = subprocess.run(base + ["rlvr.actor.world_size=2", "rlvr.actor.strategy.name=fsdp2"],
                             capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert refused.returncode == 2
    assert refused.stderr.startswith("baton: error: rlvr stage: the roles need 3 CPU(s)"), refused.stderr


@pytest.mark.parametrize("old, new", [
    ("baton.pipelines.demo:DemoPipeline", "baton.recipes.demo:DemoPipeline"),
    ("baton.pipelines.rollout_rlvr:RolloutDemoPipeline", "baton.recipes.rollout_demo:RolloutDemoPipeline"),
])
def test_a_config_naming_a_demo_pipeline_by_its_old_path_gets_its_new_one(tmp_path, capsys, old, new):
    config = tmp_path / "old.yaml"
    config.write_text(f"pipeline_cls: {old}\n")
    assert main(["config", str(config)]) == 2
    assert capsys.readouterr().err == f"baton: error: {config}: pipeline_cls {old!r} has moved; write pipeline_cls: {new}\n"
    assert main(["config", f"pipeline_cls={old}"]) == 2
    assert capsys.readouterr().err == f"baton: error: pipeline_cls {old!r} has moved; write pipeline_cls: {new}\n"
    assert main(["config", f"pipeline_cls={new}", f"run_dir={tmp_path / 'run'}"]) == 0


def test_a_failed_run_prints_one_line_with_the_next_step_and_logs_the_traceback(tmp_path, capsys):
    (tmp_path / "badreward.py").write_text("def score(response, ground_truth, **fields):\n"
                                           "    raise RuntimeError('the judge is down')\n")
    sys.path.insert(0, str(tmp_path))
    try:
        code = main(["run", "pipeline_cls=baton.pipelines.sft:SFTPipeline", "reward_fn=badreward:score",
                     "trainer.backend=local", f"trainer.run_dir={tmp_path / 'run'}", "trainer.num_steps=1",
                     "trainer.progress_bar=false", "data.num_val_examples=4", "data.max_operand=9"])
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err
    assert code == 1
    lines = [line for line in err.splitlines() if line.startswith(("baton: error", "  "))]
    assert lines[0].startswith("baton: error: worker reward[rank 0] raised in compute_rewards(): ")
    assert "the judge is down" in lines[0] and "Traceback" not in err
    # It failed before its first checkpoint: nothing to resume.
    assert "to continue: fix the cause above, then rerun the same command\n" in err and "resume=latest" not in err
    log = tmp_path / "run" / "error.log"
    assert f"full traceback: {log}" in err
    assert "Traceback" in log.read_text() and "the judge is down" in log.read_text()


def test_after_a_resume_the_metrics_have_each_step_once(tmp_path):
    run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=4))
    # As if the run had stopped after step 4 was logged but before its checkpoint was written.
    import shutil

    shutil.rmtree(list_checkpoints(str(tmp_path))[-1])
    run_pipeline(RLVRPipeline, mock_grpo(tmp_path, num_steps=5, resume="latest"))
    steps = [record["step"] for record in read_metrics(str(tmp_path / "metrics.jsonl"))]
    assert steps == [0, 1, 2, 3, 4, 5]


def test_a_local_ray_instance_listens_on_loopback_with_rays_own_authentication():
    script = ("import os, ray\nfrom baton.pipelines.ray_start import start_ray\nfrom baton.pipelines.config import TrainerConfig\n"
              "start_ray(TrainerConfig(num_cpus=1))\n"
              "@ray.remote(num_cpus=0)\ndef where(): return ray.util.get_node_ip_address()\n"
              "print(ray.get(where.remote()), ray.get_runtime_context().gcs_address, os.environ.get('RAY_AUTH_MODE'))\n"
              "ray.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr
    node_ip, gcs_address, auth_mode = out.stdout.split()[-3:]
    assert node_ip == "127.0.0.1" and gcs_address.startswith("127.0.0.1:")
    assert auth_mode != "disabled"  # left as Ray sets it


def test_bad_data_is_refused_before_the_run_directory_or_ray(tmp_path):
    from baton.datasets.files import DataError

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "1+1=", "answer": "2"}\n\n"just a string"\n')
    config = sft_config(tmp_path / "run")
    config.data = DataConfig(task="files", train_path=str(train))
    with pytest.raises(DataError, match=r"train.jsonl, line 3: a row must be a JSON object"):
        SFTPipeline(config)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, parallel, world_size, message", [
    ("fsdp2", {"tp": 3}, 3, r"tp: 3 does not divide this model's num_attention_heads \(4\)"),
    ("fsdp2", {"cp": 3}, 3, r"cp: 3 does not divide this model's num_attention_heads \(4\)"),
    ("fsdp2", {"tp": 2}, 3, r"3 workers do not divide into pp 1 × dp_replicate 1 × cp 1 × tp 2; give the role a multiple of 2"),
    ("hf", {"tp": 2}, 1, r"strategy 'hf' holds a whole model on each worker, so it takes no parallel layout"),
    ("fsdp2", {"cp": 2, "packing": True}, 2, r"packing: true with cp > 1: a context-parallel pass .* set packing: null"),
    ("fsdp2", {"pp": 3}, 3, r"pp: 3 does not divide this model's 4 decoder layers into equal stages"),
])
def test_a_parallel_layout_the_model_or_workers_cannot_take_is_refused_before_ray(tmp_path, name, parallel,
                                                                                   world_size, message):
    from baton.strategy import ParallelConfig

    config = sft_config(tmp_path, world_size=world_size)
    layout = {key: value for key, value in parallel.items() if key != "packing"}
    config.actor.strategy = StrategyConfig(name=name, model="tiny-qwen2", parallel=ParallelConfig(**layout),
                                           packing=parallel.get("packing"))
    with pytest.raises(ConfigError, match=r"actor.strategy.parallel: " + message):
        SFTPipeline.dry_run(config)
