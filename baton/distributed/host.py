"""The object that lives in each worker process and runs the worker methods the driver calls.

One host per rank. It holds one worker instance per role: a plain cluster has one role, a
colocated (fused) cluster has several that share the process and its devices. The Ray backend
wraps this class in an actor; the local backend keeps instances in the driver's process.
"""

from __future__ import annotations

import os

from baton.distributed.dispatch import check_data_output
from baton.distributed.heap import freeze_heap
from baton.distributed.remote import RemoteData
from baton.distributed.rendezvous import master_address
from baton.distributed.worker import RankInfo, WorkerContext, pin_to_cores, usable_cpu_count


class WorkerHost:
    def __init__(self, sets_environment: bool):
        self._sets_environment = sets_environment
        self._workers: dict[str, object] = {}
        self._master: tuple[str, int] | None = None

    def master_address(self, on_one_node: bool) -> tuple[str, int]:
        """Address and a free port for torch.distributed's rendezvous (asked of rank 0): loopback when the cluster's
        ranks all run on this node, else this node's address."""
        if self._master is None:
            self._master = master_address(on_one_node)
        return self._master

    def construct(self, roles: dict[str, tuple[type, tuple, dict]], context: WorkerContext,
                  env: dict[str, str]) -> tuple[int, int]:
        """Build each role's worker: attach its context, then run its `__init__`. Returns (torch threads, cores of the
        node this process could use, before any `cpu_cores` pinning)."""
        import torch

        num_cores = usable_cpu_count()
        if self._sets_environment:
            os.environ.update(context.env_vars())
            os.environ.update(env)
            if context.num_threads is not None:
                # Explicit: Ray sets OMP_NUM_THREADS only where unset, and torch reads it only at its import.
                os.environ["OMP_NUM_THREADS"] = str(context.num_threads)
                torch.set_num_threads(context.num_threads)
            if context.cpu_cores:  # before the workers start their threads, which inherit it
                pin_to_cores(context.cpu_cores)
        for role, (cls, args, kwargs) in roles.items():
            worker = cls.__new__(cls)
            worker._baton_attach(context, self._workers)
            worker.__init__(*args, **kwargs)
            self._workers[role] = worker
        if self._sets_environment:  # a process of its own (not the driver's, as on the local backend)
            freeze_heap()
        return torch.get_num_threads(), num_cores

    def call(self, request: list):
        """Run `role.method(*args, **kwargs)` for the request `[role, method, (args, kwargs) or None, materialize]`.

        One list of str, bool and None, which Ray packs with msgpack; only arguments, when there are
        any, are pickled (as one tuple, so each value keeps its exact type). A request pickled whole,
        or five Ray arguments, cost a no-argument call's round trip several percent more.
        """
        role, method, arguments, materialize = request
        args, kwargs = arguments if arguments is not None else ((), {})
        if materialize:
            args = tuple(_materialize(a) for a in args)
            kwargs = {k: _materialize(v) for k, v in kwargs.items()}
        return getattr(self._workers[role], method)(*args, **kwargs)

    def call_own_thread(self, request: list):
        """As `call`, for `@register(own_thread=True)` methods: on Ray it runs in a thread of its own (see
        `_ray_host_class`), so the calls queued meanwhile do not wait for it."""
        return self.call(request)

    def call_returning_length(self, request: list):
        """As `call`, but also returns the output's row count, so the driver can plan a re-split without the data."""
        output = self.call(request)
        role, method = request[:2]
        check_data_output(output, f"{type(self._workers[role]).__name__}.{method}")
        return len(output), output

    def rank_info(self, role: str) -> RankInfo:
        return self._workers[role].rank_info

    def pid(self) -> int:
        return os.getpid()

    def ping(self) -> bool:
        """Answered once the process is up (in the call thread, so after any call queued before it)."""
        return True

    def heartbeat(self) -> bool:
        """Answered at once even while a call runs (on Ray, from the heartbeat thread; see `HealthMonitor`)."""
        return True


def _materialize(value):
    return value.get() if isinstance(value, RemoteData) else value
