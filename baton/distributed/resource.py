"""Devices and where workers go: `ResourceManager`, `ResourcePool`, and `device_mapping` placement.

The manager numbers every device slot of the cluster it manages: node 0's slots are 0..k-1,
node 1's are k..2k-1, and so on. A slot is a GPU, or a CPU when the Ray cluster has no GPUs. On
Ray it reserves one placement group per node, one bundle per slot; a worker runs in the bundle
of its first device and asks only a sliver of it, so clusters that time-share devices (training
and inference on the same GPUs) fit side by side. Overlap is allowed only when asked for. A
worker with several GPU slots (an inference engine's tensor-parallel ranks in one process) is
shown the GPUs of all its bundles through `CUDA_VISIBLE_DEVICES`.
"""

from __future__ import annotations

import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Sequence

from baton.distributed.errors import LayoutError, OversubscriptionWarning

_SLIVER = 0.01  # resource a worker asks of its device's bundle; leaves room for time-sharing clusters
# Ray's switch that leaves a worker's CUDA_VISIBLE_DEVICES as its runtime_env sets it (ray/_private/accelerators/nvidia_gpu.py).
_NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class Placement:
    """Where one worker goes."""

    node_index: int
    device_ids: tuple[int, ...]
    local_rank: int
    local_world_size: int
    ray_options: dict = field(default_factory=dict, hash=False, compare=False)
    num_cpus: float = 1.0  # the CPU share the worker may use: its default number of torch threads


class ResourceManager:
    """The devices baton may use: `num_nodes` × `num_devices_per_node` slots.

    backend "ray": discovered from the running Ray cluster (call `ray.init` first); a slot is a
    GPU, or a CPU on a cluster without GPUs. Defaults: every alive node that has a slot, and the
    smallest per-node slot count among them. CPU-only workers (no devices) are spread over these
    nodes and need free CPUs beside the reserved slots: on a CPU-only cluster, reserve fewer
    slots than the node has CPUs.
    backend "local": a virtual layout for in-process clusters (default one node of one slot).

    A worker of several GPU slots (`num_devices_per_worker` > 1 on GPUs) runs in its first slot's
    bundle and sees every GPU of its slots: Ray's GPU id of each slot's bundle is asked of a tiny
    task in that bundle (once per slot, within `ready_timeout_s`), and the worker starts with
    `CUDA_VISIBLE_DEVICES` set to them in `device_mapping` order. Only a process that drives
    several GPUs itself can use them (the `vllm` strategy's tensor parallelism; the pipelines'
    config checks refuse other strategies); a one-GPU worker sees the one GPU Ray gives it.

    A worker's CPU share is its `num_cpus_per_worker` (CPU-only workers), its slots (a slot that
    is a CPU), or `num_cpus_per_gpu` (GPU slots, however many). The manager refuses CPU-only
    workers that cannot fit on a node beside its slots, and warns once when the torch threads of
    the worker processes on a node outnumber that node's cores.
    """

    def __init__(
        self,
        num_nodes: int | None = None,
        num_devices_per_node: int | None = None,
        *,
        backend: str = "ray",
        num_cpus_per_gpu: float = 1.0,
        run_name: str | None = None,
        ready_timeout_s: float = 60.0,
    ):
        self.backend = backend
        self.run_name = run_name or f"baton-{uuid.uuid4().hex[:8]}"
        self.num_cpus_per_gpu = num_cpus_per_gpu
        self._claims: dict[int, list[str]] = {}
        self._cpu_claims: dict[str, list[tuple[int, float]]] = {}  # CPU-only cluster -> (node index, CPUs) per worker
        self._threads: dict[str, list[tuple]] = {}  # cluster -> (node index, first device, threads, cores) per process
        self._node_cpus: list[float] | None = None  # Ray's CPUs per node (None on the local backend: no limit)
        self._warned_oversubscribed = False
        self._placement_groups: list = []
        self._gpu_ids: dict[int, str] = {}  # device slot -> the GPU id Ray assigned to its bundle (multi-GPU workers)
        self._ready_timeout_s = ready_timeout_s
        if backend == "local":
            self.device_kind = "CPU"
            self.num_nodes = num_nodes or 1
            self.num_devices_per_node = num_devices_per_node or 1
            self._node_ids = [f"local-{i}" for i in range(self.num_nodes)]
        elif backend == "ray":
            self._reserve_on_ray(num_nodes, num_devices_per_node, num_cpus_per_gpu, ready_timeout_s)
        else:
            raise ValueError(f"unknown backend {backend!r}; valid: ['local', 'ray']")

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.num_devices_per_node

    def pool(self, device_ids: Sequence[int] | None = None) -> "ResourcePool":
        """A pool over some (default: all) of this manager's devices."""
        ids = tuple(range(self.num_devices)) if device_ids is None else tuple(device_ids)
        self._check_ids(ids, "pool")
        return ResourcePool(self, ids)

    # --- placement -------------------------------------------------------------------------

    def place(
        self,
        cluster_name: str,
        world_size: int,
        device_mapping: Sequence[int] | None,
        num_devices_per_worker: int,
        num_cpus_per_worker: float,
        share_devices_with: Sequence[str] = (),
    ) -> list[Placement]:
        """Validate a cluster's layout, claim its devices, and say where each worker goes."""
        if num_devices_per_worker == 0:
            return self._place_cpu_only(cluster_name, world_size, num_cpus_per_worker)
        mapping = tuple(device_mapping)
        self._check_ids(mapping, f"cluster {cluster_name!r} device_mapping")
        if len(mapping) != world_size * num_devices_per_worker:
            raise LayoutError(
                f"cluster {cluster_name!r}: device_mapping has {len(mapping)} devices but world_size={world_size} × "
                f"num_devices_per_worker={num_devices_per_worker} needs {world_size * num_devices_per_worker}; "
                "change one of them so they agree"
            )
        self._claim(cluster_name, mapping, share_devices_with)
        placements, per_node = [], {}
        for rank in range(world_size):
            devices = mapping[rank * num_devices_per_worker : (rank + 1) * num_devices_per_worker]
            nodes = {d // self.num_devices_per_node for d in devices}
            if len(nodes) > 1:
                self.release(cluster_name)
                raise LayoutError(
                    f"cluster {cluster_name!r}: worker {rank} would span nodes {sorted(nodes)} (devices {list(devices)}); "
                    f"a worker's devices must be on one node of {self.num_devices_per_node} devices"
                )
            per_node.setdefault(nodes.pop(), []).append(rank)
        try:
            for rank in range(world_size):
                devices = mapping[rank * num_devices_per_worker : (rank + 1) * num_devices_per_worker]
                node = devices[0] // self.num_devices_per_node
                placements.append(
                    Placement(node, devices, per_node[node].index(rank), len(per_node[node]), self._device_options(devices),
                              num_cpus=self._slot_cpus * (1 if self.device_kind == "GPU" else num_devices_per_worker))
                )
        except BaseException:
            self.release(cluster_name)
            raise
        return placements

    def release(self, cluster_name: str) -> None:
        for users in self._claims.values():
            while cluster_name in users:
                users.remove(cluster_name)
        self._cpu_claims.pop(cluster_name, None)
        self._threads.pop(cluster_name, None)

    @property
    def _slot_cpus(self) -> float:
        """CPUs reserved with each device slot."""
        return self.num_cpus_per_gpu if self.device_kind == "GPU" else 1.0

    def record_threads(self, cluster_name: str, processes: Sequence[tuple[Placement, int, int]]) -> None:
        """Note a started cluster's processes as (placement, torch threads, cores of its node)."""
        self._threads[cluster_name] = [(p.node_index, p.device_ids[:1], threads, cores) for p, threads, cores in processes]

    def check_threads(self) -> None:
        """Warn once when the processes on a node can run more torch threads at once than the node has cores.
        Processes that share a device slot take turns on it (training and inference time-sharing), so a slot
        counts with its busiest process."""
        if self._warned_oversubscribed:
            return
        for node in sorted({n for entries in self._threads.values() for n, _, _, _ in entries}):
            here = [(slot, threads, cores) for entries in self._threads.values()
                    for n, slot, threads, cores in entries if n == node]
            per_slot: dict[tuple, int] = {}
            for slot, threads, _ in here:
                if slot:
                    per_slot[slot] = max(per_slot.get(slot, 0), threads)
            num_threads = sum(per_slot.values()) + sum(threads for slot, threads, _ in here if not slot)
            num_cores = min(cores for _, _, cores in here)
            if num_threads > num_cores:
                self._warned_oversubscribed = True
                warnings.warn(
                    f"{len(here)} worker processes on node {node} run up to {num_threads} torch threads at once "
                    f"(processes that share a device slot counted once), but the node has {num_cores} CPU core(s): they "
                    "compete for the cores, so steps run slower and their timings vary. Give the roles fewer threads "
                    "(num_threads_per_worker) or fewer workers (world_size; for reward workers reward.world_size), or run on more cores",
                    OversubscriptionWarning, stacklevel=2,
                )
                return

    def _claim(self, cluster_name: str, device_ids: Sequence[int], share_devices_with: Sequence[str]) -> None:
        for device in device_ids:
            others = [u for u in self._claims.get(device, []) if u != cluster_name and u not in share_devices_with]
            if others:
                raise LayoutError(
                    f"cluster {cluster_name!r}: device {device} is already used by cluster {others[0]!r}; pick free devices, "
                    f"or set share_devices_with=[{others[0]!r}] to time-share them (roles that offload between turns)"
                )
        for device in device_ids:
            self._claims.setdefault(device, []).append(cluster_name)

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        if not ids:
            raise LayoutError(f"{what} is empty; list at least one device id")
        bad = [d for d in ids if not isinstance(d, int) or not 0 <= d < self.num_devices]
        if bad:
            raise LayoutError(
                f"{what}: device ids {bad} are out of range; this ResourceManager has {self.num_devices} devices "
                f"({self.num_nodes} node(s) × {self.num_devices_per_node}), ids 0..{self.num_devices - 1}"
            )
        dupes = sorted({d for d in ids if list(ids).count(d) > 1})
        if dupes:
            raise LayoutError(f"{what}: device ids {dupes} appear more than once; list each device once")

    def _place_cpu_only(self, cluster_name: str, world_size: int, num_cpus_per_worker: float) -> list[Placement]:
        per_node = [[r for r in range(world_size) if r % self.num_nodes == n] for n in range(self.num_nodes)]
        if self._node_cpus is not None:
            self._check_cpus_fit(cluster_name, [len(ranks) for ranks in per_node], num_cpus_per_worker)
        self._cpu_claims[cluster_name] = [(rank % self.num_nodes, num_cpus_per_worker) for rank in range(world_size)]
        return [
            Placement(rank % self.num_nodes, (), per_node[rank % self.num_nodes].index(rank),
                      len(per_node[rank % self.num_nodes]), self._cpu_options(rank % self.num_nodes, num_cpus_per_worker),
                      num_cpus=num_cpus_per_worker)
            for rank in range(world_size)
        ]

    def _check_cpus_fit(self, cluster_name: str, workers_per_node: list[int], num_cpus_per_worker: float) -> None:
        """CPU-only workers that cannot fit beside the reserved slots would wait for CPUs forever: refuse them now."""
        for node, count in enumerate(workers_per_node):
            reserved = self._slot_cpus * self.num_devices_per_node
            claimed = sum(cpus for claims in self._cpu_claims.values() for n, cpus in claims if n == node)
            if count and reserved + claimed + count * num_cpus_per_worker > self._node_cpus[node]:
                raise LayoutError(
                    f"cluster {cluster_name!r}: {count} CPU-only worker(s) × {num_cpus_per_worker:g} CPU do not fit on node "
                    f"{node}: it has {self._node_cpus[node]:g} CPU(s), {reserved:g} reserved for its {self.num_devices_per_node} "
                    f"device slot(s)" + (f" and {claimed:g} taken by other CPU-only workers" if claimed else "") + ". "
                    "Use fewer or smaller CPU-only workers, reserve fewer device slots, or give Ray more logical CPUs than "
                    "cores (trainer.num_cpus; the workers then share the cores)"
                )

    # --- ray ---------------------------------------------------------------------------------

    def _reserve_on_ray(self, num_nodes, num_devices_per_node, num_cpus_per_gpu, ready_timeout_s) -> None:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        if not ray.is_initialized():
            raise RuntimeError("ResourceManager(backend='ray') needs a running Ray: call ray.init(...) first")
        nodes = [n for n in ray.nodes() if n["Alive"]]
        self.device_kind = "GPU" if any(n["Resources"].get("GPU", 0) >= 1 for n in nodes) else "CPU"
        slots = {n["NodeID"]: int(n["Resources"].get(self.device_kind, 0)) for n in nodes}
        usable = [n for n in nodes if slots[n["NodeID"]] >= 1]
        self.num_devices_per_node = num_devices_per_node or min(slots[n["NodeID"]] for n in usable)
        usable = [n for n in usable if slots[n["NodeID"]] >= self.num_devices_per_node]
        self.num_nodes = num_nodes or len(usable) or 1
        if self.num_nodes > len(usable):
            raise LayoutError(
                f"asked for {self.num_nodes} node(s) with {self.num_devices_per_node} {self.device_kind} each, but the Ray "
                f"cluster has {len(usable)} such node(s) ({ {n['NodeManagerAddress']: slots[n['NodeID']] for n in nodes} }); "
                "lower num_nodes or num_devices_per_node"
            )
        # Nodes with enough free slots now come first (another run may hold some), then the driver's node.
        here = ray.get_runtime_context().get_node_id()
        free = _free_resources_per_node()
        usable.sort(key=lambda n: (
            free.get(n["NodeID"], n["Resources"]).get(self.device_kind, 0) < self.num_devices_per_node,
            n["NodeID"] != here, n["NodeManagerAddress"], n["NodeID"],
        ))
        bundle = {"GPU": 1, "CPU": num_cpus_per_gpu} if self.device_kind == "GPU" else {"CPU": 1}
        groups = [
            placement_group([dict(bundle)] * self.num_devices_per_node, strategy="STRICT_PACK",
                            name=f"{self.run_name}:node{i}", **_pin_to(node, self.num_devices_per_node))
            for i, node in enumerate(usable[: self.num_nodes])
        ]
        ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=ready_timeout_s)
        if len(ready) < len(groups):
            for group in groups:
                ray.util.remove_placement_group(group)
            raise LayoutError(
                f"could not reserve {self.num_nodes} × {self.num_devices_per_node} {self.device_kind} slots within "
                f"{ready_timeout_s:.0f} s (free now: {ray.available_resources()}); lower num_devices_per_node or num_nodes"
            )
        # Order the groups by the node they landed on, so device ids follow node order.
        order = [n["NodeID"] for n in usable]
        landed = [placement_group_table(g)["bundles_to_node_id"][0] for g in groups]
        ranked = sorted(zip(groups, landed), key=lambda gl: order.index(gl[1]) if gl[1] in order else len(order))
        self._placement_groups = [g for g, _ in ranked]
        self._node_ids = [node for _, node in ranked]
        cpus = {n["NodeID"]: n["Resources"].get("CPU", 0.0) for n in nodes}
        self._node_cpus = [cpus.get(node, 0.0) for node in self._node_ids]

    def _device_options(self, device_ids: tuple[int, ...]) -> dict:
        """Ray actor options of a worker on `device_ids`: a sliver of its first device's bundle, and for several GPUs
        the environment that shows it all of them."""
        if self.backend != "ray":
            return {}
        options = {"scheduling_strategy": self._in_bundle(device_ids[0]), "num_cpus": _SLIVER}
        if self.device_kind == "GPU":
            options["num_gpus"] = _SLIVER
            if len(device_ids) > 1:
                # Ray would set CUDA_VISIBLE_DEVICES to the first bundle's GPU alone; it is told to leave it as set here.
                visible = ",".join(self.bundle_gpu_ids(device_ids))
                options["runtime_env"] = {"env_vars": {_NOSET_CUDA_VISIBLE_DEVICES: "1", "CUDA_VISIBLE_DEVICES": visible}}
        return options

    def _in_bundle(self, device_id: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = self._placement_groups[device_id // self.num_devices_per_node]
        return PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=device_id % self.num_devices_per_node)

    def bundle_gpu_ids(self, device_ids: Sequence[int]) -> list[str]:
        """The GPU id (as CUDA_VISIBLE_DEVICES names it) that Ray assigned to each device slot's bundle, in order.

        Asked of a tiny task per slot, run in that slot's bundle, once: cached for the manager's life (a placement
        group keeps its GPUs). Raises LayoutError when the tasks do not run within the manager's ready_timeout_s.
        """
        import ray

        missing = [d for d in dict.fromkeys(device_ids) if d not in self._gpu_ids]
        if missing:
            task = ray.remote(_assigned_gpu_ids)
            refs = [task.options(scheduling_strategy=self._in_bundle(d), num_cpus=0, num_gpus=_SLIVER).remote()
                    for d in missing]
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=self._ready_timeout_s)
            if pending:
                for ref in pending:
                    ray.cancel(ref)
                stuck = [d for d, ref in zip(missing, refs) if ref in set(pending)]
                raise LayoutError(
                    f"could not learn the GPU ids of device slots {stuck} within {self._ready_timeout_s:g} s: a task asking "
                    f"{_SLIVER} GPU of their bundles did not run (free now: {ray.available_resources()}); a worker of "
                    "several GPUs needs them. Free the Ray cluster's workers, or raise the ResourceManager's ready_timeout_s"
                )
            for device, ids in zip(missing, ray.get(refs)):
                assert len(ids) == 1, f"device slot {device}'s bundle holds one GPU, but a task in it was given {ids}"
                self._gpu_ids[device] = ids[0]
        return [self._gpu_ids[d] for d in device_ids]

    def _cpu_options(self, node_index: int, num_cpus: float) -> dict:
        if self.backend != "ray":
            return {}
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {"scheduling_strategy": NodeAffinitySchedulingStrategy(self._node_ids[node_index], soft=False),
                "num_cpus": num_cpus}

    def node_id(self, node_index: int) -> str:
        return self._node_ids[node_index]

    def shutdown(self) -> None:
        """Give the reserved placement groups back to Ray."""
        if self.backend == "ray":
            import ray
            from ray.util.placement_group import placement_group_table

            for group in self._placement_groups:
                ray.util.remove_placement_group(group)
            # Removal is asynchronous; wait (briefly) so the next reservation finds the resources free.
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and any(
                placement_group_table(g).get("state") != "REMOVED" for g in self._placement_groups
            ):
                time.sleep(0.05)
        self._placement_groups = []


def _assigned_gpu_ids() -> list[str]:
    """Run as a Ray task in one bundle: the GPU ids Ray gave it."""
    import ray

    return ray.get_runtime_context().get_accelerator_ids()["GPU"]


def _free_resources_per_node() -> dict[str, dict]:
    """Ray's current free resources by node id ({} where this Ray version lacks the call: totals are used)."""
    try:
        from ray._private.state import available_resources_per_node
    except ImportError:
        return {}
    return available_resources_per_node()


def _pin_to(node: dict, num_bundles: int) -> dict:
    """Placement-group options that put every bundle on `node` (a hard label match where Ray has node labels)."""
    if "ray.io/node-id" in (node.get("Labels") or {}):
        return {"bundle_label_selector": [{"ray.io/node-id": node["NodeID"]}] * num_bundles}
    return {"_soft_target_node_id": node["NodeID"]}


@dataclass(frozen=True)
class ResourcePool:
    """An ordered set of a manager's devices: what a cluster's `device_mapping` is drawn from."""

    manager: ResourceManager
    device_ids: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.device_ids)

    def split(self, sizes: Sequence[int]) -> list["ResourcePool"]:
        """Consecutive sub-pools of the given sizes, which must add up to this pool's size."""
        if sum(sizes) != len(self) or any(s < 1 for s in sizes):
            raise LayoutError(f"cannot split a pool of {len(self)} devices into sizes {list(sizes)}; sizes must be >= 1 and sum to {len(self)}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return [ResourcePool(self.manager, self.device_ids[s : s + n]) for s, n in zip(starts, sizes)]

    @staticmethod
    def merge(*pools: "ResourcePool") -> "ResourcePool":
        """One pool over the devices of several disjoint pools of the same manager, in order."""
        if not pools or any(p.manager is not pools[0].manager for p in pools):
            raise LayoutError("merge needs one or more pools of the same ResourceManager")
        ids = tuple(d for p in pools for d in p.device_ids)
        shared = sorted({d for d in ids if ids.count(d) > 1})
        if shared:
            raise LayoutError(f"cannot merge pools that share devices {shared}; merge disjoint pools only")
        return ResourcePool(pools[0].manager, ids)
