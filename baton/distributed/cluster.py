"""`Cluster`: a group of workers of one role, driven as if it were one object.

Every `@register` method of the worker class becomes a method of the cluster with the same name
and docstring. Calling it splits the arguments by the method's dispatch mode, runs the method on
the workers (Ray actors, or in-process objects on the local backend), waits with a timeout, and
collects the results. Several roles can share one process per slot (`create_colocated_clusters`);
each role is then reached through its own cluster view.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from baton.data import DataProto
from baton.distributed.backend import Source, get_backend
from baton.distributed.dispatch import Execute, Layout, MethodSpec, check_data_output, get_dispatch_mode, registered_methods
from baton.distributed.errors import ClusterStoppedError, LayoutError
from baton.distributed.health import HealthMonitor
from baton.distributed.future import CallFuture, DataProtoFuture
from baton.distributed.remote import RemoteData
from baton.distributed.resource import Placement, ResourceManager, ResourcePool
from baton.distributed.worker import Worker, WorkerContext


@dataclass(frozen=True)
class WorkerSpec:
    """A worker class and its constructor arguments, built later inside the worker's process."""

    cls: type
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __post_init__(self):
        if not (isinstance(self.cls, type) and issubclass(self.cls, Worker)):
            raise TypeError(f"{self.cls!r} is not a subclass of baton.Worker; derive your worker class from Worker")
        # Checked here, before any device is claimed or process started, so a bad class leaves nothing behind.
        for name in registered_methods(self.cls):
            if hasattr(Cluster, name):
                raise ValueError(f"{self.cls.__name__}.{name} clashes with Cluster.{name}; rename the worker method")


@dataclass
class WorkerConfig:
    """How many workers of a role, on which devices, with which limits.

    Give `device_mapping` (global device ids, `num_devices_per_worker` per worker, in rank order)
    or `world_size` (then devices 0.. of the pool are used). `num_devices_per_worker=0` makes
    CPU-only workers (reward, data) that are spread over the nodes outside the device slots. A
    worker of several GPUs (all on one node) sees them all in `CUDA_VISIBLE_DEVICES`, in mapping
    order: for a process that drives several GPUs itself, such as a vLLM engine's tensor
    parallelism (see `ResourceManager`). A worker of several CPU slots gets their CPUs as threads.
    Two clusters may use the same devices only if one lists the other in `share_devices_with`.
    `num_threads_per_worker` sets torch's threads in each worker process; None follows the worker's
    CPU share (see `ResourceManager`), at least 1. `cpu_cores` runs every worker process on those
    cores of its node only: on a CPU machine, a trainer with cores of its own is not slowed by the
    rollout engines beside it (give them and the driver, e.g. with `taskset`, the other cores). On
    the local backend the workers share the driver's process and its threads, and both settings
    are ignored.

    Limits (Ray backend; on the local backend calls run in the driver's thread and nothing can
    interrupt them): a call that runs longer than `call_timeout_s` raises `CallTimeoutError`; a
    worker that leaves its heartbeat (sent every `health_check_interval_s`, answered by a thread of
    its own, so a busy worker answers) unanswered for `heartbeat_timeout_s` is frozen and fails the
    pending call with `WorkerFrozenError`. Both stop the cluster's processes: see `Cluster.restart`.
    `health_check_interval_s=0` turns the heartbeat off (frozen workers then wait out the call timeout).
    """

    name: str
    world_size: int | None = None
    device_mapping: list[int] | None = None
    num_devices_per_worker: int = 1
    num_cpus_per_worker: float = 1.0
    num_threads_per_worker: int | None = None
    cpu_cores: tuple[int, ...] | None = None
    share_devices_with: tuple[str, ...] = ()
    env_vars: dict[str, str] = field(default_factory=dict)
    call_timeout_s: float = 1800.0
    start_timeout_s: float = 120.0
    health_check_interval_s: float = 2.0
    heartbeat_timeout_s: float = 60.0

    def __post_init__(self):
        for key in ("call_timeout_s", "start_timeout_s", "heartbeat_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"cluster {self.name!r}: {key}={getattr(self, key)} must be > 0 (seconds)")
        if self.cpu_cores is not None:
            self.cpu_cores = tuple(self.cpu_cores)
            if not self.cpu_cores or not all(isinstance(c, int) and c >= 0 for c in self.cpu_cores):
                raise ValueError(f"cluster {self.name!r}: cpu_cores={list(self.cpu_cores)} must list core numbers "
                                 "(e.g. [0, 1]), or be null: the OS places the workers")
        if self.health_check_interval_s < 0:
            raise ValueError(f"cluster {self.name!r}: health_check_interval_s={self.health_check_interval_s} must be "
                             ">= 0 (0 turns the heartbeat off)")
        if self.health_check_interval_s >= self.heartbeat_timeout_s:
            raise ValueError(
                f"cluster {self.name!r}: heartbeat_timeout_s={self.heartbeat_timeout_s:g} must exceed "
                f"health_check_interval_s={self.health_check_interval_s:g}, or every worker would look frozen; "
                "raise heartbeat_timeout_s (e.g. 30x the interval)"
            )

    def resolve_world_size(self, pool: ResourcePool | None) -> tuple[int, list[int] | None]:
        """(world_size, device_mapping) after defaults; raises LayoutError with the fix when they disagree."""
        if not self.name:
            raise LayoutError("WorkerConfig.name is empty; name the role, e.g. 'actor'")
        if self.num_threads_per_worker is not None and self.num_threads_per_worker < 1:
            raise LayoutError(f"cluster {self.name!r}: num_threads_per_worker={self.num_threads_per_worker} must be >= 1 "
                              "(or None: the worker's CPU share)")
        k = self.num_devices_per_worker
        if k < 0:
            raise LayoutError(f"cluster {self.name!r}: num_devices_per_worker={k} must be >= 0")
        if k == 0:
            if self.device_mapping:
                raise LayoutError(f"cluster {self.name!r}: CPU-only workers (num_devices_per_worker=0) take no device_mapping; remove it")
            if not self.world_size or self.world_size < 1:
                raise LayoutError(f"cluster {self.name!r}: CPU-only workers need world_size >= 1")
            return self.world_size, None
        mapping = self.device_mapping
        if mapping is None and pool is not None:
            mapping = list(pool.device_ids)
            if self.world_size is not None:
                mapping = mapping[: self.world_size * k]
        if mapping is None and self.world_size is not None:
            mapping = list(range(self.world_size * k))
        if mapping is None:
            raise LayoutError(f"cluster {self.name!r}: set device_mapping (e.g. [0, 1]) or world_size")
        if len(mapping) % k:
            raise LayoutError(
                f"cluster {self.name!r}: device_mapping has {len(mapping)} devices, not a multiple of num_devices_per_worker={k}"
            )
        world_size = len(mapping) // k
        if self.world_size is not None and self.world_size != world_size:
            raise LayoutError(
                f"cluster {self.name!r}: world_size={self.world_size} but device_mapping gives {world_size} workers "
                f"({len(mapping)} devices / {k} per worker); drop world_size or make them agree"
            )
        if pool is not None and not set(mapping) <= set(pool.device_ids):
            raise LayoutError(f"cluster {self.name!r}: devices {sorted(set(mapping) - set(pool.device_ids))} are not in the given pool")
        return world_size, list(mapping)


class _Group:
    """The processes behind one or more cluster views: hosts, placement, health monitor, cached layouts.

    A start of the processes is one generation with its own monitor; `restart()` begins the next
    on the same placements.
    """

    def __init__(self, roles: dict[str, WorkerSpec], config: WorkerConfig, resources: ResourceManager | ResourcePool):
        self.manager = resources if isinstance(resources, ResourceManager) else resources.manager
        pool = resources if isinstance(resources, ResourcePool) else None
        self.roles = roles
        self.config = config
        self.name = config.name
        self.backend = get_backend(self.manager.backend)
        self.world_size, mapping = config.resolve_world_size(pool)
        if config.env_vars and self.manager.backend == "local":
            warnings.warn(
                f"cluster {config.name!r}: env_vars are ignored on the local backend (workers share the driver's "
                "process); set them in the driver's environment instead", stacklevel=3,
            )
        if config.num_threads_per_worker is not None and self.manager.backend == "local":
            warnings.warn(
                f"cluster {config.name!r}: num_threads_per_worker={config.num_threads_per_worker} is ignored on the local "
                "backend (workers share the driver's process and its torch threads); call torch.set_num_threads in the "
                "driver instead", stacklevel=3,
            )
        if config.cpu_cores and self.manager.backend == "local":
            warnings.warn(f"cluster {config.name!r}: cpu_cores={list(config.cpu_cores)} is ignored on the local backend "
                          "(workers share the driver's process); pin the driver instead (taskset)", stacklevel=3)
        self.placements: list[Placement] = self.manager.place(
            config.name, self.world_size, mapping, config.num_devices_per_worker, config.num_cpus_per_worker,
            config.share_devices_with,
        )
        self.hosts: list = []
        self.monitor: HealthMonitor | None = None  # Ray only
        self.layouts: dict[str, Layout] = {}  # role -> the workers' RankInfos (see Cluster.layout)
        self.generation = 0
        self.shut_down = False

    def sources(self, method: str) -> list[Source]:
        return [Source(self.name, rank, method) for rank in range(self.world_size)]

    def stopped_reason(self) -> str | None:
        """Why the processes are stopped (e.g. 'after actor[rank 1].generate froze'); None while they run."""
        if self.shut_down:
            return "by shutdown()"
        return self.monitor.stopped_reason if self.monitor is not None else None

    def create_hosts(self) -> None:
        run = self.manager.run_name
        restart = f":restart{self.generation}" if self.generation else ""
        self.hosts = [
            self.backend.create_host(f"{run}:{self.name}:{rank}{restart}", placement.ray_options)
            for rank, placement in enumerate(self.placements)
        ]

    def construct(self) -> list:
        """Start every role's worker on every host; returns the pending refs. Watched from the moment the processes are up."""
        self.backend.wait_started(self.hosts, self.sources("start"), self.config.start_timeout_s)
        if self.manager.backend == "ray":
            self.monitor = HealthMonitor(self.hosts, self.backend.kill, interval_s=self.config.health_check_interval_s,
                                         heartbeat_timeout_s=self.config.heartbeat_timeout_s)
        on_one_node = len({placement.node_index for placement in self.placements}) == 1
        [(addr, port)] = self.backend.get(
            [self.backend.submit(self.hosts[0], "master_address", on_one_node)], self.sources("master_address")[:1],
            self.config.start_timeout_s, self.monitor,
        )
        roles = {role: (spec.cls, spec.args, spec.kwargs) for role, spec in self.roles.items()}
        refs = []
        for rank, (host, placement) in enumerate(zip(self.hosts, self.placements)):
            context = WorkerContext(
                cluster_name=self.name, rank=rank, world_size=self.world_size, local_rank=placement.local_rank,
                local_world_size=placement.local_world_size, master_addr=addr, master_port=port,
                device_ids=placement.device_ids, node_index=placement.node_index, backend=self.backend.name,
                num_threads=self.num_threads(placement), cpu_cores=self.config.cpu_cores or (),
            )
            refs.append(self.backend.submit(host, "construct", roles, context, dict(self.config.env_vars)))
        return refs

    def num_threads(self, placement: Placement) -> int | None:
        """Torch threads for a worker process: the config's, an OMP_NUM_THREADS in its env_vars, or its CPU share."""
        if self.manager.backend == "local":
            return None
        if self.config.num_threads_per_worker is not None:
            return self.config.num_threads_per_worker
        if "OMP_NUM_THREADS" in self.config.env_vars:
            return int(self.config.env_vars["OMP_NUM_THREADS"])
        return max(1, int(placement.num_cpus))

    def await_construct(self, refs: list) -> None:
        reports = self.backend.get(refs, self.sources("__init__"), self.config.start_timeout_s + self.config.call_timeout_s,
                                   self.monitor)
        if self.manager.backend == "ray":
            self.manager.record_threads(self.name, [(placement, threads, cores)
                                                    for placement, (threads, cores) in zip(self.placements, reports)])

    def restart(self) -> None:
        if self.shut_down:
            raise ClusterStoppedError(f"cluster {self.name!r} was shut down and cannot restart; build a new cluster")
        self._stop_processes("by restart()")
        self.generation += 1
        self.layouts.clear()
        _start_groups([self], check_threads=False)

    def shutdown(self) -> None:
        self._stop_processes("by shutdown()")
        self.hosts = []
        self.shut_down = True
        self.manager.release(self.name)

    def _stop_processes(self, reason: str) -> None:
        if self.monitor is not None:
            self.monitor.halt(reason)  # kills this generation's processes, if a failure has not already
            self.monitor.close()
            self.monitor = None
        else:
            for host in self.hosts:
                self.backend.kill(host)


class Cluster:
    """A group of workers of one role; its `@register` methods are callable as methods of this object.

    `Cluster(MyWorker, WorkerConfig(name="actor", device_mapping=[0, 1]), resource_manager)`, or pass
    a `WorkerSpec(MyWorker, args, kwargs)` to give the workers constructor arguments. The backend
    (Ray or local) is the resource manager's.

    Failures: a worker method that raises gives a `WorkerError` and the cluster keeps working. A
    call that times out, or a worker that died or froze, gives `CallTimeoutError`,
    `WorkerDiedError` or `WorkerFrozenError`, and the cluster's processes are stopped (killed: Ray
    cannot interrupt a running call, and every later call would queue behind it). Their state is
    lost; later calls raise `ClusterStoppedError` until `restart()` starts fresh workers.
    """

    def __init__(self, worker: type | WorkerSpec, config: WorkerConfig, resources: ResourceManager | ResourcePool, *, _start: bool = True):
        spec = worker if isinstance(worker, WorkerSpec) else WorkerSpec(worker)
        self._attach(_Group({config.name: spec}, config, resources), config.name)
        if _start:
            _start_groups([self._group])

    @classmethod
    def _view(cls, group: _Group, role: str) -> "Cluster":
        view = cls.__new__(cls)
        view._attach(group, role)
        return view

    def _attach(self, group: _Group, role: str, only_rank: int | None = None) -> None:
        self._group = group
        self._role = role
        self._only_rank = only_rank  # a view of one worker (`worker_view`): its rank in the group
        self._plain_layout = Layout.plain(self.world_size)  # for modes that need no RankInfo; built once
        self.worker_cls = group.roles[role].cls
        for name, spec in registered_methods(self.worker_cls).items():
            setattr(self, name, self._make_method(name, spec))

    def call_async(self, method: str, *args, **kwargs) -> DataProtoFuture | CallFuture:
        """The registered `method` called without waiting: a `DataProtoFuture` for a method whose dispatch mode
        returns DataProto shards (another cluster's call takes it as is), else a `CallFuture`; `.get()` waits."""
        spec = registered_methods(self.worker_cls).get(method)
        if spec is None:
            raise AttributeError(f"{self.worker_cls.__name__} has no @register method {method!r}; registered: "
                                 f"{', '.join(sorted(registered_methods(self.worker_cls)))}")
        return self._call(method, dataclasses.replace(spec, blocking=False), args, kwargs)

    def _make_method(self, name: str, spec: MethodSpec):
        def method(*args, **kwargs):
            return self._call(name, spec, args, kwargs)

        return functools.update_wrapper(method, getattr(self.worker_cls, name))

    @property
    def name(self) -> str:
        return self._role

    def worker_view(self, rank: int) -> "Cluster":
        """Worker `rank` of this cluster alone, as a cluster of one: its calls go to that worker only, as a worker of
        a world of one (e.g. one engine of a pool whose engines are the ranks of a colocated cluster). It cannot
        restart or shut down alone: its process is its cluster's."""
        if not 0 <= rank < self._group.world_size:
            raise ValueError(f"cluster {self.name!r} has ranks 0..{self._group.world_size - 1}, not {rank}")
        view = Cluster.__new__(Cluster)
        view._attach(self._group, self._role, only_rank=rank)
        return view

    def _host_rank(self, rank: int) -> int:
        return rank if self._only_rank is None else self._only_rank

    @property
    def world_size(self) -> int:
        return self._group.world_size if self._only_rank is None else 1

    @property
    def manager(self) -> ResourceManager:
        """The resource manager whose slots the workers hold (its node numbering is `placements`')."""
        return self._group.manager

    @property
    def placements(self) -> list[Placement]:
        placements = self._group.placements
        return list(placements) if self._only_rank is None else [placements[self._only_rank]]

    @property
    def layout(self) -> Layout:
        """Every worker's `RankInfo`, read from the workers once and cached until a non-dp call or a restart."""
        group = self._group
        if self._only_rank is not None:  # a world of one
            return self._plain_layout
        layout = group.layouts.get(self._role)
        if layout is None:
            refs = [group.backend.submit(h, "rank_info", self._role) for h in group.hosts]
            infos = group.backend.get(refs, group.sources("rank_info"), group.config.call_timeout_s, group.monitor)
            sizes = {(i.dp_size, i.tp_size, i.pp_size, i.cp_size) for i in infos}
            if len(sizes) != 1 or (n := next(iter(sizes)))[0] * n[1] * n[2] * n[3] != self.world_size:
                raise ValueError(
                    f"cluster {self.name!r}: workers report layouts {sorted(sizes)} (dp, tp, pp, cp); all must agree and "
                    f"multiply to world_size={self.world_size}"
                )
            layout = group.layouts[self._role] = Layout(self.world_size, tuple(infos))
        return layout

    def refresh_rank_info(self) -> None:
        self._group.layouts.pop(self._role, None)

    def restart(self) -> None:
        """Kill this cluster's worker processes (those still running) and start fresh ones, ready for the next call.

        The workers are built again from their `WorkerSpec`s, on the same placements (nodes, devices,
        CPUs) with the same contexts. Whatever they held beyond what their constructors build (weights
        loaded or trained by later calls, optimizer state) is lost: restore it, e.g. from a checkpoint.
        For a colocated view every role sharing the processes restarts. If the new workers fail to
        start, the error is raised and the cluster is shut down. A `worker_view` cannot restart alone.
        """
        self._refuse_alone("restart")
        self._group.restart()

    def _refuse_alone(self, what: str) -> None:
        if self._only_rank is not None:
            roles = ", ".join(sorted(self._group.roles))
            raise ClusterStoppedError(
                f"cluster {self.name!r} rank {self._only_rank} cannot {what} alone: its process is shared by the "
                f"whole cluster {self._group.name!r} (roles {roles}), whose state would be lost; {what} that cluster "
                "instead (for a run: resume from its last checkpoint)")

    def _call(self, method: str, spec: MethodSpec, args: tuple, kwargs: dict) -> Any:
        group = self._group
        if (stopped := group.stopped_reason()) is not None:
            raise ClusterStoppedError(
                f"cluster {self.name!r} cannot run {method}(): its worker processes were stopped {stopped}; "
                "call restart() on it to start fresh workers (their constructors run again)"
            )
        mode = get_dispatch_mode(spec.dispatch_mode)
        layout = self.layout if mode.needs_rank_info else self._plain_layout
        args, kwargs, num_pad_rows = _pad_for_dp(args, kwargs, layout.dp_size) if spec.auto_padding else (args, kwargs, 0)
        per_worker = mode.dispatch_fn(layout, args, kwargs)
        rank_zero_only = spec.execute_mode == Execute.RANK_ZERO
        ranks = [0] if rank_zero_only else list(range(self.world_size))
        collect = [0] if rank_zero_only else mode.collect_ranks(layout)
        wants_lengths = mode.returns_data and not spec.blocking and not rank_zero_only
        refs, length_refs = {}, {}
        for rank in ranks:
            worker_args, worker_kwargs = per_worker[rank]
            request = [self._role, method, (worker_args, worker_kwargs) if worker_args or worker_kwargs else None,
                       spec.materialize_futures]
            if wants_lengths and rank in collect:
                length_refs[rank], refs[rank] = group.backend.submit(group.hosts[self._host_rank(rank)],
                                                                     "call_returning_length", request, num_returns=2)
            else:
                refs[rank] = group.backend.submit(group.hosts[self._host_rank(rank)], "call_own_thread" if spec.own_thread else "call",
                                                  request)
        if not mode.needs_rank_info:
            group.layouts.pop(self._role, None)  # such calls may change a worker's RankInfo (e.g. a model-building call)
        sources = [Source(self.name, self._host_rank(rank), method) for rank in ranks]
        timeout_s, guard = group.config.call_timeout_s, group.monitor

        def finish(outputs: list) -> Any:
            by_rank = dict(zip(ranks, outputs))
            if rank_zero_only:
                return by_rank[0]
            collected = [by_rank[r] for r in collect]
            if mode.returns_data:
                for rank, output in zip(collect, collected):
                    check_data_output(output, f"cluster {self.name!r} rank {rank}: {self.worker_cls.__name__}.{method}")
            if spec.auto_padding:
                _check_rows_kept(self.name, method, [per_worker[r] for r in collect], collected)
            result = mode.collect_fn(layout, collected)
            if num_pad_rows and isinstance(result, DataProto):
                result = result.unpadded(num_pad_rows)
            return result

        if spec.blocking:
            return finish(group.backend.get(list(refs.values()), sources, timeout_s, guard))
        if wants_lengths:
            return DataProtoFuture(
                [refs[r] for r in collect], group.backend.name, length_refs=[length_refs[r] for r in collect],
                num_pad_rows=num_pad_rows, sources=[Source(self.name, self._host_rank(r), method) for r in collect],
                expected_lengths=[_rows_in(*per_worker[r]) for r in collect] if spec.auto_padding else None,
                combine=mode.combine_fn, _guard=guard, _timeout_s=timeout_s,
            )
        return CallFuture(list(refs.values()), sources, group.backend.name, finish, timeout_s, guard)

    def shutdown(self) -> None:
        """Stop this cluster's worker processes (for a colocated view: the shared processes) and free its devices."""
        self._refuse_alone("shut down")
        self._group.shutdown()

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Cluster({self.name!r}, {self.worker_cls.__name__}, world_size={self.world_size}, backend={self._group.backend.name!r})"


def _pad_for_dp(args: tuple, kwargs: dict, dp_size: int) -> tuple[tuple, dict, int]:
    pads = set()

    def pad(value):
        if isinstance(value, DataProto):
            padded, num = value.padded(dp_size)
            pads.add(num)
            return padded
        if isinstance(value, RemoteData):
            padded, num = value.padded(dp_size)
            pads.add(num)
            return padded
        return value

    args = tuple(pad(a) for a in args)
    kwargs = {k: pad(v) for k, v in kwargs.items()}
    if len(pads) > 1:
        raise ValueError(f"DataProto arguments of one dp call must have the same length; they need padding {sorted(pads)}")
    return args, kwargs, pads.pop() if pads else 0


def _rows_in(args: tuple, kwargs: dict) -> int | None:
    """Rows of a worker's first DataProto (or future) argument; None when it has none."""
    return next((len(v) for v in [*args, *kwargs.values()] if isinstance(v, (DataProto, RemoteData))), None)


def _check_rows_kept(cluster: str, method: str, inputs: list[tuple[tuple, dict]], outputs: list) -> None:
    for (args, kwargs), output in zip(inputs, outputs):
        rows_in = _rows_in(args, kwargs)
        if rows_in is not None and isinstance(output, DataProto) and len(output) != rows_in:
            raise ValueError(
                f"{cluster}.{method} is registered with auto_padding but returned {len(output)} rows for {rows_in} input rows; "
                "auto padding can only strip padding from row-preserving methods; turn it off for this method"
            )


def _start_groups(groups: Sequence[_Group], check_threads: bool = True) -> None:
    try:
        for group in groups:
            group.create_hosts()
        pending = [group.construct() for group in groups]
        for group, refs in zip(groups, pending):
            group.await_construct(refs)
    except BaseException:
        for group in groups:
            group.shutdown()
        raise
    if groups and check_threads:
        groups[0].manager.check_threads()  # once all are up, so that the warning counts them all


def create_clusters_parallel(
    requests: Sequence[tuple[type | WorkerSpec | dict[str, type | WorkerSpec], WorkerConfig]],
    resources: ResourceManager | ResourcePool,
) -> list:
    """Build several clusters at once: all their processes start together, then all workers construct together.

    A request's worker may be a dict role → worker: those roles share each process (as in
    `create_colocated_clusters`), and that request's entry in the result is a dict role → cluster view.
    """
    groups, results = [], []
    try:
        for worker, config in requests:
            if isinstance(worker, dict):
                group = _Group(_fused_specs(worker), config, resources)
                results.append({role: Cluster._view(group, role) for role in group.roles})
            else:
                cluster = Cluster(worker, config, resources, _start=False)
                group = cluster._group
                results.append(cluster)
            groups.append(group)
    except BaseException:
        for group in groups:  # give back the devices the earlier requests claimed
            group.shutdown()
        raise
    _start_groups(groups)
    return results


def create_colocated_clusters(
    roles: dict[str, type | WorkerSpec], config: WorkerConfig, resources: ResourceManager | ResourcePool
) -> dict[str, Cluster]:
    """Several roles fused into one process per slot (verl's colocated workers).

    Each role's worker is built in the same process, so roles can share tensors without copies;
    each is returned as its own cluster view, named by its role.
    """
    return create_clusters_parallel([(roles, config)], resources)[0]


def _fused_specs(roles: dict[str, type | WorkerSpec]) -> dict[str, WorkerSpec]:
    if not roles:
        raise ValueError("colocated clusters need at least one role")
    return {role: w if isinstance(w, WorkerSpec) else WorkerSpec(w) for role, w in roles.items()}
