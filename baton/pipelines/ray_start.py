"""Starting the driver's Ray: join a cluster, or start a local instance that listens on the loopback address only."""

from __future__ import annotations

import os
import sys
import warnings

from baton.config import ray_runtime_env
from baton.distributed.worker import usable_cpu_count
from baton.pipelines.config import TrainerConfig


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
