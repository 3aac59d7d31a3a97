"""A run's step checkpoints: one written atomically (its clusters, the pipeline's state, the manifest last), the last
few kept, and the one a resume names found, checked and read back; the RNG and sampling states they carry."""

from __future__ import annotations

import os
import random
import shutil
from typing import Callable

import numpy as np
import torch

from baton.checkpoint import (PIPELINE_STATE, directory_size, ensure_free_space, has_state, load_state, newest_intact,
                              save_state, verify_checkpoint, write_manifest, writing)
from baton.distributed import Cluster
from baton.pipelines.run_dir import checkpoint_path, list_checkpoints


def write_checkpoint(run_dir: str, step: int, clusters: dict[str, Cluster], pipeline_state: Callable[[], dict]) -> str:
    """Write `checkpoints/step_<step>` of `run_dir` atomically: a `.partial` directory (one directory per cluster,
    then `pipeline_state()`), its manifest written last, then the rename. Fails up front if the disk has less free
    space than the last checkpoint took; a full disk, a read-only file system or a denied permission raises
    CheckpointError in words, with the partial directory removed and earlier checkpoints as they were."""
    final = checkpoint_path(run_dir, step)
    partial = final + ".partial"
    found = list_checkpoints(run_dir)
    needed_bytes = directory_size(found[-1]) if found else None
    ensure_free_space(run_dir, needed_bytes, final)
    with writing(final, partial, needed_bytes):
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        for name, cluster in clusters.items():
            cluster.save_checkpoint(os.path.abspath(os.path.join(partial, name)))
        save_state(os.path.join(partial, PIPELINE_STATE), pipeline_state())
        write_manifest(partial)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
    return final


def prune_checkpoints(run_dir: str, keep_last: int, newest: str) -> None:
    """Remove all but the last `keep_last` (at least 1) checkpoints of `run_dir`, and never `newest`, the one just
    written (a newer one may be damaged)."""
    found = list_checkpoints(run_dir)
    kept = set(found[-max(keep_last, 1):]) | {newest}
    for old in found:
        if old not in kept:
            shutil.rmtree(old)


def resume_point(run_dir: str, resume: str | None) -> str | None:
    """The checkpoint that `trainer.resume` names, its files matching its manifest; None to start afresh. "latest":
    the run's newest intact checkpoint (saying on stderr which newer ones are damaged), or None if it has none; a path
    given that is damaged raises DamagedCheckpointError, one that is no checkpoint FileNotFoundError."""
    if resume is None:
        return None
    if resume == "latest":
        found = list_checkpoints(run_dir)
        return newest_intact(found) if found else None  # a damaged newer one is named on stderr and passed over
    if not has_state(os.path.join(resume, PIPELINE_STATE)):
        raise FileNotFoundError(f"trainer.resume={resume!r} is not a baton checkpoint (no {PIPELINE_STATE})")
    verify_checkpoint(resume)  # damaged: an error naming the file; a path given is never swapped for another
    return resume


def read_checkpoint(path: str, clusters: dict[str, Cluster]) -> dict:
    """Load checkpoint `path` into `clusters` (name → cluster, each from its own directory); returns the pipeline's
    state saved with it."""
    for name, cluster in clusters.items():
        cluster.load_checkpoint(os.path.abspath(os.path.join(path, name)))
    return load_state(os.path.join(path, PIPELINE_STATE))


def sampling_key(name: str) -> str:
    """The pipeline state's key of cluster `name`'s sampling state (e.g. "rollout_sampling")."""
    return f"{name}_sampling"


def sampling_states(clusters: dict[str, Cluster]) -> dict:
    """The sampling generators' states of `clusters` (name → cluster), by `sampling_key`, for exact resume."""
    return {sampling_key(name): cluster.sampling_state() for name, cluster in clusters.items()}


def load_sampling_states(clusters: dict[str, Cluster], state: dict) -> None:
    """Give `clusters` back the sampling states that `state` holds for them (an older checkpoint may hold none)."""
    for name, cluster in clusters.items():
        if state.get(sampling_key(name)) is not None:
            cluster.load_sampling_state(state[sampling_key(name)])


def rng_states() -> dict:
    """This process's Python, numpy and torch RNG states."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_states(states: dict) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
