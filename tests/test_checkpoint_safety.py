"""Checkpoints that run no code when read, check themselves against their manifest, fall back to an intact one, and
say disk errors in words: state files, planted pickles, damaged files, a full disk, pruning."""

from __future__ import annotations

import errno
import math
import os
import pickle
import random
import re
import shutil
from collections import namedtuple

import numpy as np
import pytest
import torch

from baton.checkpoint import (MANIFEST, PIPELINE_STATE, CheckpointError, DamagedCheckpointError, load_state,
                              save_state, verify_manifest, write_manifest, writing)
from baton.datasets import PromptSampler
from baton.distributed import Cluster, Dispatch, WorkerConfig, WorkerError, WorkerSpec, register
from baton.pipelines.base import run_pipeline
from baton.pipelines.config import DataConfig, RLVRConfig, RoleConfig, SamplingConfig, TrainerConfig
from baton.pipelines.rlvr import RLVRPipeline
from baton.strategy import SchedulerConfig, StrategyConfig
from baton.strategy.hf import lr_lambda
from baton.workers.roles import ActorWorker
from baton.tracking import run_metrics

DiskUsage = namedtuple("DiskUsage", "total used free")


def grpo(run_dir, strategy="mock", **trainer) -> RLVRConfig:
    role = RoleConfig(strategy=StrategyConfig(name=strategy, model="tiny-qwen2"))
    settings = dict(backend="local", run_dir=str(run_dir), num_prompts_per_step=4, val_every_steps=2, save_every_steps=2,
                    progress_bar=False)
    return RLVRConfig(actor=role, rollout=role, colocate_actor_rollout=strategy == "hf",
                      data=DataConfig(max_operand=9, num_val_examples=8),
                      sampling=SamplingConfig(max_new_tokens=3, num_samples_per_prompt=2),
                      val_sampling=SamplingConfig(temperature=0.0, max_new_tokens=3, num_samples_per_prompt=1),
                      trainer=TrainerConfig(**{**settings, **trainer}))


def same(a, b) -> bool:
    """Equal values of the same types all the way down (tensors: dtype, shape and bits; nan equals nan)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        bits = [t.reshape(-1).view(torch.uint8) for t in (a, b)]
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    return a == b


class Payload:
    """Unpickling this creates `marker`: what a planted checkpoint file would do with code of its own."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


# --- state files --------------------------------------------------------------------------------------


def test_state_files_round_trip_every_state_exactly(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(StrategyConfig(
        scheduler=SchedulerConfig(name="cosine", warmup_steps=1, total_steps=5))))
    for _ in range(2):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        optimizer.step()
        scheduler.step()
    sampler = PromptSampler(10, seed=3)
    generator = torch.Generator().manual_seed(5)
    torch.rand(3, generator=generator)
    state = {
        "python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "generator": generator.get_state(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "sampler": sampler.state_dict(),
        "odd": {1: (2.5, float("nan"), float("inf")), (1, "a"): [None, True]},
        "looks_tagged": {"__tensor__": "0", "__tuple__": [1]},  # plain data that uses the file's tag names
        "arrays": [np.arange(6, dtype=np.uint32).reshape(2, 3), np.zeros((0, 2), dtype=np.float16), np.array(True)],
        "tensors": [torch.arange(10).view(2, 5).t(), torch.tensor(1.5, dtype=torch.bfloat16), torch.empty(0)],
    }
    state["tensors"].append(state["tensors"][0])  # the same tensor twice
    path = str(tmp_path / "all.state")
    save_state(path, state)
    loaded = load_state(path)
    assert same(loaded, state)
    assert isinstance(loaded["optimizer"]["state"], dict) and list(loaded["optimizer"]["state"]) == [0, 1]

    # Restored, each state draws or steps as the original does.
    random.setstate(loaded["python"])
    np.random.set_state(loaded["numpy"])
    torch.set_rng_state(loaded["torch"])
    drawn = random.random(), np.random.rand(), torch.rand(1)
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    assert same((random.random(), np.random.rand(), torch.rand(1)), drawn)
    twin = torch.Generator()
    twin.set_state(loaded["generator"])
    assert torch.equal(torch.rand(4, generator=twin), torch.rand(4, generator=generator))

    copy = torch.nn.Linear(3, 2)
    copy.load_state_dict(model.state_dict())
    copy_optimizer = torch.optim.AdamW(copy.parameters(), lr=1e-2)
    copy_scheduler = torch.optim.lr_scheduler.LambdaLR(copy_optimizer, lr_lambda(StrategyConfig(
        scheduler=SchedulerConfig(name="cosine", warmup_steps=1, total_steps=5))))
    copy_optimizer.load_state_dict(loaded["optimizer"])
    copy_scheduler.load_state_dict(loaded["scheduler"])
    batch = torch.randn(4, 3)
    for net, opt, sched in ((model, optimizer, scheduler), (copy, copy_optimizer, copy_scheduler)):
        opt.zero_grad()
        net(batch).pow(2).sum().backward()
        opt.step()
        sched.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), copy.parameters()))
    assert copy_scheduler.get_last_lr() == scheduler.get_last_lr()

    with pytest.raises(TypeError, match="cannot save a object"):
        save_state(str(tmp_path / "bad.state"), {"x": object()})


def test_a_checkpoint_from_before_state_files_still_loads_its_plain_data(tmp_path):
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
           "sampler": torch.Generator().get_state()}
    torch.save(old, tmp_path / "rng.pt")
    assert same(load_state(str(tmp_path / "rng.state")), old)


def test_a_planted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "payload_ran"
    with open(tmp_path / "plain.state", "wb") as f:  # a pickle in a state file's place
        pickle.dump(Payload(marker), f)
    with pytest.raises(CheckpointError, match="plain.state is not a baton state file"):
        load_state(str(tmp_path / "plain.state"))
    for name in ("legacy", "raw"):  # an older checkpoint's .pt: torch.save's zip format, and a bare pickle
        if name == "legacy":
            torch.save({"rng": Payload(marker)}, tmp_path / f"{name}.pt")
        else:
            (tmp_path / f"{name}.pt").write_bytes(pickle.dumps(Payload(marker), protocol=2))
        with pytest.raises(CheckpointError, match=rf"{name}.pt .* baton does not unpickle them"):
            load_state(str(tmp_path / f"{name}.state"))
    assert not marker.exists()


def test_a_planted_pickle_in_the_latest_checkpoint_is_passed_over_unrun(tmp_path, capsys):
    run_pipeline(RLVRPipeline, grpo(tmp_path, num_steps=4))
    marker = tmp_path / "payload_ran"
    state = tmp_path / "checkpoints" / "step_4" / PIPELINE_STATE
    state.write_bytes(pickle.dumps(Payload(marker), protocol=2))
    capsys.readouterr()

    summary = run_pipeline(RLVRPipeline, grpo(tmp_path, num_steps=4, resume="latest"))
    err = capsys.readouterr().err
    assert f"checkpoint {tmp_path / 'checkpoints' / 'step_4'} is damaged: {PIPELINE_STATE} is " in err
    assert f"falling back to {tmp_path / 'checkpoints' / 'step_2'}" in err
    assert summary["resumed_from_step"] == 2 and not marker.exists()

    # An older checkpoint (no manifest) whose pipeline_state.pt holds a payload: refused, named, not run.
    old = tmp_path / "checkpoints" / "step_2"
    os.remove(old / MANIFEST)
    os.remove(old / PIPELINE_STATE)
    torch.save({"global_step": 2, "rng": Payload(marker)}, old / "pipeline_state.pt")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(old / 'pipeline_state.pt'))} .* baton does not unpickle"):
        run_pipeline(RLVRPipeline, grpo(tmp_path, num_steps=4, resume=str(old)))
    assert "has no manifest.json" in capsys.readouterr().err
    assert not marker.exists()


# --- damaged checkpoints -------------------------------------------------------------------------------


def test_a_truncated_model_file_falls_back_to_the_previous_checkpoint_and_the_run_continues_exactly(tmp_path, capsys):
    from safetensors.torch import load_file

    from baton.pipelines.evaluate import resolve_checkpoint

    run_pipeline(RLVRPipeline, grpo(tmp_path, "hf", num_steps=4))
    straight = run_metrics(str(tmp_path))
    step_2, step_4 = tmp_path / "checkpoints" / "step_2", tmp_path / "checkpoints" / "step_4"
    weights = {k: v.clone() for k, v in load_file(step_4 / "actor" / "model.safetensors").items()}  # not mapped
    assert resolve_checkpoint(str(step_4)) == str(step_4 / "actor")  # `baton eval` still finds the model
    model_file = step_4 / "actor" / "model.safetensors"
    size = model_file.stat().st_size
    with open(model_file, "r+b") as f:
        f.truncate(size // 2)
    capsys.readouterr()

    summary = run_pipeline(RLVRPipeline, grpo(tmp_path, "hf", num_steps=4, resume="latest"))
    err = capsys.readouterr().err
    assert (f"checkpoint {step_4} is damaged: actor/model.safetensors is {size // 2} bytes; the manifest says {size}"
            in err)
    assert f"falling back to {step_2}, the newest intact checkpoint" in err
    assert summary["resumed_from_step"] == 2
    assert run_metrics(str(tmp_path)) == straight  # steps 3 and 4 again, as they went the first time
    again = load_file(step_4 / "actor" / "model.safetensors")
    assert all(torch.equal(weights[k], again[k]) for k in weights)
    assert verify_manifest(str(step_4))


def test_a_damaged_checkpoint_named_explicitly_is_an_error_and_none_intact_is_too(tmp_path, capsys):
    run_pipeline(RLVRPipeline, grpo(tmp_path, num_steps=4))
    step_2, step_4 = tmp_path / "checkpoints" / "step_2", tmp_path / "checkpoints" / "step_4"
    os.remove(step_4 / "actor" / "mock_state.state")
    with pytest.raises(DamagedCheckpointError,
                       match=rf"checkpoint {re.escape(str(step_4))} is damaged: actor/mock_state.state is missing"):
        run_pipeline(RLVRPipeline, grpo(tmp_path, num_steps=6, resume=str(step_4)))

    (step_2 / MANIFEST).write_text('{"files": {"actor": 1}}')
    with pytest.raises(DamagedCheckpointError, match=rf"{re.escape(str(step_2))} is damaged: {MANIFEST} cannot be read"):
        run_pipeline(RLVRPipeline, grpo(tmp_path, num_steps=6, resume=str(step_2)))
    write_manifest(str(step_2))
    (step_2 / "notes.txt").write_text("added later")
    with pytest.raises(CheckpointError, match=rf"no intact checkpoint in {re.escape(str(tmp_path / 'checkpoints'))}: "
                                              r"checkpoint .*step_4 is damaged: actor/mock_state.state is missing; "
                                              r"checkpoint .*step_2 is damaged: notes.txt is not in its manifest"):
        run_pipeline(RLVRPipeline, grpo(tmp_path, num_steps=6, resume="latest"))


# --- disk errors ---------------------------------------------------------------------------------------


@pytest.fixture
def pipeline(tmp_path):
    """An RLVR pipeline on the mock strategy, built but not run, keeping one checkpoint."""
    pipeline = RLVRPipeline(grpo(tmp_path / "run", num_steps=4, keep_last_checkpoints=1))
    yield pipeline
    pipeline.shutdown()


def checkpoints(pipeline) -> list[str]:
    return sorted(os.listdir(os.path.join(pipeline.trainer.run_dir, "checkpoints")))


def failing(code: int):
    """A state-file writer whose every write fails with `code`."""
    def save_state(path, obj):
        raise OSError(code, os.strerror(code), path)
    return save_state


def test_a_full_disk_says_so_removes_the_partial_checkpoint_and_keeps_the_earlier_one(pipeline, monkeypatch):
    import baton.strategy.mock as mock

    step_1 = pipeline.do_checkpoint(1)
    size = sum(os.path.getsize(os.path.join(root, f)) for root, _, names in os.walk(step_1) for f in names)
    step_2 = os.path.join(pipeline.trainer.run_dir, "checkpoints", "step_2")
    monkeypatch.setattr(mock, "save_state", failing(errno.ENOSPC))
    with pytest.raises(CheckpointError) as info:
        pipeline.do_checkpoint(2)
    assert re.fullmatch(rf"cannot write checkpoint {re.escape(step_2)}: no space left on device: needs about "
                        rf"{size / 1e3:.1f} kB, [\d.]+ [kMG]B free \(writing {re.escape(step_2)}.partial/actor.partial/"
                        r"mock_state.state\)", str(info.value)), str(info.value)
    assert info.value.errno == errno.ENOSPC
    assert checkpoints(pipeline) == ["step_1"] and verify_manifest(step_1)

    for code, words in ((errno.EROFS, "read-only file system"), (errno.EACCES, "permission denied"),
                        (errno.EPERM, "permission denied")):
        monkeypatch.setattr(mock, "save_state", failing(code))
        with pytest.raises(CheckpointError, match=f"cannot write checkpoint {re.escape(step_2)}: {words} "):
            pipeline.do_checkpoint(2)
        assert checkpoints(pipeline) == ["step_1"]
    monkeypatch.undo()
    pipeline.do_checkpoint(2)  # with the disk back, the next save works
    assert checkpoints(pipeline) == ["step_2"]


def test_the_errno_of_a_safetensors_write_is_read_from_its_message(tmp_path):
    """safetensors raises its own error type for I/O errors, with the errno only in the text."""
    from safetensors import SafetensorError

    final = str(tmp_path / "step_1")
    with pytest.raises(CheckpointError, match=f"cannot write checkpoint {re.escape(final)}: read-only file system$"):
        with writing(final, final + ".partial"):
            raise SafetensorError('Error while serializing: I/O error: Read-only file system (os error 30) at path "x"')
    with pytest.raises(SafetensorError):  # any other failure is left as it is
        with writing(final, final + ".partial"):
            raise SafetensorError("Error while serializing: HeaderTooLarge")


def test_too_little_free_space_fails_before_writing(pipeline, monkeypatch):
    step_1 = pipeline.do_checkpoint(1)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: DiskUsage(10**9, 10**9 - 100, 100))
    run_dir = pipeline.trainer.run_dir
    with pytest.raises(CheckpointError, match=rf"cannot write checkpoint {re.escape(run_dir)}/checkpoints/step_2: no "
                                              rf"space left on device for the run directory {re.escape(run_dir)}: "
                                              r"needs about [\d.]+ kB \(the size of the last checkpoint\), 0.1 kB free"):
        pipeline.do_checkpoint(2)
    assert checkpoints(pipeline) == ["step_1"] and verify_manifest(step_1)


def test_pruning_keeps_the_new_checkpoint_when_a_newer_one_is_damaged(pipeline):
    pipeline.do_checkpoint(2)
    step_4 = pipeline.do_checkpoint(4)
    assert checkpoints(pipeline) == ["step_4"]  # keep_last_checkpoints=1
    os.remove(os.path.join(step_4, "actor", "mock_state.state"))
    step_3 = pipeline.do_checkpoint(3)  # as after falling back from a damaged step_4
    assert checkpoints(pipeline) == ["step_3", "step_4"] and verify_manifest(step_3)
    pipeline.trainer.keep_last_checkpoints = 0
    pipeline.do_checkpoint(5)
    assert checkpoints(pipeline) == ["step_5"]


class FullDiskActor(ActorWorker):
    """An actor whose disk is full when it writes its checkpoint (in its own Ray process)."""

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, overwrite: bool = False) -> None:
        import baton.strategy.mock as mock

        mock.save_state = failing(errno.ENOSPC)
        super().save_checkpoint(path, overwrite)


@pytest.mark.ray
def test_a_full_disk_in_a_ray_worker_is_said_in_words(tmp_path, make_manager):
    """The driver sees a WorkerError; the worker's own error, its cause, carries the errno across Ray."""
    final, partial = str(tmp_path / "step_2"), str(tmp_path / "step_2.partial")
    spec = WorkerSpec(FullDiskActor, (StrategyConfig(name="mock"),))
    with Cluster(spec, WorkerConfig("actor", world_size=1), make_manager("ray")) as cluster:
        with pytest.raises(CheckpointError) as info:
            with writing(final, partial):
                os.makedirs(partial)
                cluster.save_checkpoint(os.path.join(partial, "actor"))
    assert re.fullmatch(rf"cannot write checkpoint {re.escape(final)}: no space left on device: [\d.]+ [kMG]B free "
                        rf"\(writing {re.escape(partial)}/actor.partial/mock_state.state\)", str(info.value))
    assert isinstance(info.value.__cause__, WorkerError) and not os.path.exists(partial)
