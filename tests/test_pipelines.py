"""The pipelines end to end, in-process: GRPO on the mock and the tiny model, SFT, config errors."""

from __future__ import annotations

import importlib.util
import os

import pytest

from baton.cli import resolve
from baton.config import ConfigError
from baton.pipelines.base import run_pipeline as run
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, SFTConfig, TrainerConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.sft import SFTPipeline
from baton.strategy import StrategyConfig
from baton.tracking import read_metrics, run_metrics
from conftest import wait_until

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def small_trainer(run_dir, **kwargs) -> TrainerConfig:
    settings = dict(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, val_every_steps=2,
                    save_every_steps=2, progress_bar=False)
    return TrainerConfig(**{**settings, **kwargs})


@pytest.mark.parametrize("strategy", ["mock", "hf"])
def test_grpo_runs_end_to_end(tmp_path, strategy):
    role = RoleConfig(strategy=StrategyConfig(name=strategy, model="tiny-qwen2"))
    config = RLVRConfig(actor=role, rollout=role, colocate_actor_rollout=strategy == "hf",
                        data=DataConfig(max_operand=9, num_val_examples=8),
                        sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                        val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                        trainer=small_trainer(tmp_path, num_steps=2))
    summary = run(RLVRPipeline, config)
    steps = run_metrics(str(tmp_path), wall_clock=True)
    assert sorted(steps) == [0, 1, 2]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr", "response_length/mean",
                "timing_s/gen", "perf/throughput", "val/accuracy"):
        assert key in steps[2], key
    assert summary["final_val_accuracy"] == steps[2]["val/accuracy"]  # the summary reports the last validation
    assert os.path.isdir(tmp_path / "checkpoints" / "step_2" / "actor")
    assert os.path.isfile(tmp_path / "summary.json") and os.path.isfile(summary["plot"])


def test_sft_logs_its_loss_each_step_and_keeps_the_last_checkpoints(tmp_path):
    """That SFT learns is tests/test_learning.py::test_sft_learns_the_demonstrations; here, what it logs and keeps."""
    config = SFTConfig(actor=RoleConfig(strategy=StrategyConfig(model="tiny-qwen2")),
                       data=DataConfig(max_operand=9, num_val_examples=8),
                       trainer=small_trainer(tmp_path, num_steps=6, keep_last_checkpoints=2))
    config.trainer.num_prompts_per_step = 16
    run(SFTPipeline, config)
    steps = run_metrics(str(tmp_path))
    assert [step for step in sorted(steps) if "sft/loss" in steps[step]] == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_4", "step_6"]


def tiny_grpo(run_dir, colocate=True, **trainer) -> RLVRConfig:
    role = RoleConfig(strategy=StrategyConfig(model="tiny-qwen2"))
    return RLVRConfig(actor=role, rollout=role, colocate_actor_rollout=colocate,
                      data=DataConfig(max_operand=9, num_val_examples=8),
                      sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                      val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                      trainer=small_trainer(run_dir, **trainer))


@pytest.mark.ray
@pytest.mark.parametrize("colocate", [False, True], ids=["separate", "colocated"])
def test_grpo_on_ray_with_actor_and_rollout_apart_or_together(tmp_path, ray_cluster, colocate):
    import ray

    config = tiny_grpo(tmp_path, colocate, num_steps=2, backend="ray", num_nodes=1)
    pipeline = RLVRPipeline(config)
    try:
        # Apart: two clusters, two processes, weights copied; together: one process holds both.
        actor_pid, rollout_pid = (ray.get(pipeline.clusters[name]._group.hosts[0].pid.remote())
                                  for name in ("actor", "rollout"))
        assert (actor_pid == rollout_pid) == colocate and os.getpid() not in (actor_pid, rollout_pid)
        summary = pipeline.run()
    finally:
        pipeline.shutdown()
    steps = run_metrics(str(tmp_path), wall_clock=True)
    assert sorted(steps) == [0, 1, 2] and "timing_s/sync" in steps[2]
    assert summary["final_val_accuracy"] == steps[2]["val/accuracy"]
    assert summary["start_val_accuracy"] == steps[0]["val/accuracy"]


@pytest.mark.parametrize("change, message", [
    (dict(adv_estimator="gae"), "adv_estimator 'gae' needs a critic"),
    (dict(num_mini_batches_per_step=3), r"num_prompts_per_step=4 does not split into .*num_mini_batches_per_step=3 .* use one of \[1, 2, 4\]"),
    (dict(adv_estimator="grpo", num_samples=1), "num_samples_per_prompt=1; use 2 or more"),
    (dict(actor_world_size=3), "does not split evenly over the 3 actor workers"),
    (dict(reward_fn="exact_matsh"), "reward_fn: unknown reward 'exact_matsh'; valid: .*'exact_match'"),
    (dict(reward_fn="no_such_module:score"), "reward_fn: reward 'no_such_module:score' cannot be imported"),
    (dict(loss_agg_mode="token_mean"), "algorithm.loss_agg_mode 'token_mean' is not one of"),
])
def test_impossible_configs_fail_before_anything_starts(tmp_path, monkeypatch, change, message):
    config = tiny_grpo(tmp_path, num_steps=1)
    config.algorithm.adv_estimator = change.get("adv_estimator", "grpo")
    config.algorithm.num_mini_batches_per_step = change.get("num_mini_batches_per_step", 1)
    config.algorithm.loss_agg_mode = change.get("loss_agg_mode", "token-mean")
    config.sampling.num_samples_per_prompt = change.get("num_samples", 2)
    config.actor = RoleConfig(strategy=config.actor.strategy, world_size=change.get("actor_world_size"))
    config.reward_fn = change.get("reward_fn", "exact_match")
    # Nothing may start: no Ray, no resource reservation, no worker.
    monkeypatch.setattr("baton.pipelines.base.start_ray", lambda trainer: pytest.fail("Ray started"))
    monkeypatch.setattr("baton.pipelines.base.ResourceManager", lambda *a, **k: pytest.fail("resources reserved"))
    with pytest.raises(ConfigError, match=message):
        RLVRPipeline(config)


@pytest.mark.ray
def test_more_devices_than_the_cluster_has_fail_before_any_worker_starts(tmp_path, ray_cluster):
    import ray

    config = tiny_grpo(tmp_path, num_steps=1, backend="ray")
    config.rollout = RoleConfig(strategy=config.rollout.strategy, world_size=64)
    config.colocate_actor_rollout = False
    actors_before = len(ray.util.list_named_actors(all_namespaces=True))
    with pytest.raises(ConfigError, match=r"the roles need 65 CPU\(s\): 64 device slot\(s\) \(.*rollout: 64 worker\(s\).*but "
                                          r"the running Ray instance has 14"):
        RLVRPipeline(config)
    assert len(ray.util.list_named_actors(all_namespaces=True)) == actors_before


def test_the_demo_checks_both_stages_before_running_the_first(tmp_path):
    from baton.recipes.demo import DemoPipeline

    _, config = resolve(None, [f"run_dir={tmp_path}", "rlvr.reward_fn=exact"])
    with pytest.raises(ConfigError, match="unknown reward 'exact'"):
        DemoPipeline(config)
    assert not os.path.exists(tmp_path / "sft")


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

    straight, split = run_metrics(str(tmp_path / "straight")), run_metrics(str(tmp_path / "split"))
    assert sorted(split) == [0, 1, 2, 3, 4]
    assert split == straight
    weights = [load_file(d / "checkpoints" / "step_4" / "actor" / "model.safetensors")
               for d in (tmp_path / "straight", tmp_path / "split")]
    assert all((weights[0][k] == weights[1][k]).all() for k in weights[0])


def test_ctrl_c_finishes_the_step_saves_it_and_the_run_resumes_from_there(tmp_path):
    import signal
    import subprocess
    import sys

    import yaml

    config = {"pipeline_cls": "baton.pipelines.rlvr:RLVRPipeline",
              "actor": {"strategy": {"name": "mock"}}, "rollout": {"strategy": {"name": "mock"}},
              "data": {"max_operand": 9, "num_val_examples": 4},
              "sampling": {"max_new_tokens": 3, "num_samples_per_prompt": 2},
              "trainer": {"backend": "local", "run_dir": str(tmp_path), "num_prompts_per_step": 4, "num_steps": 100000,
                          "val_every_steps": 100000, "save_every_steps": 100000, "progress_bar": False}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    command = [sys.executable, "-m", "baton.cli", "run", str(path)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    metrics = str(tmp_path / "metrics.jsonl")
    wait_until(lambda: process.poll() is not None or (os.path.exists(metrics) and len(read_metrics(metrics)) >= 4),
               "validation and 3 steps logged")
    assert process.poll() is None, process.stderr.read()
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    last_step = read_metrics(metrics)[-1]["step"]
    assert f"saved in {tmp_path / 'checkpoints' / f'step_{last_step}'}" in stderr and "trainer.resume=latest" in stderr
    assert os.listdir(tmp_path / "checkpoints") == [f"step_{last_step}"]

    resumed = subprocess.run(command + [f"trainer.num_steps={last_step + 2}", "trainer.resume=latest"],
                             capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    steps = [record["step"] for record in read_metrics(metrics)]
    assert steps[-3:] == [last_step, last_step + 1, last_step + 2]


@pytest.mark.parametrize("name", sorted(n for n in os.listdir(EXAMPLES) if n.endswith(".yaml")))
def test_every_example_config_loads_and_passes_its_checks(name):
    pipeline_cls, config = resolve(os.path.join(EXAMPLES, name), [])
    if name.startswith("gpu_"):  # its model and data paths are placeholders, and it needs GPUs: structure only
        config.check()
    elif name.startswith("vllm_") and importlib.util.find_spec("vllm") is None:  # needs the vllm extra
        config.stage("rlvr").check()
        with pytest.raises(ConfigError, match="install it with scripts/setup.sh --vllm"):
            pipeline_cls.dry_run(config)
    else:  # what `baton run` checks before Ray: config, models, machine, data
        pipeline_cls.dry_run(config)
    if name == "demo.yaml":  # the spelled-out demo is the built-in default
        assert config == resolve(None, [])[1]


def test_a_resumed_demo_skips_its_finished_sft_stage_and_continues_rlvr(tmp_path):
    from baton.recipes.demo import DemoPipeline

    settings = [f"run_dir={tmp_path}", "data.max_operand=9", "data.num_val_examples=8"]
    for stage in ("sft", "rlvr"):
        settings += [f"{stage}.trainer.backend=local", f"{stage}.trainer.progress_bar=false",
                     f"{stage}.trainer.num_prompts_per_step=4", f"{stage}.trainer.save_every_steps=1"]
    settings += ["sft.trainer.num_steps=2", "rlvr.sampling.num_samples_per_prompt=2", "rlvr.sampling.max_new_tokens=3"]
    DemoPipeline(resolve(None, settings + ["rlvr.trainer.num_steps=1"])[1]).run()
    sft_metrics = (tmp_path / "sft" / "metrics.jsonl").read_text()

    summary = DemoPipeline(resolve(None, settings + ["rlvr.trainer.num_steps=2", "resume=latest"])[1]).run()
    assert (tmp_path / "sft" / "metrics.jsonl").read_text() == sft_metrics  # not run again
    assert sorted(run_metrics(str(tmp_path / "rlvr"))) == [0, 1, 2] and summary["sft"]["num_steps"] == 2
    assert summary["start_val_accuracy"] is not None and summary["rlvr"]["resumed_from_step"] == 1


@pytest.mark.parametrize("interrupt_at", [1, 3])
def test_ctrl_c_stops_after_the_step_unless_it_was_the_last(tmp_path, interrupt_at):
    import signal

    from baton.pipelines.signals import TrainingInterrupted

    class Interrupted(RLVRPipeline):
        def end_step(self, step, metrics, label, key):
            if step == interrupt_at:
                os.kill(os.getpid(), signal.SIGINT)  # handled by the loop's deferred handler: no exception here
            super().end_step(step, metrics, label, key)

    role = RoleConfig(strategy=StrategyConfig(name="mock"))
    config = RLVRConfig(actor=role, rollout=role, data=DataConfig(max_operand=9, num_val_examples=4),
                        sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                        trainer=small_trainer(tmp_path, num_steps=3, save_every_steps=100))
    before = signal.getsignal(signal.SIGINT)  # Python's default, or SIG_IGN where the tests run in the background
    if interrupt_at < 3:
        with pytest.raises(TrainingInterrupted) as info:
            run(Interrupted, config)
        assert info.value.checkpoint == str(tmp_path / "checkpoints" / "step_1")
        assert os.listdir(tmp_path / "checkpoints") == ["step_1"]
    else:
        assert run(Interrupted, config)["num_steps"] == 3
    assert signal.getsignal(signal.SIGINT) == before  # the handler is put back
