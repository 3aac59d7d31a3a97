"""Handles on results that have not been fetched: `DataProtoFuture` and `CallFuture`.

A `DataProtoFuture` names DataProto shards that live with the workers that made them (Ray's
object store, or memory on the local backend). Passed to another cluster's call, it is re-split
by row ranges and each worker fetches only its own rows: the driver learns the shards' row counts
and nothing else. `get()` fetches and concatenates when the driver does want the data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from baton.data import DataProto
from baton.distributed.backend import Source, get_backend
from baton.distributed.health import HealthMonitor
from baton.distributed.remote import RemoteData

DEFAULT_TIMEOUT_S = 1800.0


@dataclass
class DataProtoFuture(RemoteData):
    """Rows of a DataProto held remotely, in order.

    refs: one object ref per shard, in row order.
    row_ranges: per shard, the `(start, stop)` rows taken from it; None takes every shard whole.
    length_refs: refs to each whole shard's row count (needed only to re-split; absent when
        `row_ranges` is known).
    num_pad_rows: rows at the end that are auto-padding; `get()` drops them.
    combine: the module-level function that joins the shards (the dispatch mode's `combine_fn`); None:
        `DataProto.concat`.
    expected_lengths: with auto padding, each shard's input row count: the method must return as
        many rows, or the padding could not be stripped; checked once the lengths are known.
    """

    refs: list
    backend_name: str
    row_ranges: list[tuple[int, int]] | None = None
    length_refs: list | None = None
    num_pad_rows: int = 0
    sources: list[Source] | None = None
    expected_lengths: list[int | None] | None = None
    combine: Callable[[list], DataProto] | None = None
    # Driver-side only: the producing cluster's health monitor and timeout; not sent to workers.
    _guard: HealthMonitor | None = field(default=None, repr=False, compare=False)
    _timeout_s: float = field(default=DEFAULT_TIMEOUT_S, repr=False, compare=False)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_guard"] = None
        return state

    def _sources(self) -> list[Source]:
        return self.sources or [Source("?", i, "?") for i in range(len(self.refs))]

    def get(self, timeout_s: float | None = None) -> DataProto:
        """Fetch every shard and concatenate them (dropping auto-padding rows)."""
        backend = get_backend(self.backend_name)
        shards = backend.get(self.refs, self._sources(), timeout_s or self._timeout_s, self._guard)
        if self.row_ranges is not None:
            shards = [shard[start:stop] for shard, (start, stop) in zip(shards, self.row_ranges)]
        self._check_lengths([len(shard) for shard in shards])
        data = (self.combine or DataProto.concat)(shards)
        return data[: len(data) - self.num_pad_rows] if self.num_pad_rows else data

    def shard_lengths(self, timeout_s: float | None = None) -> list[int]:
        """Rows per shard (after row ranges, before dropping padding); fetches only the counts."""
        if self.row_ranges is not None:
            return [stop - start for start, stop in self.row_ranges]
        if self.length_refs is None:
            raise ValueError("this DataProtoFuture does not know its shard lengths; fetch it with get()")
        backend = get_backend(self.backend_name)
        lengths = backend.get(self.length_refs, self._sources(), timeout_s or self._timeout_s, self._guard)
        self._check_lengths(lengths)
        return lengths

    def _check_lengths(self, lengths: list[int]) -> None:
        expected = self.expected_lengths or []
        if any(want is not None and got != want for got, want in zip(lengths, expected)):
            source = self._sources()[0]
            raise ValueError(
                f"{source.cluster}.{source.method} is registered with auto_padding but returned shards of {list(lengths)} rows "
                f"for {list(self.expected_lengths)} input rows; auto padding can only strip padding from row-preserving "
                "methods; turn it off for this method"
            )

    def __len__(self) -> int:
        return sum(self.shard_lengths()) - self.num_pad_rows

    def chunk(self, n: int) -> list["DataProtoFuture"]:
        """Split into n futures by row ranges, sizes as `DataProto.chunk` (differ by at most one); fetches only row counts."""
        if n < 1:
            raise ValueError(f"chunk(n) needs n >= 1, got {n}")
        lengths = self.shard_lengths()
        total = sum(lengths) - self.num_pad_rows
        rows = _row_pieces(lengths, total)  # (shard, start, stop) runs covering rows 0..total
        base, extra = divmod(total, n)
        out, first = [], 0
        for i in range(n):
            size = base + (i < extra)
            out.append(self._sub_future(_take(rows, first, size)))
            first += size
        return out

    def padded(self, divisor: int) -> tuple["DataProtoFuture", int]:
        """As `DataProto.padded`: rows from the start repeated at the end until divisor divides the length."""
        lengths = self.shard_lengths()
        total = sum(lengths) - self.num_pad_rows
        pad = (-total) % divisor if total else 0
        return self._sub_future(_row_pieces(lengths, total) + _row_pieces(lengths, total, count=pad)), pad

    def _sub_future(self, taken: list[tuple[int, int, int]]) -> "DataProtoFuture":
        base = self.row_ranges or [(0, None)] * len(self.refs)
        refs, ranges, sources = [], [], []
        taken = taken or [(0, 0, 0)]  # an empty shard still needs a ref to take its columns from
        for shard, start, stop in taken:
            offset = base[shard][0]
            refs.append(self.refs[shard])
            ranges.append((offset + start, offset + stop))
            sources.append(self._sources()[shard])
        return DataProtoFuture(refs, self.backend_name, row_ranges=ranges, sources=sources, combine=self.combine,
                               _guard=self._guard, _timeout_s=self._timeout_s)


def _row_pieces(lengths: list[int], total: int, count: int | None = None) -> list[tuple[int, int, int]]:
    """The first `count` rows (default `total`; cycling over the first `total` rows) as (shard, start, stop) runs."""
    count = total if count is None else count
    out: list[tuple[int, int, int]] = []
    first_row = 0
    while count > 0 and total > 0:
        row, shard = first_row % total, 0
        while row >= lengths[shard]:
            row -= lengths[shard]
            shard += 1
        take = min(lengths[shard] - row, count, total - first_row % total)
        out.append((shard, row, row + take))
        first_row += take
        count -= take
    return out


def _take(pieces: list[tuple[int, int, int]], first: int, size: int) -> list[tuple[int, int, int]]:
    """The runs covering rows first..first+size of the concatenation of `pieces`."""
    out, pos = [], 0
    for shard, start, stop in pieces:
        lo, hi = max(first, pos), min(first + size, pos + stop - start)
        if lo < hi:
            out.append((shard, start + lo - pos, start + hi - pos))
        pos += stop - start
    return out


@dataclass
class CallFuture:
    """The pending result of a non-blocking call that does not return DataProto shards."""

    refs: list
    sources: list[Source]
    backend_name: str
    collect: Callable[[list], Any]
    timeout_s: float = DEFAULT_TIMEOUT_S
    guard: HealthMonitor | None = None

    def get(self, timeout_s: float | None = None):
        backend = get_backend(self.backend_name)
        return self.collect(backend.get(self.refs, self.sources, timeout_s or self.timeout_s, self.guard))


def materialize_concat(items: Sequence["DataProtoFuture | DataProto"], timeout_s: float | None = None) -> DataProto:
    """Fetch futures (DataProtos pass through) and concatenate everything in order."""
    return DataProto.concat([x.get(timeout_s) if isinstance(x, DataProtoFuture) else x for x in items])


@dataclass
class JoinedData(RemoteData):
    """The columns of several DataProtos and `DataProtoFuture`s over the same rows, joined only where they are
    fetched: a DAG node's input is its upstream nodes' outputs, passed on without the driver holding them.

    parts: in order; a later part's column must not repeat an earlier one's (the workflow's column contracts
        rule it out) unless it is the same object; meta_info merges, later parts winning, "metrics" combined.
    Split (`chunk`, `padded`) part by part with the same row ranges, so each worker fetches only its rows.
    """

    parts: list

    @classmethod
    def of(cls, *items) -> "DataProto | DataProtoFuture | JoinedData | None":
        """The join of `items` (None and duplicates dropped, nested joins flattened); a single part as itself."""
        parts: list = []
        for item in items:
            for part in (item.parts if isinstance(item, JoinedData) else [item]):
                if part is not None and not any(part is seen for seen in parts):
                    parts.append(part)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else cls(parts)

    def get(self, timeout_s: float | None = None) -> DataProto:
        fetched = [p if isinstance(p, DataProto) else p.get(timeout_s) for p in self.parts]
        lengths = {len(p) for p in fetched if p.batch or p.non_tensor_batch}
        if len(lengths) > 1:
            raise ValueError(f"the joined parts of a node's input have different row counts {sorted(lengths)}; a node "
                             "that changes the rows returns the whole batch (node_function(output='replace' or 'filter'))")
        tensors, non_tensors, meta, metrics = {}, {}, {}, {}
        for part in fetched:
            for into, columns in ((tensors, part.batch), (non_tensors, part.non_tensor_batch)):
                for key, value in columns.items():
                    if key in into and into[key] is not value:
                        raise ValueError(f"column {key!r} comes from two parts of a node's input; the workflow's "
                                         "column contracts should have named the two writers")
                    into[key] = value
            part_meta = dict(part.meta_info)
            metrics.update(part_meta.pop("metrics", None) or {})
            meta.update(part_meta)
        if metrics:
            meta["metrics"] = metrics
        return DataProto(tensors, non_tensors, meta)

    def __len__(self) -> int:
        return len(self.parts[0])

    def chunk(self, n: int) -> list["JoinedData"]:
        pieces = [part.chunk(n) for part in self.parts]
        return [JoinedData([p[i] for p in pieces]) for i in range(n)]

    def padded(self, divisor: int) -> tuple["JoinedData", int]:
        padded = [part.padded(divisor) for part in self.parts]
        return JoinedData([p for p, _ in padded]), padded[0][1]


@dataclass
class RenamedData(RemoteData):
    """The rows of `source` (a future) with only the tensor columns in `names`, renamed old → new, applied where
    the data is fetched (e.g. an actor's `log_probs` as a DAG node's `old_log_probs`)."""

    source: Any
    names: dict[str, str]

    def get(self, timeout_s: float | None = None) -> DataProto:
        data = self.source if isinstance(self.source, DataProto) else self.source.get(timeout_s)
        return DataProto({new: data.batch[old] for old, new in self.names.items()}, {}, {})

    def __len__(self) -> int:
        return len(self.source)

    def chunk(self, n: int) -> list["RenamedData"]:
        return [RenamedData(piece, self.names) for piece in self.source.chunk(n)]

    def padded(self, divisor: int) -> tuple["RenamedData", int]:
        padded, num = self.source.padded(divisor)
        return RenamedData(padded, self.names), num

