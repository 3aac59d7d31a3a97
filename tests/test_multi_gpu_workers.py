"""Workers of several GPUs: each sees its bundles' GPUs in CUDA_VISIBLE_DEVICES, and only roles whose strategy drives
several GPUs from one process (vllm) may ask for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from baton.config import ConfigError
from baton.pipelines import preflight
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.strategy import StrategyConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in a process of its own: Ray's fake GPUs (ray.init(num_gpus=4) on this CPU machine) make Ray assign GPU ids and
# set CUDA_VISIBLE_DEVICES for tasks and actors, and the test session's shared Ray instance must keep having none.
FAKE_GPU_SCENARIO = r"""
import json, os, sys

import ray

from baton import Cluster, ResourceManager, Worker, WorkerConfig, register


class Visible(Worker):
    @register()
    def visible(self) -> dict:
        return {"devices": list(self.context.device_ids), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "noset": os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES")}


def bundle_env(manager, device):
    # What Ray itself sets for a GPU task in this device slot's bundle: the id the slot stands for.
    task = ray.remote(lambda: os.environ["CUDA_VISIBLE_DEVICES"])
    return ray.get(task.options(scheduling_strategy=manager._in_bundle(device), num_cpus=0, num_gpus=0.01).remote(),
                   timeout=30)


ray.init(address="local", num_cpus=2, num_gpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
manager = ResourceManager(1, 4, num_cpus_per_gpu=0.25)
assert manager.device_kind == "GPU", manager.device_kind
timeouts = dict(start_timeout_s=45.0, call_timeout_s=30.0, health_check_interval_s=0)
tp = Cluster(Visible, WorkerConfig("tp", device_mapping=[3, 1, 0, 2], num_devices_per_worker=2, **timeouts), manager)
single = Cluster(Visible, WorkerConfig("single", device_mapping=[2, 0], share_devices_with=("tp",), **timeouts), manager)
print(json.dumps({"tp": tp.visible(), "single": single.visible(),
                  "bundles": {d: bundle_env(manager, d) for d in range(4)}}))
sys.stdout.flush()
os._exit(0)  # the scenario's Ray instance goes with the process; a clean shutdown would only cost time
"""


def test_a_worker_of_two_gpus_sees_its_two_bundles_gpus_in_device_mapping_order():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    env["PYTHONPATH"] = os.pathsep.join(p for p in [REPO, env.get("PYTHONPATH")] if p)
    try:
        done = subprocess.run([sys.executable, "-c", FAKE_GPU_SCENARIO], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the fake-GPU scenario did not finish within 120 s; its stderr: {e.stderr}")
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    bundles = {int(d): gpu for d, gpu in seen["bundles"].items()}
    assert sorted(bundles.values()) == ["0", "1", "2", "3"]  # one GPU per device slot, all different

    worker_0, worker_1 = seen["tp"]
    assert worker_0["devices"] == [3, 1] and worker_1["devices"] == [0, 2]
    assert worker_0["cuda"] == f"{bundles[3]},{bundles[1]}"
    assert worker_1["cuda"] == f"{bundles[0]},{bundles[2]}"
    assert len(set(worker_0["cuda"].split(",") + worker_1["cuda"].split(","))) == 4
    assert worker_0["noset"] == worker_1["noset"] == "1"

    # One-GPU workers are left to Ray, as before: the GPU of their own bundle.
    single_0, single_1 = seen["single"]
    assert (single_0["cuda"], single_1["cuda"]) == (bundles[2], bundles[0])
    assert single_0["noset"] is None and single_1["noset"] is None


def rlvr_config(actor: RoleConfig, rollout: RoleConfig) -> RLVRConfig:
    return RLVRConfig(actor=actor, rollout=rollout, data=DataConfig(max_operand=9, num_val_examples=8),
                      sampling=SamplingConfig(num_samples_per_prompt=2),
                      trainer=TrainerConfig(num_prompts_per_step=4, num_cpus=8))


@pytest.fixture
def four_local_gpus(monkeypatch):
    """The preflight's view of a machine with 4 GPUs and no Ray running yet (as in a fresh `baton run`)."""
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.setattr(preflight, "_local_gpu_count", lambda: 4)


def test_an_hf_role_of_two_gpus_per_worker_is_refused_with_the_fix(four_local_gpus):
    config = rlvr_config(RoleConfig(), RoleConfig(num_devices_per_worker=2))
    with pytest.raises(ConfigError, match=r"rollout.num_devices_per_worker=2 on GPUs with rollout.strategy.name='hf'.*"
                                          r"Use one worker per GPU: rollout.num_devices_per_worker=1.*fsdp2 shards"):
        preflight.check_roles(config, config.trainer)
    config = rlvr_config(RoleConfig(num_devices_per_worker=2, strategy=StrategyConfig(name="fsdp2")), RoleConfig())
    with pytest.raises(ConfigError, match=r"actor.num_devices_per_worker=2 on GPUs with actor.strategy.name='fsdp2'"):
        preflight.check_roles(config, config.trainer)


def test_two_devices_per_worker_are_refused_only_on_gpus_and_only_for_one_gpu_strategies(monkeypatch):
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    monkeypatch.setattr(preflight, "_local_gpu_count", lambda: 0)
    config = rlvr_config(RoleConfig(), RoleConfig(num_devices_per_worker=2))
    preflight.check_roles(config, config.trainer)  # on CPU slots: two CPUs (threads) for the worker

    vllm_rollout = {"rollout": RoleConfig(num_devices_per_worker=2, strategy=StrategyConfig(name="vllm")),
                    "actor": RoleConfig()}
    preflight.check_devices_per_worker(vllm_rollout, has_gpus=True)  # tensor parallel over its two GPUs
    mock_reference = {"reference": RoleConfig(num_devices_per_worker=2, strategy=StrategyConfig(name="mock"))}
    with pytest.raises(ConfigError, match=r"reference.num_devices_per_worker=2 on GPUs .* for vllm \(tensor parallel\)"):
        preflight.check_devices_per_worker(mock_reference, has_gpus=True)
