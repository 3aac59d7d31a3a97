"""Roles that take turns on shared devices: which of them do, and handing the devices to the roles about to compute
(the others that share them offloaded first, these reloaded)."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Sequence

import torch

from baton.distributed import Cluster, ResourceManager


class TimeSharing:
    """The clusters of a pipeline (`clusters`, filled as they are built) that take turns on their devices (`share`),
    which of them hold their devices now (`resident`), and the turns (`turns`: the roles of each turn that share a
    device with a role of another, whether or not they are offloaded themselves; turns without one left out).
    `timer(name)` times a stage (the pipeline's timer)."""

    def __init__(self, clusters: dict[str, Cluster], manager: ResourceManager,
                 timer: Callable[[str], AbstractContextManager]):
        self.clusters = clusters
        self.manager = manager
        self.timer = timer
        self.resident: dict[str, bool] = {}  # role that takes turns on its devices -> whether it holds them now
        self.role_devices: dict[str, set[int]] = {}  # every cluster's devices, while roles take turns
        self.turns: list[list[str]] = []  # the roles of each turn that share a device with another turn's

    def share(self, setting: bool | str, turns: Sequence[Sequence[str]], never_offloaded: Sequence[str] = ()) -> list[str]:
        """By `setting` (`trainer.offload_idle_roles`; "auto" is on where the devices are GPUs), make the roles of
        each of `turns` (groups of roles that compute in different phases) that share a device with a role of another
        take turns, but `never_offloaded` (roles fused into one process that share tensors). Returns those roles."""
        if setting is False or (setting == "auto" and not on_gpus(self.manager)):
            return []
        devices = {name: cluster_devices(cluster) for name, cluster in self.clusters.items()}
        roles = time_sharing_roles(devices, turns, never_offloaded)
        self.resident = dict.fromkeys(roles, True)  # built on their devices
        self.role_devices = devices
        sharing = time_sharing_roles(devices, turns)
        self.turns = [members for turn in turns if (members := [name for name in turn if name in sharing])]
        return roles

    def on_device(self, *roles: str) -> None:
        """Give `roles` their devices: offload each role that takes turns, holds its devices and shares one with
        `roles` (first, to free the memory), then reload those of `roles` that are offloaded. Names that take no
        turns are passed over; so is everything when no role takes turns. Timed as `offload` and `reload`."""
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
