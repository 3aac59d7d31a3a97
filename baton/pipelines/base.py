"""`Pipeline`: what every pipeline does besides its loop (ROLL's BasePipeline).

Seeding, the Ray instance and resource manager, building the role clusters (in parallel),
model-update pairs (training → inference weight sync), checkpoints with exact resume, the
tracker and the progress bar. A subclass builds its clusters in `__init__` and writes `run()`
as a short loop that reads top to bottom.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from contextlib import contextmanager

import numpy as np
import torch

from baton.config import dump_yaml, import_object, to_dict
from baton.datasets import PromptSampler
from baton.distributed import Cluster, ResourceManager, WorkerConfig, WorkerSpec, create_clusters_parallel
from baton.pipelines.config import RoleConfig, TrainerConfig
from baton.tracking import Tracker, plot_run
from baton.workers.weight_sync import ModelUpdatePair

CHECKPOINT_PREFIX = "step_"
MODEL_ROLES = ("actor", "rollout", "reference", "critic", "policy")  # "policy": actor + rollout fused


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def start_ray(trainer: TrainerConfig) -> None:
    """Join `trainer.ray_address`, or start a local Ray instance with an explicit CPU count."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    if ray.is_initialized():
        return
    if trainer.ray_address:
        ray.init(address=trainer.ray_address, logging_level="ERROR")
    else:
        ray.init(address="local", num_cpus=trainer.num_cpus or max(4, os.cpu_count() or 1), include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)


class Pipeline:
    """Base of the pipelines. `self.metrics_timer(name)` times a stage into `timing_s/<name>`."""

    def __init__(self, config, trainer: TrainerConfig):
        self.config = config
        self.trainer = trainer
        seed_everything(trainer.seed)
        os.makedirs(trainer.run_dir, exist_ok=True)
        with open(os.path.join(trainer.run_dir, "config.yaml"), "w") as f:
            f.write(dump_yaml(config))
        if trainer.backend == "ray":
            start_ray(trainer)
        # Reserve only the device slots the roles use (on a CPU-only machine every slot is a CPU that the
        # reward workers could otherwise use).
        self.manager = ResourceManager(trainer.num_nodes, trainer.num_devices_per_node or devices_needed(config),
                                       backend=trainer.backend)
        self.clusters: dict[str, Cluster] = {}
        self.checkpoint_clusters: list[str] = []
        self.update_pairs: list[ModelUpdatePair] = []
        self.timings: dict[str, float] = {}
        self.global_step = 0
        self.sampler: PromptSampler | None = None  # the training data position, saved with checkpoints

    # --- building -----------------------------------------------------------------------------

    def create_clusters(self, roles: dict[str, tuple[type, RoleConfig, tuple]]) -> dict[str, Cluster]:
        """Build several role clusters at once: name → (default worker class, role config, constructor args)."""
        requests = []
        for name, (default_cls, role, args) in roles.items():
            cls = import_object(role.worker_cls) if role.worker_cls else default_cls
            requests.append((WorkerSpec(cls, args), self.worker_config(name, role)))
        clusters = create_clusters_parallel(requests, self.manager)
        self.clusters.update(zip(roles, clusters))
        return dict(zip(roles, clusters))

    def worker_config(self, name: str, role: RoleConfig) -> WorkerConfig:
        # Model roles may be given the same devices: they time-share them (offloading between turns).
        world_size = role.world_size if role.world_size or role.device_mapping else 1
        return WorkerConfig(name, world_size=world_size, device_mapping=role.device_mapping,
                            num_devices_per_worker=role.num_devices_per_worker,
                            num_cpus_per_worker=role.num_cpus_per_worker, share_devices_with=MODEL_ROLES)

    # --- timing and logging -------------------------------------------------------------------

    @contextmanager
    def timer(self, name: str):
        start = time.perf_counter()
        yield
        self.timings[f"timing_s/{name}"] = time.perf_counter() - start

    # --- checkpoints --------------------------------------------------------------------------

    @property
    def checkpoint_root(self) -> str:
        return os.path.join(self.trainer.run_dir, "checkpoints")

    def pipeline_state(self) -> dict:
        """What besides the clusters a resume needs: step, data position, RNG states."""
        rollout = self.clusters.get("rollout")
        return {"global_step": self.global_step, "sampler": self.sampler.state_dict() if self.sampler else None,
                "rollout_sampling": rollout.sampling_state() if rollout is not None else None,
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}

    def load_pipeline_state(self, state: dict) -> None:
        self.global_step = state["global_step"]
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
        if state.get("rollout_sampling") is not None:
            self.clusters["rollout"].load_sampling_state(state["rollout_sampling"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])

    def do_checkpoint(self, step: int) -> str:
        """Write `checkpoints/step_<step>` atomically (a `.partial` directory renamed at the end); keep the last K."""
        final = os.path.join(self.checkpoint_root, f"{CHECKPOINT_PREFIX}{step}")
        partial = final + ".partial"
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
        for name in self.checkpoint_clusters:
            self.clusters[name].save_checkpoint(os.path.abspath(os.path.join(partial, name)))
        torch.save(self.pipeline_state(), os.path.join(partial, "pipeline_state.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        for old in list_checkpoints(self.checkpoint_root)[: -self.trainer.keep_last_checkpoints or None]:
            shutil.rmtree(old)
        return final

    def maybe_resume(self) -> None:
        """Load the checkpoint named by `trainer.resume` ("latest" or a path) into every checkpointed cluster."""
        resume = self.trainer.resume
        if resume is None:
            return
        if resume == "latest":
            found = list_checkpoints(self.checkpoint_root)
            if not found:
                return
            resume = found[-1]
        if not os.path.isfile(os.path.join(resume, "pipeline_state.pt")):
            raise FileNotFoundError(f"trainer.resume={resume!r} is not a baton checkpoint (no pipeline_state.pt)")
        for name in self.checkpoint_clusters:
            self.clusters[name].load_checkpoint(os.path.abspath(os.path.join(resume, name)))
        self.load_pipeline_state(torch.load(os.path.join(resume, "pipeline_state.pt"), weights_only=False))
        for pair in self.update_pairs:
            pair.sync()

    # --- the end of every step ---------------------------------------------------------------

    def end_step(self, step: int, metrics: dict[str, float], tracker: Tracker, bar, label: str, key: str) -> None:
        """Validate when due, log, show `label`=metrics[key] and val accuracy on the progress bar, checkpoint when due."""
        trainer = self.trainer
        last = step == trainer.num_steps
        if step % trainer.val_every_steps == 0 or last:
            metrics.update(self.validate())
        tracker.log(metrics, step=step)
        bar.set_postfix({label: f"{metrics[key]:.3f}",
                         "val_acc": f"{metrics['val/accuracy']:.3f}" if "val/accuracy" in metrics else "-"})
        if step % trainer.save_every_steps == 0 or last:
            self.do_checkpoint(step)

    def summary(self, start: float, first_val: dict | None, metrics: dict[str, float], **extra) -> dict:
        return {"wall_s": time.perf_counter() - start, "num_steps": self.trainer.num_steps,
                "start_val_accuracy": first_val["val/accuracy"] if first_val else None,
                "final_val_accuracy": metrics.get("val/accuracy"), **extra}

    def validate(self) -> dict[str, float]:
        return {}

    # --- output -------------------------------------------------------------------------------

    def make_tracker(self) -> Tracker:
        return Tracker(self.trainer.run_dir, self.trainer.tracker, config=to_dict(self.config),
                       resume=self.global_step > 0)

    def finish(self, summary: dict) -> dict:
        """Write summary.json and the plot; returns the summary."""
        with open(os.path.join(self.trainer.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        summary["plot"] = plot_run(self.trainer.run_dir)
        return summary

    def shutdown(self) -> None:
        for cluster in self.clusters.values():
            cluster.shutdown()
        self.manager.shutdown()


def devices_needed(config) -> int:
    """Device slots per node that the config's roles ask for (highest device id + 1; at least 1)."""
    needed = 1
    for value in vars(config).values():
        if isinstance(value, RoleConfig) and value.num_devices_per_worker > 0:
            count = (value.world_size or 1) * value.num_devices_per_worker
            needed = max(needed, max(value.device_mapping) + 1 if value.device_mapping else count)
    return needed


def list_checkpoints(root: str) -> list[str]:
    """Complete checkpoints under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    steps = sorted(int(d[len(CHECKPOINT_PREFIX):]) for d in os.listdir(root)
                   if d.startswith(CHECKPOINT_PREFIX) and d[len(CHECKPOINT_PREFIX):].isdigit())
    return [os.path.join(root, f"{CHECKPOINT_PREFIX}{s}") for s in steps]
