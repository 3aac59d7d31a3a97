"""`@register`: how a worker method's call fans out over a cluster and how the results come back.

A registered method carries a `MethodSpec` (kept in an explicit dict keyed by the function). The
dispatch mode is looked up by name in `DISPATCH_MODES` (or given by the import path of a `DispatchMode`); add your own
with `register_dispatch_mode`.
The same functions serve the Ray and the local backend.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from baton.config.registry import Registry
from baton.data import DataProto
from baton.distributed.remote import RemoteData
from baton.distributed.worker import RankInfo


class Dispatch(enum.StrEnum):
    ONE_TO_ALL = "one_to_all"  # same arguments to every worker; list of every result
    ONE_TO_ALL_ONE = "one_to_all_one"  # same arguments to every worker; rank 0's result
    ALL_TO_ALL = "all_to_all"  # argument lists of length world_size, element i to worker i; list
    DP_COMPUTE = "dp_compute"  # DataProto split by dp rank; dp-ordered concat from collecting ranks
    DP_COMPUTE_METRIC = "dp_compute_metric"  # as DP_COMPUTE; list of per-dp-rank results
    DP_DISPATCH_FIRST = "dp_dispatch_first"  # dp shard to each mp group's first rank only; as DP_COMPUTE
    # verl's names for the same modes. verl's own DP_COMPUTE (element i of list arguments to worker i) is
    # baton's ALL_TO_ALL: a list argument to a dp mode is an error that says so (`split_dp_args`).
    DP_COMPUTE_PROTO = "dp_compute"
    DP_COMPUTE_PROTO_WITH_FUNC = "dp_compute"  # a function argument is broadcast, as every non-DataProto one is


class Execute(enum.StrEnum):
    ALL = "all"  # run on every worker
    RANK_ZERO = "rank_zero"  # run on rank 0 only; the call returns rank 0's result


@dataclass(frozen=True)
class Layout:
    """What a dispatch function may know about the cluster it splits a call over."""

    world_size: int
    rank_infos: tuple[RankInfo, ...]

    @classmethod
    def plain(cls, world_size: int) -> "Layout":
        """Plain data parallel: rank i is dp rank i."""
        return cls(world_size, tuple(RankInfo(dp_rank=r, dp_size=world_size) for r in range(world_size)))

    @property
    def dp_size(self) -> int:
        return self.rank_infos[0].dp_size

    def collect_ranks(self) -> list[int]:
        """The collecting rank of each dp group, in dp order; checks every dp rank appears once."""
        by_dp: dict[int, int] = {}
        for rank, info in enumerate(self.rank_infos):
            if info.is_collect_rank:
                if info.dp_rank in by_dp:
                    raise ValueError(
                        f"ranks {by_dp[info.dp_rank]} and {rank} both collect dp rank {info.dp_rank}; "
                        "exactly one rank per dp group may have tp_rank=0, cp_rank=0 and the last pp stage"
                    )
                by_dp[info.dp_rank] = rank
        missing = sorted(set(range(self.dp_size)) - set(by_dp))
        if missing:
            raise ValueError(f"no collecting rank for dp ranks {missing}; check the workers' set_rank_info() calls")
        return [by_dp[d] for d in range(self.dp_size)]


PerWorkerArgs = list[tuple[tuple, dict]]


@dataclass(frozen=True)
class DispatchMode:
    """A named way to split a call.

    `dispatch_fn(layout, args, kwargs)` returns one `(args, kwargs)` per rank (length world_size).
    `collect_fn(layout, outputs)` turns the collected outputs into the call's result.
    `collect_ranks_fn(layout)` says whose outputs are collected, in order (default: every rank).
    `returns_data`: outputs are DataProto shards in row order, concatenated by `collect_fn`; a
    non-blocking call then returns a `DataProtoFuture` that another cluster can consume directly,
    whose shards `combine_fn` joins where they are fetched (None: `DataProto.concat`).
    `needs_rank_info`: the layout must hold the workers' real `RankInfo`s (asked of the workers,
    then cached); modes that only need the world size skip that round trip.
    """

    name: str
    dispatch_fn: Callable[[Layout, tuple, dict], PerWorkerArgs]
    collect_fn: Callable[[Layout, list], Any]
    collect_ranks_fn: Callable[[Layout], list[int]] | None = None
    returns_data: bool = False
    needs_rank_info: bool = True
    combine_fn: Callable[[list], Any] | None = None

    def collect_ranks(self, layout: Layout) -> list[int]:
        if self.collect_ranks_fn is None:
            return list(range(layout.world_size))
        return self.collect_ranks_fn(layout)


DISPATCH_MODES: Registry[DispatchMode] = Registry("dispatch mode")


def register_dispatch_mode(
    name: str,
    dispatch_fn: Callable[[Layout, tuple, dict], PerWorkerArgs],
    collect_fn: Callable[[Layout, list], Any],
    collect_ranks_fn: Callable[[Layout], list[int]] | None = None,
    combine_fn: Callable[[list], Any] | None = None,
) -> str:
    """Add a custom dispatch mode; use the returned name as `@register(dispatch_mode=name)`.

    combine_fn: for methods that return DataProto shards in row order, the module-level function that joins a
    list of them (the `collect_fn` without the layout); given, a non-blocking call returns a `DataProtoFuture`."""
    DISPATCH_MODES[name] = DispatchMode(name, dispatch_fn, collect_fn, collect_ranks_fn,
                                        returns_data=combine_fn is not None, combine_fn=combine_fn)
    return name


def get_dispatch_mode(name: str) -> DispatchMode:
    """A registered dispatch mode, or the `DispatchMode` that an import path "package.module:NAME" names."""
    mode = DISPATCH_MODES.get(name)
    if not isinstance(mode, DispatchMode):
        raise ValueError(f"dispatch mode {name!r} is a {type(mode).__name__}, not a DispatchMode; give the name "
                         "register_dispatch_mode returned, or the import path of a DispatchMode")
    return mode


# --- @register ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    dispatch_mode: str
    execute_mode: Execute
    blocking: bool
    materialize_futures: bool
    auto_padding: bool
    own_thread: bool = False


_METHOD_SPECS: dict[Callable, MethodSpec] = {}


def register(
    dispatch_mode: str = Dispatch.ONE_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
    auto_padding: bool = False,
    own_thread: bool = False,
):
    """Expose a worker method to the driver as a method of its cluster.

    blocking: the cluster method waits and returns the collected result; with False it returns
        a future (`DataProtoFuture` for DataProto-returning dp modes, else a `CallFuture`).
    materialize_futures: futures among the arguments are fetched on the worker before the call;
        with False the method receives them as `DataProtoFuture` and calls `.get()` itself.
    auto_padding: dp modes only. Pad DataProto arguments (repeating rows) so every dp rank gets
        the same row count, and strip the padding rows from the output. Off by default: shards
        may differ by one row and no sample is duplicated. The method must return one row per
        input row.
    own_thread: on Ray, the method runs in a thread of its own (one for all such methods of a worker), beside the
        calls that run one at a time in the worker's call thread: for a method that waits on thread-safe state (a
        long poll), so that the calls issued meanwhile do not queue behind its wait. Such methods run one at a time
        among themselves; they must not touch what the other calls change without a lock.
    """
    name = str(dispatch_mode)
    mode = get_dispatch_mode(name)
    if auto_padding and not mode.returns_data and mode.name != Dispatch.DP_COMPUTE_METRIC:
        raise ValueError(f"auto_padding applies to the dp dispatch modes only, not {mode.name!r}")
    if own_thread and mode.returns_data:
        raise ValueError(f"own_thread is for a method that waits (a long poll), not for a {mode.name!r} data method; "
                         "leave it off")
    spec = MethodSpec(name, Execute(execute_mode), blocking, materialize_futures, auto_padding, own_thread)

    def decorator(fn):
        _METHOD_SPECS[fn] = spec
        return fn

    return decorator


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """The `@register` methods of a worker class, by name (a subclass override without `@register` hides one).

    A method that another decorator wrapped after `@register` (e.g. `@torch.no_grad()` above it) is found through
    the `__wrapped__` chain that `functools.wraps` leaves."""
    methods: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            spec = _registered_spec(attr)
            if spec is not None:
                methods[name] = spec
            else:
                methods.pop(name, None)
    return methods


def _registered_spec(attr) -> MethodSpec | None:
    seen = set()
    while callable(attr) and id(attr) not in seen:
        seen.add(id(attr))
        spec = _METHOD_SPECS.get(attr)
        if spec is not None:
            return spec
        attr = getattr(attr, "__wrapped__", None)
    return None


# --- built-in modes -----------------------------------------------------------------------------


def _one_to_all(layout: Layout, args: tuple, kwargs: dict) -> PerWorkerArgs:
    return [(args, kwargs)] * layout.world_size


def _all_to_all(layout: Layout, args: tuple, kwargs: dict) -> PerWorkerArgs:
    n = layout.world_size
    for where, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != n:
            raise ValueError(
                f"ALL_TO_ALL needs every argument to be a list of length world_size={n}; {where} is {type(value).__name__}"
                + (f" of length {len(value)}" if isinstance(value, Sequence) else "")
            )
    return [
        (tuple(a[rank] for a in args), {k: v[rank] for k, v in kwargs.items()})
        for rank in range(n)
    ]


def _is_data(value) -> bool:
    return isinstance(value, (DataProto, RemoteData))


def split_dp_args(layout: Layout, args: tuple, kwargs: dict, *, first_mp_rank_only: bool) -> PerWorkerArgs:
    """Split every DataProto (or DataProtoFuture) argument into dp_size shards; other arguments are broadcast.

    A call with no DataProto argument has nothing to split: a ValueError, which names ALL_TO_ALL when an argument
    is a list (verl's DP_COMPUTE gives worker i element i of each list; here that is ALL_TO_ALL)."""
    dp_size = layout.dp_size
    if not any(_is_data(v) for v in [*args, *kwargs.values()]):
        lists = [where for where, v in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]
                 if isinstance(v, (list, tuple))]
        hint = (f"; {lists[0]} is a list: to give worker i its element i (verl's Dispatch.DP_COMPUTE), register the "
                "method with Dispatch.ALL_TO_ALL" if lists else
                "; pass a DataProto, or register the method with Dispatch.ONE_TO_ALL to send the same arguments to all")
        raise ValueError(f"a dp dispatch mode splits DataProto arguments by dp rank, and this call has none{hint}")
    lengths = {k: len(v) for k, v in [*enumerate(args), *kwargs.items()] if _is_data(v)}  # a future's costs only row counts
    if len(set(lengths.values())) > 1:
        raise ValueError(f"DataProto arguments of one dp call must have the same length; got {lengths}")
    shards_of = {
        key: value.chunk(dp_size) for key, value in [*enumerate(args), *kwargs.items()] if _is_data(value)
    }
    per_worker = []
    for info in layout.rank_infos:
        send = info.is_first_mp_rank or not first_mp_rank_only

        def pick(key, value):
            if key not in shards_of:
                return value
            return shards_of[key][info.dp_rank] if send else None

        per_worker.append(
            (tuple(pick(i, a) for i, a in enumerate(args)), {k: pick(k, v) for k, v in kwargs.items()})
        )
    return per_worker


def check_data_output(output, where: str) -> None:
    """A DataProto dispatch mode's method must return a DataProto; else a TypeError naming `where` and the fix."""
    if isinstance(output, DataProto):
        return
    what = f"a dict with keys {sorted(map(str, output))[:8]}" if isinstance(output, dict) else f"a {type(output).__name__}"
    raise TypeError(
        f"{where} is registered with a DataProto dispatch mode (DP_COMPUTE, DP_DISPATCH_FIRST) but returned {what}; "
        "return a DataProto, or register it with Dispatch.DP_COMPUTE_METRIC to get the list of per-dp-rank results"
    )


def _concat(layout: Layout, outputs: list) -> DataProto:
    return DataProto.concat(outputs)


def _as_list(layout: Layout, outputs: list) -> list:
    return list(outputs)


def _collect_ranks(layout: Layout) -> list[int]:
    return layout.collect_ranks()


for _mode in [
    DispatchMode(Dispatch.ONE_TO_ALL, _one_to_all, _as_list, needs_rank_info=False),
    DispatchMode(Dispatch.ONE_TO_ALL_ONE, _one_to_all, lambda layout, outputs: outputs[0], lambda layout: [0],
                 needs_rank_info=False),
    DispatchMode(Dispatch.ALL_TO_ALL, _all_to_all, _as_list, needs_rank_info=False),
    DispatchMode(
        Dispatch.DP_COMPUTE,
        lambda layout, a, kw: split_dp_args(layout, a, kw, first_mp_rank_only=False),
        _concat,
        _collect_ranks,
        returns_data=True,
    ),
    DispatchMode(
        Dispatch.DP_COMPUTE_METRIC,
        lambda layout, a, kw: split_dp_args(layout, a, kw, first_mp_rank_only=False),
        _as_list,
        _collect_ranks,
    ),
    DispatchMode(
        Dispatch.DP_DISPATCH_FIRST,
        lambda layout, a, kw: split_dp_args(layout, a, kw, first_mp_rank_only=True),
        _concat,
        _collect_ranks,
        returns_data=True,
    ),
]:
    DISPATCH_MODES[_mode.name] = _mode
