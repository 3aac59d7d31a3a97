"""Roles on the same devices take turns in the RLVR loop and its workflow (trainer.offload_idle_roles): which are
offloaded and reloaded, in which order, and that it changes no result.

On CPU offloading frees nothing, so these tests watch the calls: the workers below record every strategy call
into `CALLS` (the local backend runs them in this process), and the mock strategy refuses to compute, sync or
save while offloaded.
"""

from __future__ import annotations

import os

import pytest
import torch

from baton.cli import resolve
from baton.datasets.arith_prefs import write_pairs
from baton.pipelines import dpo as dpo_module, policy
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import (AlgorithmConfig, DataConfig, RLVRConfig, RoleConfig, SamplingConfig, SFTConfig,
                                    TrainerConfig)
from baton.pipelines.dag import DAGConfig, DAGPipeline, DAGSettings
from baton.pipelines.distill import DistillConfig, DistillPipeline, DistillSettings
from baton.pipelines.dpo import DPOConfig, DPOPipeline, PairDataConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.pipelines.time_sharing import time_sharing_roles
from baton.rl import StaleSamplesWarning
from baton.strategy import StrategyConfig
from baton.workers import ActorWorker, ReferenceWorker, RolloutWorker, TeacherWorker
from baton.tracking import read_metrics, run_metrics

CALLS: list[tuple[str, str]] = []  # (role, strategy method), in call order
RECORDED = ("generate", "forward", "top_k_log_probs", "train_step", "weight_pieces", "import_weights", "offload",
            "reload", "save_checkpoint")
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
COMPUTE = {"generate", "forward", "top_k_log_probs", "train_step", "weight_pieces", "import_weights",
           "save_checkpoint"}


class Recorder:
    """A strategy whose RECORDED calls are appended to CALLS as (role, method) before they run."""

    def __init__(self, strategy, role: str):
        self._strategy, self._role = strategy, role

    def __getattr__(self, name: str):
        attr = getattr(self._strategy, name)
        if name not in RECORDED:
            return attr

        def call(*args, **kwargs):
            CALLS.append((self._role, name))
            return attr(*args, **kwargs)

        return call


class Records:
    role = ""

    def __init__(self, config):
        super().__init__(config)
        self.strategy = Recorder(self.strategy, self.role)


class RecordingActor(Records, ActorWorker):
    role = "actor"


class RecordingRollout(Records, RolloutWorker):
    role = "rollout"


class RecordingReference(Records, ReferenceWorker):
    role = "reference"


class RecordingTeacher(Records, TeacherWorker):
    role = "teacher"


class MarksSteps(RLVRPipeline):
    def end_step(self, step, metrics, label, key):
        CALLS.append(("pipeline", f"end of step {step}"))
        super().end_step(step, metrics, label, key)


@pytest.fixture(autouse=True)
def calls():
    CALLS.clear()
    yield CALLS
    CALLS.clear()


def grpo(run_dir, offload, strategy="mock", colocate=False, rollout_devices=None, num_steps=3, config_cls=RLVRConfig,
         **trainer) -> RLVRConfig:
    """GRPO with a KL loss (so a reference role), every model role on device 0 unless `rollout_devices` says."""
    def role(name, devices=None):
        return RoleConfig(device_mapping=devices, worker_cls=f"{__name__}:Recording{name.title()}",
                          strategy=StrategyConfig(name=strategy, model="tiny-qwen2"))

    settings = dict(backend="local", run_dir=str(run_dir), num_prompts_per_step=2, num_steps=num_steps,
                    val_every_steps=100, save_every_steps=100, progress_bar=False, offload_idle_roles=offload)
    return config_cls(actor=role("actor"), rollout=role("rollout", rollout_devices), reference=role("reference"),
                      colocate_actor_rollout=colocate, algorithm=AlgorithmConfig(use_kl_loss=True),
                      data=DataConfig(max_operand=9, num_val_examples=4),
                      sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                      val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                      trainer=TrainerConfig(**{**settings, **trainer}))


def steps(calls: list) -> list[list]:
    """CALLS cut at each step's end: [before the end of step 1, ..., after the last step's end]."""
    cuts = [i for i, (role, _) in enumerate(calls) if role == "pipeline"]
    return [calls[a + 1:b] for a, b in zip([-1] + cuts, cuts + [len(calls)])]


def replay(calls: list, apart: dict[tuple[str, str], list[str]]) -> None:
    """Every role starts on its device, is offloaded and reloaded in turn (never twice in a row), computes only on
    its device, and makes each call (role, method) of `apart` only while the roles it lists are off the device."""
    resident = {role: True for role, _ in calls}
    for role, method in calls:
        if method in ("offload", "reload"):
            assert resident[role] == (method == "offload"), f"{role}.{method} twice in a row"
            resident[role] = method == "reload"
        elif method in COMPUTE:
            assert resident[role], f"{role}.{method} while offloaded"
            beside = [other for other in apart.get((role, method), ()) if resident.get(other)]
            assert not beside, f"{role}.{method} beside {beside}"


# One step while roles take turns: the rollout generates with the others offloaded; it sleeps while the reference
# and actor compute; it is woken before the weights go in, and the actor is offloaded after the sync.
STEP = [("rollout", "generate"),
        ("rollout", "offload"), ("actor", "reload"), ("reference", "reload"),
        ("reference", "forward"), ("actor", "train_step"),
        ("reference", "offload"), ("rollout", "reload"),
        ("actor", "weight_pieces"), ("rollout", "import_weights"), ("actor", "forward"), ("rollout", "forward"),
        ("actor", "offload")]


def test_the_rollout_and_the_training_roles_take_turns_on_their_device(tmp_path, calls):
    summary = run_pipeline(MarksSteps, grpo(tmp_path, True))
    first, second, third, after = steps(calls)
    # Built on the device; the first validation offloads the actor and reference before the rollout generates.
    built = [("actor", "weight_pieces"), ("rollout", "import_weights"), ("actor", "forward"), ("rollout", "forward")]
    assert first == built + [("actor", "offload"), ("reference", "offload"), ("rollout", "generate")] + STEP
    assert second == third == STEP
    # The last step's validation finds the rollout awake; its checkpoint reloads the actor, whose state it saves.
    assert after == [("rollout", "generate"), ("actor", "reload"), ("actor", "save_checkpoint")]
    assert summary["num_steps"] == 3
    row = read_metrics(str(tmp_path / "metrics.jsonl"))[-1]
    assert row["timing_s/offload"] > 0 and row["timing_s/reload"] > 0
    assert row["timing_s/offload"] + row["timing_s/reload"] + row["timing_s/gen"] <= row["timing_s/step"]


def test_no_role_computes_while_offloaded_nor_beside_the_role_it_takes_turns_with(tmp_path, calls):
    """Checked over a whole run with validation and checkpoints in between steps and a sync every other step."""
    with pytest.warns(StaleSamplesWarning):
        run_pipeline(RLVRPipeline, grpo(tmp_path, True, num_steps=4, val_every_steps=1, save_every_steps=1,
                                        sync_every_steps=2))
    replay(calls, {("rollout", "generate"): ["actor", "reference"], ("actor", "train_step"): ["rollout"]})
    assert ("rollout", "offload") in calls and ("actor", "offload") in calls


def test_off_makes_no_call_and_gives_the_same_metrics(tmp_path, calls):
    run_pipeline(RLVRPipeline, grpo(tmp_path / "on", True))
    assert ("actor", "offload") in calls
    calls.clear()
    run_pipeline(RLVRPipeline, grpo(tmp_path / "off", False))
    assert calls and not [c for c in calls if c[1] in ("offload", "reload")]
    assert run_metrics(str(tmp_path / "on")) == run_metrics(str(tmp_path / "off"))
    assert "timing_s/offload" not in read_metrics(str(tmp_path / "off" / "metrics.jsonl"))[-1]


def test_auto_is_on_only_on_gpus(tmp_path, calls):
    pipeline = RLVRPipeline(grpo(tmp_path, "auto", num_steps=1))
    try:
        pipeline.run()
    finally:
        pipeline.shutdown()
    offloads = [c for c in calls if c[1] == "offload"]
    assert bool(offloads) == bool(pipeline.time_sharing.resident) == torch.cuda.is_available()  # the local backend's strategies


def test_a_colocated_actor_and_rollout_stay_and_the_reference_takes_turns_with_them(tmp_path, calls):
    pipeline = RLVRPipeline(grpo(tmp_path, True, colocate=True, num_steps=2))
    try:
        pipeline.run()
    finally:
        pipeline.shutdown()
    assert list(pipeline.time_sharing.resident) == ["reference"]
    assert {role for role, method in calls if method in ("offload", "reload")} == {"reference"}
    assert [m for role, m in calls if role == "reference"] == ["offload"] + ["reload", "forward", "offload"] * 2


def test_the_workflow_hands_each_nodes_roles_their_devices_as_the_loop_hands_each_phase(tmp_path, calls):
    """The workflow's nodes (single controller): none computes on an offloaded role, the rollout never generates
    beside the actor or reference, nor the actor trains beside the rollout; the actor and reference (one turn) are not
    offloaded between their nodes, so a step offloads each role once, as the loop's; the metrics are the loop's."""
    run_pipeline(RLVRPipeline, grpo(tmp_path / "loop", True))
    loop = list(calls)
    calls.clear()
    run_pipeline(DAGPipeline, grpo(tmp_path / "dag", True, config_cls=DAGConfig))
    replay(calls, {("rollout", "generate"): ["actor", "reference"], ("reference", "forward"): ["rollout"],
                   ("actor", "train_step"): ["rollout"]})
    offloaded = [role for role, method in calls if method == "offload"]
    assert len(offloaded) == len([role for role, method in loop if method == "offload"])
    assert set(offloaded) == {"actor", "rollout", "reference"}
    ours, theirs = run_metrics(str(tmp_path / "loop")), run_metrics(str(tmp_path / "dag"))
    assert {step: {key: row[key] for key in ours[step]} for step, row in theirs.items()} == ours


def test_the_multi_controller_offloads_no_role_and_says_so(tmp_path):
    """Every role of a rank lives in its DAG worker's process, which walks the step itself: nothing is handed over
    (the workflow refused the setting before)."""
    config = grpo(tmp_path, True, strategy="hf", colocate=True, num_steps=1, config_cls=DAGConfig)
    config.dag = DAGSettings(executor="multi_controller")
    for role in (config.actor, config.rollout, config.reference):
        role.worker_cls = None  # the DAG worker shares the actor's parameters with the rollout, unwrapped
    with pytest.warns(UserWarning, match="offload_idle_roles=true is ignored under dag.executor multi_controller"):
        pipeline = DAGPipeline(config)
    try:
        assert pipeline.time_sharing.resident == {} and pipeline.run()["num_steps"] == 1
    finally:
        pipeline.shutdown()


def test_roles_that_share_no_device_with_the_other_turn_are_not_offloaded(tmp_path, calls):
    """The rollout alone on device 1: actor and reference share device 0, but compute in the same turn, so nobody
    ever has to give a device up; the setting is ignored, with a warning."""
    with pytest.warns(UserWarning, match="offload_idle_roles=true is ignored"):
        run_pipeline(RLVRPipeline, grpo(tmp_path, True, rollout_devices=[1], num_steps=2))
    assert calls and not [c for c in calls if c[1] in ("offload", "reload")]


def test_a_run_that_takes_turns_resumes_as_one_that_does_not(tmp_path, calls):
    """tiny-qwen2 on the hf strategy: 3 steps straight without offloading, or 2 steps and a resumed third with it."""
    config = dict(strategy="hf", save_every_steps=2, val_every_steps=2)  # the split run validates at step 2
    run_pipeline(RLVRPipeline, grpo(tmp_path / "straight", False, **config))
    run_pipeline(RLVRPipeline, grpo(tmp_path / "split", True, num_steps=2, **config))
    calls.clear()
    run_pipeline(RLVRPipeline, grpo(tmp_path / "split", True, resume="latest", **config))
    assert ("rollout", "offload") in calls and ("actor", "reload") in calls
    straight, split = run_metrics(str(tmp_path / "straight")), run_metrics(str(tmp_path / "split"))
    assert sorted(split) == [0, 1, 2, 3] and split == straight


def test_the_setting_takes_auto_true_or_false():
    assert TrainerConfig().offload_idle_roles == "auto"
    with pytest.raises(ValueError, match="offload_idle_roles 'yes' is not one of 'auto', true, false"):
        TrainerConfig(offload_idle_roles="yes")
    with pytest.warns(UserWarning, match="offload_idle_roles=true is ignored: SFT trains one role"):
        SFTConfig(data=DataConfig(), trainer=TrainerConfig(offload_idle_roles=True)).check()


def test_the_gpu_example_puts_vllm_and_the_training_roles_on_the_same_gpus_to_take_turns():
    _, config = resolve(os.path.join(EXAMPLES, "gpu_grpo.yaml"), [])
    assert config.rollout.strategy.name == "vllm" and not config.colocate_actor_rollout
    assert config.trainer.offload_idle_roles is True
    reference = config.reference or config.actor  # use_kl_loss: a reference laid out as the actor
    devices = {"actor": set(config.actor.device_mapping), "rollout": set(config.rollout.device_mapping),
               "reference": set(reference.device_mapping)}
    assert config.algorithm.use_kl_loss
    assert time_sharing_roles(devices, [["rollout"], ["actor", "reference", "critic"]]) == ["rollout", "actor",
                                                                                           "reference"]


@pytest.mark.ray
def test_roles_take_turns_on_ray(tmp_path, ray_cluster):
    """Worker processes of their own: the mock strategy in each refuses to compute, sync or save while offloaded."""
    config = grpo(tmp_path, True, num_steps=2, backend="ray", num_nodes=1, save_every_steps=1, val_every_steps=1)
    for role in (config.actor, config.rollout, config.reference):
        role.worker_cls = None  # CALLS would be another process's
    summary = run_pipeline(RLVRPipeline, config)
    assert summary["num_steps"] == 2
    row = read_metrics(str(tmp_path / "metrics.jsonl"))[-1]
    assert row["timing_s/offload"] > 0 and row["timing_s/reload"] > 0


# --- DPO and distillation: the frozen model takes turns with the policy --------------------------------------------

def recording(name: str, strategy: str = "hf", **fields) -> RoleConfig:
    return RoleConfig(worker_cls=f"{__name__}:Recording{name.title()}",
                      strategy=StrategyConfig(name=strategy, model="tiny-qwen2", **fields))


def turns_trainer(run_dir, offload) -> TrainerConfig:
    return TrainerConfig(backend="local", run_dir=str(run_dir), num_steps=2, num_prompts_per_step=4, val_every_steps=2,
                         save_every_steps=2, progress_bar=False, offload_idle_roles=offload)


def dpo(tmp_path, run, offload, strategy="hf") -> DPOConfig:
    pairs = tmp_path / "pairs.jsonl"
    if not pairs.exists():
        write_pairs(str(pairs), max_operand=9, num_val=8)
    return DPOConfig(actor=recording("actor", strategy, micro_batch_size_per_worker=4),
                     reference=recording("reference", strategy), pairs=PairDataConfig(train_path=str(pairs)),
                     data=DataConfig(max_operand=9, num_val_examples=8),
                     val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                     trainer=turns_trainer(tmp_path / run, offload))


@pytest.fixture
def recorded_rollout(monkeypatch):
    """The validation rollout (made by the pipeline, not by a config) records its calls too."""
    monkeypatch.setattr(policy, "RolloutWorker", RecordingRollout)


def test_dpos_reference_takes_turns_with_the_colocated_actor_and_changes_no_result(tmp_path, calls, recorded_rollout):
    run_pipeline(DPOPipeline, dpo(tmp_path, "on", True))
    # Offloaded by the first validation; each step it is reloaded to score the pairs and offloaded for the update.
    assert [method for role, method in calls if role == "reference"] == ["offload"] + ["reload", "forward", "offload"] * 2
    assert {role for role, method in calls if method in ("offload", "reload")} == {"reference"}
    replay(calls, {("actor", "train_step"): ["reference"], ("rollout", "generate"): ["reference"]})
    calls.clear()
    run_pipeline(DPOPipeline, dpo(tmp_path, "off", False))
    assert calls and not [c for c in calls if c[1] in ("offload", "reload")]
    assert run_metrics(str(tmp_path / "on")) == run_metrics(str(tmp_path / "off"))


def test_dpos_actor_rollout_and_reference_take_turns_when_none_share_tensors(tmp_path, calls, monkeypatch):
    """A mock actor, so the validation rollout (a mock too, here) is a separate role that receives its weights."""
    monkeypatch.setattr(dpo_module, "validation_rollout", lambda actor: recording("rollout", "mock"))
    run_pipeline(DPOPipeline, dpo(tmp_path, "on", True, strategy="mock"))  # the mock refuses to work offloaded
    replay(calls, {("actor", "train_step"): ["reference", "rollout"], ("reference", "forward"): ["actor", "rollout"],
                   ("rollout", "generate"): ["actor", "reference"]})
    assert {role for role, method in calls if method == "offload"} == {"actor", "rollout", "reference"}
    assert calls[-2:] == [("actor", "reload"), ("actor", "save_checkpoint")]  # saved from its device


def distill(run_dir, offload, mode, responses) -> DistillConfig:
    return DistillConfig(actor=recording("actor"), teacher=recording("teacher", seed=1),
                         algorithm=DistillSettings(loss_type="jsd", top_k=4, mode=mode, responses=responses),
                         data=DataConfig(max_operand=9, num_val_examples=8),
                         sampling=SamplingConfig(temperature=1.0, max_new_tokens=3, num_samples_per_prompt=2),
                         val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                         trainer=turns_trainer(run_dir, offload))


@pytest.mark.parametrize("mode, responses", [("off_policy", None), ("off_policy", "teacher"), ("on_policy", None)])
def test_the_teacher_takes_turns_with_the_student_and_changes_no_result(tmp_path, calls, recorded_rollout, mode,
                                                                        responses):
    run_pipeline(DistillPipeline, distill(tmp_path / "on", True, mode, responses))
    # It validates first, on its device; the student's first validation offloads it; each step it is reloaded to
    # score (and, with its own responses, first to generate them) and offloaded for the student's update.
    step = ["reload"] + ["generate"] * (responses == "teacher") + ["top_k_log_probs", "offload"]
    assert [method for role, method in calls if role == "teacher"] == ["generate", "offload"] + step * 2
    replay(calls, {("actor", "train_step"): ["teacher"], ("rollout", "generate"): ["teacher"]})
    calls.clear()
    run_pipeline(DistillPipeline, distill(tmp_path / "off", False, mode, responses))
    assert calls and not [c for c in calls if c[1] in ("offload", "reload")]
    assert run_metrics(str(tmp_path / "on")) == run_metrics(str(tmp_path / "off"))
