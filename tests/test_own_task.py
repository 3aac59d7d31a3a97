"""Your own task: the string-reversal example runs from anywhere with its reward module found without PYTHONPATH;
import paths and data files beside a config are found; GRPO says so when its groups carry no learning signal."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from baton.config import paths
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.rl import SignalWatch, zero_std_group_fraction
from baton.strategy import StrategyConfig
from baton.tracking import run_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "reverse")


def constant_reward(response: str, ground_truth: str, **fields) -> float:
    return 0.0


def length_reward(response: str, ground_truth: str, **fields) -> float:
    return float(len(response))


@pytest.fixture
def fresh_paths(monkeypatch):
    """add_config_dir's effects (sys.path, PYTHONPATH, the module's state) undone after the test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    monkeypatch.setattr(paths, "_IMPORT_DIRS", [])
    monkeypatch.setattr(paths, "_config_dir", None)


@pytest.mark.ray
def test_the_reverse_example_runs_from_another_directory_without_pythonpath(tmp_path, monkeypatch, fresh_paths):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    settings = [f"run_dir={tmp_path / 'run'}", "sft.trainer.num_steps=1", "sft.trainer.val_before_train=false",
                "rlvr.trainer.num_steps=2", "rlvr.sampling.num_samples_per_prompt=2"]
    for stage in ("sft", "rlvr"):
        settings += [f"{stage}.trainer.num_prompts_per_step=8", f"{stage}.trainer.progress_bar=false"]
    baton = os.path.join(os.path.dirname(sys.executable), "baton")
    done = subprocess.run([baton, "run", os.path.join(EXAMPLE, "config.yaml"), *settings], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = run_metrics(str(tmp_path / "run" / "rlvr"))
    assert sorted(steps) == [0, 1, 2]
    for key in ("critic/score/mean", "critic/frac_reward_zero_std", "val/reward/mean", "val/accuracy"):
        assert key in steps[2], key

    # The run's config.yaml, loaded again from yet another directory, finds the reward module and the data.
    from baton.config import load_config
    from baton.rewards import get_reward_fn

    monkeypatch.delitem(sys.modules, "revreward", raising=False)
    monkeypatch.chdir(tmp_path / "run")
    config = load_config(RLVRConfig, tmp_path / "run" / "rlvr" / "config.yaml")
    assert config.reward_fn == "revreward:score" and get_reward_fn(config.reward_fn)("olleh", "olleh") == 1.0
    assert config.data.train_path == os.path.join(EXAMPLE, "train.jsonl")


def test_the_reverse_reward_gives_partial_credit_below_one():
    spec = importlib.util.spec_from_file_location("revreward", os.path.join(EXAMPLE, "revreward.py"))
    revreward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(revreward)
    assert revreward.score("olleh", "olleh") == 1.0
    assert revreward.score(" olleh\n", "olleh") == 1.0
    assert revreward.score("ollex", "olleh") == pytest.approx(0.5 * 4 / 5)
    assert revreward.score("olleh!", "olleh") == pytest.approx(0.5 * 5 / 6)  # right letters, one too many
    assert revreward.score("", "olleh") == 0.0


def test_the_shipped_data_is_the_generator_output(tmp_path):
    subprocess.run([sys.executable, os.path.join(EXAMPLE, "make_data.py"), "--out-dir", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("train.jsonl", "val.jsonl"):
        assert (tmp_path / name).read_text() == open(os.path.join(EXAMPLE, name)).read(), name
    train = {json.loads(line)["prompt"] for line in open(tmp_path / "train.jsonl")}
    val = [json.loads(line) for line in open(tmp_path / "val.jsonl")]
    assert not train & {e["prompt"] for e in val}
    assert all(e["prompt"] == f"reverse: {e['answer'][::-1]}=" for e in val)


def test_modules_and_data_beside_the_config_are_found_from_another_directory(tmp_path, monkeypatch, fresh_paths):
    config_dir, work_dir = tmp_path / "task", tmp_path / "elsewhere"
    config_dir.mkdir()
    work_dir.mkdir()
    (config_dir / "besidereward.py").write_text("def score(response, ground_truth, **fields):\n    return 0.25\n")
    (work_dir / "cwdreward.py").write_text("def score(response, ground_truth, **fields):\n    return 0.75\n")
    (config_dir / "train.jsonl").write_text('{"prompt": "a=", "answer": "a"}\n')
    (config_dir / "run.yaml").write_text("reward_fn: besidereward:score\n")
    monkeypatch.chdir(work_dir)
    from baton.config import import_object, load_config
    from baton.rewards import get_reward_fn

    config = load_config(RLVRConfig, config_dir / "run.yaml")
    assert get_reward_fn(config.reward_fn)("x", "y") == 0.25
    assert import_object("cwdreward:score")("x", "y") == 0.75
    assert paths.find_file("train.jsonl") == str(config_dir / "train.jsonl")
    (work_dir / "train.jsonl").write_text("")
    assert paths.find_file("train.jsonl") == "train.jsonl"  # the working directory comes first
    with pytest.raises(FileNotFoundError, match="in the config's directory"):
        paths.find_file("val.jsonl")
    # After everything importable already (the standard library, the installed packages), here and in the workers.
    assert sys.path[-2:] == [str(config_dir), str(work_dir)]
    pythonpath = os.environ["PYTHONPATH"].split(os.pathsep)
    assert pythonpath[0] == "/inherited" and pythonpath[-2:] == [str(config_dir), str(work_dir)]
    assert paths.ray_runtime_env() == {
        "env_vars": {"PYTHONPATH": os.pathsep.join(["${PYTHONPATH}", str(config_dir), str(work_dir)])}}


@pytest.mark.ray
def test_an_existing_cluster_is_given_the_config_directory(tmp_path, ray_cluster, fresh_paths):
    """What `--ray-address` passes to ray.init, here given to one actor of the session's cluster."""
    import ray

    (tmp_path / "clusterreward.py").write_text("def score(response, ground_truth, **fields):\n    return 0.5\n")
    paths.add_config_dir(tmp_path / "run.yaml")

    @ray.remote(num_cpus=0)
    def load():
        from baton.rewards import get_reward_fn

        return get_reward_fn("clusterreward:score")("x", "y"), os.environ["PYTHONPATH"]

    value, pythonpath = ray.get(load.options(runtime_env=paths.ray_runtime_env()).remote(), timeout=120)
    assert value == 0.5
    parts = pythonpath.split(os.pathsep)
    assert parts.index(str(tmp_path)) > parts.index(os.path.dirname(os.path.abspath(__file__)))  # after the cluster's own


def test_the_share_of_groups_without_reward_variance():
    uids = [0, 0, 1, 1, 2, 2, 3, 3]
    assert zero_std_group_fraction([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0], uids) == 0.75
    assert zero_std_group_fraction([0.0, 1.0, 0.0, 1.0, 0.2, 0.5, 0.0, 0.3], uids) == 0.0


def test_the_watch_warns_after_five_steps_without_signal_then_keeps_quiet_for_a_while(capsys):
    watch = SignalWatch("grpo")
    warned = [step for step in range(1, 121) if watch.update(step, 1.0 if step != 3 else 0.5, 0.0)]
    assert warned == [8, 58, 108]  # steps 4-8 are the first five in a row; then every 50 while it lasts
    err = capsys.readouterr().err
    assert err.count("baton: warning") == 3 and "sampling.temperature" in err and "partial credit" in err
    assert not [step for step in range(1, 200) if SignalWatch("grpo").update(step, 0.95 if step % 5 else 0.5, 0.3)]


def grpo_on_mock(tmp_path, reward_fn: str, num_steps: int) -> RLVRConfig:
    role = RoleConfig(strategy=StrategyConfig(name="mock"))
    return RLVRConfig(actor=role, rollout=role, reward_fn=reward_fn, data=DataConfig(max_operand=9, num_val_examples=8),
                      sampling=SamplingConfig(max_new_tokens=4, num_samples_per_prompt=4),
                      trainer=TrainerConfig(backend="local", run_dir=str(tmp_path), num_steps=num_steps,
                                            num_prompts_per_step=4, val_every_steps=100, progress_bar=False))


@pytest.mark.parametrize("reward, warns", [("constant_reward", True), ("length_reward", False)])
def test_grpo_warns_when_every_group_gets_one_reward_and_not_otherwise(tmp_path, capsys, reward, warns):
    run_pipeline(RLVRPipeline, grpo_on_mock(tmp_path, f"test_own_task:{reward}", num_steps=6))
    err = capsys.readouterr().err
    assert ("the policy learns nothing" in err) == warns
    steps = run_metrics(str(tmp_path))
    fractions = [steps[step]["critic/frac_reward_zero_std"] for step in sorted(steps) if step]
    assert len(fractions) == 6 and (all(f == 1.0 for f in fractions) if warns else all(f < 0.9 for f in fractions))
