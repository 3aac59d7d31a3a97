"""The `Worker` base class: what every role running in a cluster knows about its place in it."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Sequence

from baton.distributed.rendezvous import socket_interface_env


@dataclass(frozen=True)
class RankInfo:
    """A worker's coordinates in the parallel layout of its cluster.

    Plain data parallel by default (`dp_rank == rank`, every other size 1). A worker whose backend
    shards the model (tensor/pipeline/context parallel) replaces it with `Worker.set_rank_info`.
    Workers that share a `dp_rank` form one model-parallel group: they receive the same data shard,
    and only the group's collecting rank (tp 0, cp 0, last pp stage) returns output.
    """

    dp_rank: int = 0
    dp_size: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1

    def __post_init__(self):
        for axis in ("dp", "tp", "pp", "cp"):
            rank, size = getattr(self, f"{axis}_rank"), getattr(self, f"{axis}_size")
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"RankInfo: {axis}_rank={rank} must lie in [0, {axis}_size={size})")

    @property
    def is_collect_rank(self) -> bool:
        """True for the one rank per dp group whose output is collected."""
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp_size - 1

    @property
    def is_first_mp_rank(self) -> bool:
        """True for the first rank of its model-parallel group (tp 0, pp 0, cp 0)."""
        return self.tp_rank == 0 and self.pp_rank == 0 and self.cp_rank == 0


@dataclass(frozen=True)
class WorkerContext:
    """Where a worker sits: set by the cluster before the worker's `__init__` runs."""

    cluster_name: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    device_ids: tuple[int, ...] = ()  # global device ids (ResourceManager numbering); () for CPU-only workers
    node_index: int = 0
    backend: str = "local"  # "ray": this worker is a Ray actor and may put objects in the object store
    num_threads: int | None = None  # torch threads of this worker's process (Ray); None: the process's own setting
    cpu_cores: tuple[int, ...] = ()  # the cores this worker's process runs on (Ray); (): wherever the OS puts it

    def env_vars(self) -> dict[str, str]:
        """The environment torch.distributed's init reads, and where the master is loopback, the interface its
        collectives' sockets bind (see `baton.distributed.rendezvous`)."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            **socket_interface_env(self.master_addr),
        }


class Worker:
    """Base class of every role that runs in a `Cluster`.

    Subclasses define their own `__init__` (no need to call `super().__init__`) and decorate the
    methods the driver calls with `@register(...)`. The cluster attaches a `WorkerContext` before
    `__init__` runs, so `self.rank`, `self.world_size`, ... are usable inside `__init__`. On the Ray
    backend the process environment also holds `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`
    and `MASTER_PORT`, which `baton.distributed.rendezvous.init_process_group(backend)` joins by (torch's own
    `init_process_group()` does too, but its store listens on every interface). On the local backend every
    worker shares the driver's process and the environment is left untouched.
    """

    _baton_context: WorkerContext
    _baton_rank_info: RankInfo
    _baton_colocated: dict[str, "Worker"]

    def _baton_attach(self, context: WorkerContext, colocated: dict[str, "Worker"]) -> None:
        self._baton_context = context
        self._baton_rank_info = RankInfo(dp_rank=context.rank, dp_size=context.world_size)
        self._baton_colocated = colocated

    def colocated_worker(self, role: str) -> "Worker":
        """The worker of another role fused into this process (`create_colocated_clusters`), for zero-copy sharing."""
        try:
            return self._baton_colocated[role]
        except KeyError:
            raise ValueError(
                f"no role {role!r} shares this process; colocated roles here: {sorted(self._baton_colocated)}"
            ) from None

    @property
    def context(self) -> WorkerContext:
        return self._baton_context

    @property
    def rank(self) -> int:
        return self._baton_context.rank

    @property
    def world_size(self) -> int:
        return self._baton_context.world_size

    @property
    def local_rank(self) -> int:
        return self._baton_context.local_rank

    @property
    def local_world_size(self) -> int:
        return self._baton_context.local_world_size

    @property
    def master_addr(self) -> str:
        return self._baton_context.master_addr

    @property
    def master_port(self) -> int:
        return self._baton_context.master_port

    @property
    def rank_info(self) -> RankInfo:
        return self._baton_rank_info

    def set_rank_info(self, rank_info: RankInfo | None = None, **sizes_and_ranks: int) -> None:
        """Declare this worker's parallel layout, e.g. `set_rank_info(dp_rank=0, dp_size=2, tp_rank=1, tp_size=2)`.

        The cluster reads every worker's layout before its first data-parallel call (and again on
        `Cluster.refresh_rank_info()`), so set it in `__init__` or in the method that builds the model.
        """
        if rank_info is None:
            rank_info = RankInfo(**sizes_and_ranks)
        elif sizes_and_ranks:
            rank_info = dataclasses.replace(rank_info, **sizes_and_ranks)
        self._baton_rank_info = rank_info


def usable_cpu_count() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, else all of them)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def pin_to_cores(cores: Sequence[int]) -> None:
    """Run this process, every thread of it, on `cores` only (Linux: affinity is a thread's, and threads made later
    inherit their maker's). ValueError, naming the machine's cores, for a core it does not have."""
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cpu_cores needs Linux (sched_setaffinity); unset it on this OS")
    num_cores = os.cpu_count() or 1
    if not cores or any(not 0 <= core < num_cores for core in cores):
        raise ValueError(f"cpu_cores {list(cores)}: this node's cores are 0..{num_cores - 1}")
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, set(cores))
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
