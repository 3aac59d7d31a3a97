"""`Pipeline`: what every pipeline does besides its loop (ROLL's BasePipeline).

Before the loop: the checks, seeding, the Ray instance and resource manager, building the role clusters (in parallel).
In it: the steps under a progress bar, timing, validation, logging, checkpoints with exact resume, weight syncs, and
roles taking turns on shared devices. A subclass builds its clusters in `__init__` (saying which to checkpoint, which
carry sampling state, which take turns) and writes `run()` as a short loop that reads top to bottom.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
import warnings
from contextlib import contextmanager
from typing import Sequence

import numpy as np
import torch

from baton.config import ConfigError, dump_yaml, import_object, record_import_dirs, to_dict
from baton.datasets import PromptSampler
from baton.distributed import Cluster, LayoutError, ResourceManager, WorkerSpec, create_clusters_parallel
from baton.distributed.heap import frozen_heap
from baton.pipelines.checkpoints import (load_sampling_states, prune_checkpoints, read_checkpoint, resume_point,
                                         rng_states, sampling_states, set_rng_states, write_checkpoint)
from baton.pipelines.config import TrainerConfig, WorkerSettings
from baton.pipelines.preflight import check_devices_per_worker, check_roles, check_trackers
from baton.pipelines.ray_start import start_ray
from baton.pipelines.role_layout import describe_roles, devices_needed, model_roles
from baton.pipelines.run_dir import check_run_dir, checkpoint_path, remove_previous_run
from baton.pipelines.signals import TrainingInterrupted, deferred_interrupt
from baton.pipelines.time_sharing import TimeSharing
from baton.tracking import Tracker, plot_run, trace
from baton.tracking.health import HealthMonitor
from baton.tracking.progress import progress, quiet_library_bars
from baton.tracking.samples import batch_rows, print_validation
from baton.workers.weight_sync import ModelUpdatePair


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


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
        quiet_library_bars()  # before any worker starts, so that they inherit it
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
        self.checkpoint_clusters: list[str] = []  # saved with each checkpoint, loaded on resume
        self.sampling_clusters: list[str] = []  # whose sampling generators' states are saved (`pipeline_state`)
        self.update_pairs: list[ModelUpdatePair] = []
        self.timings: dict[str, float] = {}
        self.time_sharing = TimeSharing(self.clusters, self.manager, self.timer)  # off until `share_devices`
        self.global_step = 0
        self.last_saved_step: int | None = None
        self.resumed_from_step: int | None = None
        self.first_val: dict[str, float] | None = None  # validation before the first step, kept across resumes
        self.val_samples: list[dict] = []  # the last validation's sample rows (`validate` sets them)
        self.wall_s_before_resume = 0.0  # the wall time of the run's earlier parts (before the checkpoint it resumed)
        self.run_start_s = time.perf_counter()  # this part's start (reset by `make_tracker`, as the loop begins)
        self.sampler: PromptSampler | None = None  # the training data position, saved with checkpoints
        self.health: HealthMonitor | None = None  # made with the tracker, as the loop begins
        self.health_state: dict | None = None  # a resumed run's monitor state, from its checkpoint

    @classmethod
    def dry_run(cls, config):
        """What `baton run` checks before starting Ray (`baton config` runs it too): the config's `check()`, the
        roles' strategies and models, the machine and the trackers' packages (`preflight`), then the data, loaded and
        validated.
        Returns (train data, val data, tokenizer)."""
        if hasattr(config, "check"):
            config.check()
        check_roles(config, config.trainer)
        check_trackers(config.trainer)
        train, val, tokenizer = cls.load_data(config)
        per_step = getattr(config.trainer, "num_prompts_per_step", None)
        if train is not None and per_step is not None and per_step > cls.num_train_prompts(train):
            raise ConfigError(f"trainer.num_prompts_per_step={per_step} is more than the {cls.num_train_prompts(train)} "
                              "prompts of the training data: a step would take a prompt twice; lower "
                              "trainer.num_prompts_per_step or add data")
        return train, val, tokenizer

    @classmethod
    def num_train_prompts(cls, train) -> int:
        """How many prompts the training data holds (a step takes trainer.num_prompts_per_step of them)."""
        return len(train)

    @classmethod
    def load_data(cls, config):
        """(train, val, tokenizer): None for each, for a pipeline without prompt data; one with data loads it
        (`baton.datasets.load.load_datasets`, with the tokenizer of the role that reads it)."""
        return None, None, None

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

    def named(self, names: Sequence[str]) -> dict[str, Cluster]:
        """The clusters of `names`, by name."""
        return {name: self.clusters[name] for name in names}

    def share_devices(self, turns: Sequence[Sequence[str]], never_offloaded: Sequence[str] = ()) -> None:
        """Decide, by `trainer.offload_idle_roles`, which clusters take turns on their devices (`on_device`): the
        roles of each of `turns` (groups of roles that compute in different phases) that share a device with a role
        of another, but `never_offloaded` (roles fused into one process that share tensors). "auto" turns this on
        where the devices are GPUs."""
        roles = self.time_sharing.share(self.trainer.offload_idle_roles, turns, never_offloaded)
        if self.trainer.offload_idle_roles is True and not roles:
            apart = " / ".join(filter(None, (", ".join(n for n in turn if n in self.clusters) for turn in turns)))
            warnings.warn("trainer.offload_idle_roles=true is ignored: no role that can be offloaded shares a device "
                          f"with one that computes at another time ({describe_roles(self.config)}); give roles that "
                          f"compute at different times ({apart}) the same device_mapping to time-share devices",
                          stacklevel=2)

    def on_device(self, *roles: str) -> None:
        """Give `roles` the devices they take turns on (`share_devices`), offloading the roles that share them;
        timed as `timing_s/offload` and `timing_s/reload`. Does nothing where no role takes turns."""
        self.time_sharing.on_device(*roles)

    def sync_weights(self) -> None:
        """Each model-update pair's source weights into its destination (`update_pairs`), timed as `timing_s/sync`,
        with both on their devices (an offloaded, asleep vLLM takes no weights); then the destination holds the
        devices it takes turns on."""
        for pair in self.update_pairs:
            self.on_device(pair.src.name, pair.dst.name)
            with self.timer("sync"):
                pair.sync()
            self.on_device(pair.dst.name)

    # --- timing and logging -------------------------------------------------------------------

    @contextmanager
    def timer(self, name: str):
        """Time the block into `timing_s/<name>`; a stage timed several times in a step adds up."""
        start = time.perf_counter()
        yield
        key = f"timing_s/{name}"
        self.timings[key] = self.timings.get(key, 0.0) + time.perf_counter() - start
        if (current := trace.tracer()) is not None:
            end = time.time()
            current.span("trainer", name, end - (time.perf_counter() - start), end, step=self.global_step)

    # --- checkpoints --------------------------------------------------------------------------

    def pipeline_state(self) -> dict:
        """What besides the clusters a resume needs: step, data position, the sampling clusters' generators
        (`<name>_sampling`), RNG states."""
        health = self.health.state_dict() if self.health is not None else self.health_state
        return {"global_step": self.global_step, "first_val": self.first_val, "wall_s": self.wall_s(), "health": health,
                "sampler": self.sampler.state_dict() if self.sampler else None,
                **sampling_states(self.named(self.sampling_clusters)), "rng": rng_states()}

    def load_pipeline_state(self, state: dict) -> None:
        self.global_step = state["global_step"]
        self.first_val = state.get("first_val")  # absent in checkpoints written before it was kept
        self.wall_s_before_resume = state.get("wall_s", 0.0)  # absent in checkpoints written before it was kept
        self.health_state = state.get("health")  # the monitor's, loaded into it when the run starts (`make_tracker`)
        if self.sampler is not None:
            self.sampler.load_state_dict(state["sampler"])
        load_sampling_states(self.named(self.sampling_clusters), state)
        set_rng_states(state["rng"])

    def do_checkpoint(self, step: int) -> str:
        """Write `checkpoints/step_<step>` atomically (`write_checkpoint`: the checkpointed clusters and
        `pipeline_state()`), then keep the last `trainer.keep_last_checkpoints` and, always, this one."""
        self.on_device(*self.roles_to_save_from())
        final = write_checkpoint(self.trainer.run_dir, step, self.named(self.checkpoint_clusters), self.pipeline_state)
        if (current := trace.tracer()) is not None:
            current.flush()
        self.last_saved_step = step
        prune_checkpoints(self.trainer.run_dir, self.trainer.keep_last_checkpoints, final)
        return final

    def roles_to_save_from(self) -> list[str]:
        """The roles that hold their devices while a checkpoint is written (`on_device`): the checkpointed ones,
        whose state is read from their devices."""
        return list(self.checkpoint_clusters)

    def maybe_resume(self) -> None:
        """Load the checkpoint named by `trainer.resume` (`resume_point`: "latest" is the run's newest intact one) into
        every checkpointed cluster and the pipeline's state, then sync the weights."""
        resume = resume_point(self.trainer.run_dir, self.trainer.resume)
        if resume is None:
            return
        self.load_pipeline_state(read_checkpoint(resume, self.named(self.checkpoint_clusters)))
        for pair in self.update_pairs:
            pair.sync()
        self.resumed_from_step = self.global_step
        print(f"baton: resumed from step {self.global_step} of {self.trainer.num_steps} ({resume})", file=sys.stderr)

    # --- the loop --------------------------------------------------------------------------------

    def training_steps(self, desc: str):
        """The steps still to run (1-based), under a progress bar. A Ctrl-C lets the running step finish,
        checkpoints it, and raises TrainingInterrupted; resume with `trainer.resume=latest`."""
        trainer = self.trainer
        self.bar = progress(range(self.global_step + 1, trainer.num_steps + 1), desc, initial=self.global_step,
                            total=trainer.num_steps, enabled=trainer.progress_bar)
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
        """Validate when due, log, show `label`=metrics[key] and val accuracy on the progress bar, checkpoint when due.
        A step that counts its tokens (`perf/total_num_tokens`) logs them per second of the step (`perf/throughput`)."""
        trainer = self.trainer
        if "perf/total_num_tokens" in metrics and "timing_s/step" in self.timings:
            metrics["perf/throughput"] = metrics["perf/total_num_tokens"] / self.timings["timing_s/step"]
        last = step == trainer.num_steps
        if step % trainer.val_every_steps == 0 or last:
            metrics.update(self.validation(step))
        metrics.update(self.health.check(step, metrics, self.first_val))  # warns once per kind: health/<kind> = 1
        self.tracker.log(metrics, step=step)
        if (current := trace.tracer()) is not None:
            current.flush()
        self.bar.set_postfix({label: f"{metrics[key]:.3f}",
                              "val_acc": f"{metrics['val/accuracy']:.3f}" if "val/accuracy" in metrics else "-"})
        if step % trainer.save_every_steps == 0 or last:
            self.do_checkpoint(step)

    def first_validation(self) -> dict[str, float] | None:
        """Validate before the first step and log it as step 0 (if `val_before_train`); a resumed run returns
        the original run's, so that its summary still has a start accuracy."""
        if self.global_step == 0 and self.trainer.val_before_train:
            self.first_val = self.validation(0)
            if self.first_val:
                self.tracker.log(self.first_val, step=0)
        return self.first_val

    def summary(self, start: float, first_val: dict | None, metrics: dict[str, float], **extra) -> dict:
        """The run's summary.json: `wall_s` counts every part of a resumed run (the earlier parts' from the checkpoint
        it resumed, kept in `pipeline_state`), this part's from `start`."""
        resumed = {"resumed_from_step": self.resumed_from_step} if self.resumed_from_step is not None else {}
        return {"wall_s": self.wall_s_before_resume + time.perf_counter() - start, "num_steps": self.trainer.num_steps,
                **resumed,
                "start_val_accuracy": first_val.get("val/accuracy") if first_val else None,
                "final_val_accuracy": metrics.get("val/accuracy"), **extra}

    def wall_s(self) -> float:
        """The run's wall time so far, its earlier parts (before a resume) included."""
        return self.wall_s_before_resume + time.perf_counter() - self.run_start_s

    def validation(self, step: int) -> dict[str, float]:
        """`validate()`'s metrics; its sample rows (`val_samples`) go to samples.jsonl and the trackers, and the
        validation's line and samples table to the console (`print_validation`)."""
        self.val_samples = []
        metrics = self.validate()
        if self.val_samples:
            self.tracker.log_samples(self.val_samples, step)
        run = os.path.basename(os.path.normpath(self.trainer.run_dir))  # a stage's: "sft", "rlvr"
        print_validation(run, step, self.trainer.num_steps, metrics, self.val_samples)
        return metrics

    def validate(self) -> dict[str, float]:
        """The held-out metrics; a pipeline that generates also puts the rows of its first `trainer.log_samples`
        prompts in `self.val_samples` (`baton.tracking.samples.sample_row`)."""
        return {}

    def log_train_samples(self, step: int, batch) -> None:
        """At every `trainer.log_samples_every_steps`-th step, the rows (split "train") of the first
        `trainer.log_samples` prompts of the step's rewarded batch (`batch_rows`) to samples.jsonl and the trackers."""
        every, num_prompts = self.trainer.log_samples_every_steps, self.trainer.log_samples
        if every > 0 and num_prompts > 0 and step % every == 0:
            scores = batch.batch["scores"].tolist()
            self.tracker.log_samples(batch_rows(step, "train", batch, scores, self.tokenizer, num_prompts), step)

    # --- output -------------------------------------------------------------------------------

    def make_tracker(self) -> Tracker:
        """The run's tracker; this part of the run starts its clock here (`wall_s`)."""
        self.run_start_s = time.perf_counter()
        self.tracker = Tracker(self.trainer.run_dir, self.trainer.tracker, config=to_dict(self.config),
                               resumed_from_step=self.global_step if self.global_step > 0 else None)
        self.health = HealthMonitor(self.trainer.num_steps)  # reads each step's metrics (`end_step`)
        if self.trainer.trace:
            trace.start(self.trainer.run_dir, self.trainer.trace_every_groups)
        if self.health_state is not None:  # a resumed run: what it had seen and warned of
            self.health.load_state_dict(self.health_state)
        return self.tracker

    def finish(self, summary: dict) -> dict:
        """Write summary.json, the trace (`trainer.trace`) and the plot; returns the summary."""
        trace.stop()
        with open(os.path.join(self.trainer.run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        summary["plot"] = plot_run(self.trainer.run_dir)
        return summary

    def shutdown(self) -> None:
        trace.stop()  # a run that failed keeps its trace up to then
        for cluster in self.clusters.values():
            cluster.shutdown()
        self.manager.shutdown()


def run_pipeline(pipeline_cls, config) -> dict:
    """Build the pipeline, run it, and shut its clusters down however it ends; returns its summary."""
    pipeline = pipeline_cls(config)
    try:
        with frozen_heap():  # what the pipeline built stays out of the collector's full passes while it runs
            return pipeline.run()
    finally:
        if hasattr(pipeline, "shutdown"):
            pipeline.shutdown()
