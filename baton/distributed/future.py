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

DEFAULT_TIMEOUT_S = 1800.0


@dataclass
class DataProtoFuture:
    """Rows of a DataProto held remotely, in order.

    refs: one object ref per shard, in row order.
    row_ranges: per shard, the `(start, stop)` rows taken from it; None takes every shard whole.
    length_refs: refs to each whole shard's row count (needed only to re-split; absent when
        `row_ranges` is known).
    num_pad_rows: rows at the end that are auto-padding; `get()` drops them.
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
        data = DataProto.concat(shards)
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
        return DataProtoFuture(refs, self.backend_name, row_ranges=ranges, sources=sources,
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
