"""`Pipeline`: what every pipeline does besides its loop (ROLL's BasePipeline).

Seeding, the Ray instance and resource manager, building the role clusters (in parallel), roles
taking turns on shared devices (offload/reload), model-update pairs (training → inference weight
sync), checkpoints with exact resume, the tracker and the progress bar. A subclass builds its
clusters in `__init__` and writes `run()` as a short loop that reads top to bottom.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Sequence

import numpy as np
import torch
from tqdm import tqdm

from baton.checkpoint import (PIPELINE_STATE, directory_size, ensure_free_space, has_state, load_state,
                              newest_intact, save_state, verify_checkpoint, write_manifest, writing)
from baton.config import ConfigError, dump_yaml, import_object, ray_runtime_env, record_import_dirs, to_dict
from baton.datasets import PromptSampler
from baton.distributed import Cluster, LayoutError, ResourceManager, WorkerSpec, create_clusters_parallel
from baton.distributed.heap import frozen_heap
from baton.distributed.worker import usable_cpu_count
from baton.pipelines.config import TrainerConfig, WorkerSettings
from baton.datasets.load import load_datasets
from baton.pipelines.preflight import check_devices_per_worker, check_roles
from baton.pipelines.role_layout import describe_roles, devices_needed, model_roles
from baton.tracking import Tracker, plot_run
from baton.workers.weight_sync import ModelUpdatePair

CHECKPOINT_PREFIX = "step_"


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped training after a step; `checkpoint` holds that step."""

    def __init__(self, checkpoint: str):
        super().__init__(f"interrupted; the last finished step is saved in {checkpoint}")
        self.checkpoint = checkpoint


@contextmanager
def deferred_interrupt():
    """Within: a first Ctrl-C only sets the yielded event, so the caller can stop at a safe point; a second
    one raises KeyboardInterrupt at once. (Signals reach only the main thread; elsewhere this does nothing.)"""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def handler(signum, frame):
        if interrupted.is_set():
            raise KeyboardInterrupt
        interrupted.set()
        print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to stop at once, unsaved)",
              file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def start_ray(trainer: TrainerConfig) -> None:
    """Join `trainer.ray_address`, or start a local Ray instance with `trainer.num_cpus` logical CPUs (default: the
    cores this process may use, so that Ray does not place more CPU-only workers than there are cores).

    A local instance listens on the loopback address only (unless `trainer.ray_local_only` is false), so nothing
    outside this machine can reach it; Ray's token authentication is left as Ray sets it."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        running = ray.cluster_resources().get("CPU")
        if trainer.num_cpus and trainer.num_cpus != running:
            warnings.warn(f"trainer.num_cpus={trainer.num_cpus} is ignored: Ray is already running, with {running:g} "
                          "CPUs (set it where Ray starts: in the demo, sft.trainer.num_cpus)", stacklevel=2)
        return
    if not trainer.ray_address and trainer.ray_local_only:
        listen_on_loopback()
    import ray

    if trainer.ray_address:  # a local instance inherits PYTHONPATH; a cluster is told it (baton.config.paths)
        ray.init(address=trainer.ray_address, logging_level="ERROR", runtime_env=ray_runtime_env())
    else:
        ray.init(address="local", num_cpus=trainer.num_cpus or usable_cpu_count(), include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)


def listen_on_loopback() -> None:
    """Make a Ray instance started by this process take 127.0.0.1 as its node address (every Ray server then listens
    there only). Ray's switch for this is RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when Ray is imported."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # Ray was imported before this was set
        constants.ENABLE_RAY_CLUSTER = False


class Pipeline:
    """Base of the pipelines. `with self.timer(name):` times a stage into `timing_s/<name>`; `self.on_device(*roles)`
    hands the devices that roles take turns on (`share_devices`) to `roles` before they compute."""

    def __init__(self, config, trainer: TrainerConfig):
        # Everything that can be checked without workers fails here, before Ray starts: the run directory, the
        # config, the models, the machine, and every row of the data. Only then is a previous run removed (overwrite).
        check_run_dir(trainer)
        self.train_data, self.val_data, self.tokenizer = self.dry_run(config)
        self.config = config
        self.trainer = trainer
        if trainer.overwrite:
            remove_previous_run(trainer.run_dir)
        seed_everything(trainer.seed)
        os.makedirs(trainer.run_dir, exist_ok=True)
        with open(os.path.join(trainer.run_dir, "config.yaml"), "w") as f:
            f.write(dump_yaml(config))
        record_import_dirs(trainer.run_dir)  # loading that config.yaml later finds the same modules
        if trainer.backend == "ray":
            start_ray(trainer)
        # Reserve only the device slots the roles use (on a CPU-only machine every slot is a CPU that the
        # reward workers could otherwise use).
        per_node = trainer.num_devices_per_node or devices_needed(config, trainer.num_nodes or 1)
        try:
            self.manager = ResourceManager(trainer.num_nodes, per_node, backend=trainer.backend)
        except LayoutError as e:
            raise LayoutError(f"{e}. The roles ask for {per_node} device slot(s) per node ({describe_roles(config)}): lower "
                              "their world_size / device_mapping, or run on a Ray cluster with more (--ray-address)") from e
        if trainer.ray_address:  # the preflight could not know whether the joined cluster's slots are GPUs
            try:
                check_devices_per_worker(model_roles(config), has_gpus=self.manager.device_kind == "GPU")
            except Exception:
                self.manager.shutdown()
                raise
        self.clusters: dict[str, Cluster] = {}
        self.checkpoint_clusters: list[str] = []
        self.update_pairs: list[ModelUpdatePair] = []
        self.timings: dict[str, float] = {}
        self.resident: dict[str, bool] = {}  # role that takes turns on its devices -> whether it holds them now
        self.role_devices: dict[str, set[int]] = {}  # every cluster's devices, while roles take turns
        self.global_step = 0
        self.last_saved_step: int | None = None
        self.resumed_from_step: int | None = None
        self.first_val: dict[str, float] | None = None  # validation before the first step, kept across resumes
        self.sampler: PromptSampler | None = None  # the training data position, saved with checkpoints

    @classmethod
    def dry_run(cls, config):
        """What `baton run` checks before starting Ray (`baton config` runs it too): the config's `check()`, the
        roles' strategies and models and the machine (`preflight`), then the data, loaded and validated.
        Returns (train data, val data, tokenizer)."""
        if hasattr(config, "check"):
            config.check()
        check_roles(config, config.trainer)
        return cls.load_data(config)

    @classmethod
    def load_data(cls, config):
        """(train, val, tokenizer) of a config with `data` and `actor`; None for each where the pipeline has no data."""
        if getattr(config, "data", None) is None:
            return None, None, None
        return load_datasets(config.data, config.actor.strategy.tokenizer)

    # --- building -----------------------------------------------------------------------------

    def create_clusters(self, roles: dict[str, tuple[type, WorkerSettings, tuple]],
                        fused: dict[str, list[str]] | None = None) -> dict[str, Cluster]:
        """Build several role clusters at once, their processes starting together: name → (default worker class,
        role config, constructor args). fused: group name → roles that share one process per slot, laid out by
        the first role's config (e.g. {"policy": ["actor", "rollout"]})."""
        fused = fused or {}
        specs = {name: WorkerSpec(import_object(role.worker_cls) if role.worker_cls else cls, args)
                 for name, (cls, role, args) in roles.items()}
        requests = [({m: specs[m] for m in members}, roles[members[0]][1].worker_config(group))
                    for group, members in fused.items()]
        fused_roles = {m for members in fused.values() for m in members}
        requests += [(specs[name], roles[name][1].worker_config(name)) for name in roles if name not in fused_roles]
        clusters = {}
        for made in create_clusters_parallel(requests, self.manager):
            clusters.update(made if isinstance(made, dict) else {made.name: made})
        self.clusters.update(clusters)
        return clusters

    def share_devices(self, turns: Sequence[Sequence[str]], never_offloaded: Sequence[str] = ()) -> None:
        """Decide, by `trainer.offload_idle_roles`, which clusters take turns on their devices (`on_device`): the
        roles of each of `turns` (groups of roles that compute in different phases) that share a device with a role
        of another, but `never_offloaded` (roles fused into one process that share tensors). "auto" turns this on
        where the devices are GPUs."""
        setting = self.trainer.offload_idle_roles
        if setting is False or (setting == "auto" and not on_gpus(self.manager)):
            return
        devices = {name: cluster_devices(cluster) for name, cluster in self.clusters.items()}
        roles = time_sharing_roles(devices, turns, never_offloaded)
        if setting is True and not roles:
            warnings.warn("trainer.offload_idle_roles=true is ignored: no role that can be offloaded shares a device "
                          f"with one that computes at another time ({describe_roles(self.config)}); give the rollout "
                          "and the actor the same device_mapping to time-share devices", stacklevel=2)
        self.resident = dict.fromkeys(roles, True)  # built on their devices
        self.role_devices = devices

    def on_device(self, *roles: str) -> None:
        """Give `roles` their devices: offload each role that takes turns (`share_devices`), holds its devices and
        shares one with `roles` (first, to free the memory), then reload those of `roles` that are offloaded. Names
        that take no turns are passed over; so is everything when offloading is off. Timed as `timing_s/offload`
        and `timing_s/reload`."""
        wanted = {device for name in roles for device in self.role_devices.get(name, ())}
        for name, here in self.resident.items():
            if here and name not in roles and self.role_devices[name] & wanted:
                with self.timer("offload"):
                    self.clusters[name].offload()
                self.resident[name] = False
        for name in roles:
            if self.resident.get(name) is False:
                with self.timer("reload"):
                    self.clusters[name].reload()
                self.resident[name] = True

    def sync_rollout(self) -> None:
        """The actor's weights into its rollout (`update_pairs[0]`), timed as `timing_s/sync`, with both on their
        devices (an offloaded, asleep vLLM takes no weights); then the rollout holds the devices it takes turns on."""
        self.on_device("actor", "rollout")
        with self.timer("sync"):
            self.update_pairs[0].sync()
        self.on_device("rollout")

    # --- timing and logging -------------------------------------------------------------------

    @contextmanager
    def timer(self, name: str):
        """Time the block into `timing_s/<name>`; a stage timed several times in a step adds up."""
        start = time.perf_counter()
        yield
        key = f"timing_s/{name}"
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start

    # --- checkpoints --------------------------------------------------------------------------


    def pipeline_state(self) -> dict:
        """What besides the clusters a resume needs: step, data position, RNG states."""
        rollout = self.clusters.get("rollout")
        return {"global_step": self.global_step, "first_val": self.first_val,
                "sampler": self.sampler.state_dict() if self.sampler else None,
                "rollout_sampling": rollout.sampling_state() if rollout is not None else None,
                "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}

    def load_pipeline_state(self, state: dict) -> None:
        self.global_step = state["global_step"]
        self.first_val = state.get("first_val")  # absent in checkpoints written before it was kept
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
        if state.get("rollout_sampling") is not None:
            self.clusters["rollout"].load_sampling_state(state["rollout_sampling"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        torch.set_rng_state(state["rng"]["torch"])

    def do_checkpoint(self, step: int) -> str:
        """Write `checkpoints/step_<step>` atomically: a `.partial` directory, its manifest written last, then the
        rename. Fails up front if the disk has less free space than the last checkpoint took; a full disk, a
        read-only file system or a denied permission raises CheckpointError in words, with the partial directory
        removed and earlier checkpoints as they were. Keeps the last K and, always, this one."""
        self.on_device(*self.roles_to_save_from())
        final = checkpoint_path(self.trainer.run_dir, step)
        partial = final + ".partial"
        found = list_checkpoints(self.trainer.run_dir)
        needed_bytes = directory_size(found[-1]) if found else None
        ensure_free_space(self.trainer.run_dir, needed_bytes, final)
        with writing(final, partial, needed_bytes):
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
            for name in self.checkpoint_clusters:
                self.clusters[name].save_checkpoint(os.path.abspath(os.path.join(partial, name)))
            save_state(os.path.join(partial, PIPELINE_STATE), self.pipeline_state())
            write_manifest(partial)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(partial, final)
        self.last_saved_step = step
        found = list_checkpoints(self.trainer.run_dir)
        kept = set(found[-max(self.trainer.keep_last_checkpoints, 1):]) | {final}  # a newer one may be damaged
        for old in found:
            if old not in kept:
                shutil.rmtree(old)
        return final

    def roles_to_save_from(self) -> list[str]:
        """The roles that hold their devices while a checkpoint is written (`on_device`): the checkpointed ones,
        whose state is read from their devices."""
        return list(self.checkpoint_clusters)

    def maybe_resume(self) -> None:
        """Load the checkpoint named by `trainer.resume` into every checkpointed cluster, once its files match its
        manifest: "latest" takes the run's newest intact checkpoint (saying on stderr which newer ones are damaged);
        a path given that is damaged raises DamagedCheckpointError."""
        resume = self.trainer.resume
        if resume is None:
            return
        if resume == "latest":
            found = list_checkpoints(self.trainer.run_dir)
            if not found:
                return
            resume = newest_intact(found)  # a damaged newer one is named on stderr and passed over
        elif not has_state(os.path.join(resume, PIPELINE_STATE)):
            raise FileNotFoundError(f"trainer.resume={resume!r} is not a baton checkpoint (no {PIPELINE_STATE})")
        else:
            verify_checkpoint(resume)  # damaged: an error naming the file; a path given is never swapped for another
        for name in self.checkpoint_clusters:
            self.clusters[name].load_checkpoint(os.path.abspath(os.path.join(resume, name)))
        self.load_pipeline_state(load_state(os.path.join(resume, PIPELINE_STATE)))
        for pair in self.update_pairs:
            pair.sync()
        self.resumed_from_step = self.global_step
        print(f"baton: resumed from step {self.global_step} of {self.trainer.num_steps} ({resume})", file=sys.stderr)

    # --- the loop --------------------------------------------------------------------------------

    def training_steps(self, desc: str):
        """The steps still to run (1-based), under a progress bar. A Ctrl-C lets the running step finish,
        checkpoints it, and raises TrainingInterrupted; resume with `trainer.resume=latest`."""
        trainer = self.trainer
        self.bar = tqdm(range(self.global_step + 1, trainer.num_steps + 1), desc=desc, unit="step",
                        disable=not trainer.progress_bar, initial=self.global_step, total=trainer.num_steps)
        with deferred_interrupt() as interrupted:
            for step in self.bar:
                self.global_step, self.timings = step, {}
                yield step
                if interrupted.is_set() and step < trainer.num_steps:  # at the last step: just finish
                    self.bar.update(step - self.bar.n)  # tqdm counts a step when the next one starts: show this one
                    self.bar.close()
                    self.tracker.close()
                    if self.last_saved_step != step:
                        self.do_checkpoint(step)
                    raise TrainingInterrupted(checkpoint_path(self.trainer.run_dir, step))
        self.bar.close()

    def end_step(self, step: int, metrics: dict[str, float], label: str, key: str) -> None:
        """Validate when due, log, show `label`=metrics[key] and val accuracy on the progress bar, checkpoint when due."""
        trainer = self.trainer
        last = step == trainer.num_steps
        if step % trainer.val_every_steps == 0 or last:
            metrics.update(self.validate())
        self.tracker.log(metrics, step=step)
        self.bar.set_postfix({label: f"{metrics[key]:.3f}",
                              "val_acc": f"{metrics['val/accuracy']:.3f}" if "val/accuracy" in metrics else "-"})
        if step % trainer.save_every_steps == 0 or last:
            self.do_checkpoint(step)

    def first_validation(self) -> dict[str, float] | None:
        """Validate before the first step and log it as step 0 (if `val_before_train`); a resumed run returns
        the original run's, so that its summary still has a start accuracy."""
        if self.global_step == 0 and self.trainer.val_before_train:
            self.first_val = self.validate()
            if self.first_val:
                self.tracker.log(self.first_val, step=0)
        return self.first_val

    def summary(self, start: float, first_val: dict | None, metrics: dict[str, float], **extra) -> dict:
        resumed = {"resumed_from_step": self.resumed_from_step} if self.resumed_from_step is not None else {}
        return {"wall_s": time.perf_counter() - start, "num_steps": self.trainer.num_steps, **resumed,
                "start_val_accuracy": first_val.get("val/accuracy") if first_val else None,
                "final_val_accuracy": metrics.get("val/accuracy"), **extra}

    def validate(self) -> dict[str, float]:
        return {}

    # --- output -------------------------------------------------------------------------------

    def make_tracker(self) -> Tracker:
        self.tracker = Tracker(self.trainer.run_dir, self.trainer.tracker, config=to_dict(self.config),
                               resumed_from_step=self.global_step if self.global_step > 0 else None)
        return self.tracker

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


def on_gpus(manager: ResourceManager) -> bool:
    """Whether the model roles run on GPUs: Ray's slots are GPUs, or (local backend) this process sees CUDA."""
    return torch.cuda.is_available() if manager.backend == "local" else manager.device_kind == "GPU"


def cluster_devices(cluster: Cluster) -> set[int]:
    """The device ids a cluster's workers use (none for CPU-only workers)."""
    return {device for placement in cluster.placements for device in placement.device_ids}


def time_sharing_roles(devices: dict[str, set[int]], turns: Sequence[Sequence[str]],
                       never_offloaded: Sequence[str] = ()) -> list[str]:
    """The roles (of those in `devices`: role -> device ids) of each turn that share a device with a role of another
    turn, but `never_offloaded`."""
    turns = [[name for name in turn if name in devices] for turn in turns]
    return [name for i, turn in enumerate(turns) for name in turn if name not in never_offloaded
            and any(devices[name] & devices[other] for j, others in enumerate(turns) if j != i for other in others)]


def checkpoint_path(run_dir: str, step: int) -> str:
    """Where a run directory keeps the checkpoint of `step`."""
    return os.path.join(run_dir, "checkpoints", f"{CHECKPOINT_PREFIX}{step}")


def list_checkpoints(run_dir: str) -> list[str]:
    """The run directory's complete checkpoints, oldest first."""
    root = os.path.dirname(checkpoint_path(run_dir, 0))
    if not os.path.isdir(root):
        return []
    steps = sorted(int(d[len(CHECKPOINT_PREFIX):]) for d in os.listdir(root)
                   if d.startswith(CHECKPOINT_PREFIX) and d[len(CHECKPOINT_PREFIX):].isdigit())
    return [checkpoint_path(run_dir, s) for s in steps]


RUN_RECORDS = ("metrics.jsonl", "summary.json")  # with the checkpoints: what shows that a run wrote a directory
RUN_OUTPUTS = (*RUN_RECORDS, "metrics.png")  # with the checkpoints: what `trainer.overwrite` removes


def previous_run(run_dir: str) -> list[str]:
    """What `run_dir` holds that a new run would write over: a metrics.jsonl with records, summary.json, checkpoints."""
    held = [name for name in RUN_RECORDS if os.path.isfile(os.path.join(run_dir, name))
            and os.path.getsize(os.path.join(run_dir, name)) > 0]
    steps = [os.path.basename(path) for path in list_checkpoints(run_dir)]
    if steps:
        shown = ", ".join(steps) if len(steps) <= 3 else f"{steps[0]} to {steps[-1]} ({len(steps)})"
        held.append(f"checkpoints/{shown}")
    return held


def run_dir_in_use(where: str, held: str, prefix: str) -> ConfigError:
    """The refusal of a new run into a directory that holds a previous one; `prefix`: the settings' ("trainer.")."""
    return ConfigError(f"{where} holds a previous run ({held}), which a new run would overwrite. Continue it with "
                       f"{prefix}resume=latest, keep it by choosing another {prefix}run_dir=..., or replace it with "
                       f"{prefix}overwrite=true")


def check_run_dir(trainer: TrainerConfig) -> None:
    """Refuse a new run (`trainer.resume` null, `trainer.overwrite` false) into a run directory that holds one."""
    held = previous_run(trainer.run_dir)
    if held and trainer.resume is None and not trainer.overwrite:
        raise run_dir_in_use(f"trainer.run_dir {trainer.run_dir!r}", ", ".join(held), "trainer.")


def remove_previous_run(run_dir: str) -> None:
    """Remove the outputs of the run that wrote `run_dir` before (`RUN_OUTPUTS` and its checkpoints, partial ones
    too), so that no later `resume=latest` picks up one of its checkpoints; says so on stderr. Nothing else in
    `run_dir` is touched."""
    removed = [name for name in RUN_OUTPUTS if os.path.isfile(os.path.join(run_dir, name))]
    for name in removed:
        os.remove(os.path.join(run_dir, name))
    root = os.path.dirname(checkpoint_path(run_dir, 0))
    steps = sorted(d for d in os.listdir(root) if d.startswith(CHECKPOINT_PREFIX)
                   and d[len(CHECKPOINT_PREFIX):].removesuffix(".partial").isdigit()) if os.path.isdir(root) else []
    for step in steps:
        shutil.rmtree(os.path.join(root, step))
    if steps:
        removed.append(f"checkpoints ({', '.join(steps)})")
        if not os.listdir(root):
            os.rmdir(root)
    if removed:
        print(f"baton: overwrite=true: removed the previous run's {', '.join(removed)} from {run_dir}", file=sys.stderr)


def run_pipeline(pipeline_cls, config) -> dict:
    """Build the pipeline, run it, and shut its clusters down however it ends; returns its summary."""
    pipeline = pipeline_cls(config)
    try:
        with frozen_heap():  # what the pipeline built stays out of the collector's full passes while it runs
            return pipeline.run()
    finally:
        if hasattr(pipeline, "shutdown"):
            pipeline.shutdown()
