"""`RemoteData`: the rows of a DataProto that live with the workers that made them until someone fetches them.

Its kinds (`DataProtoFuture`, `JoinedData`, `RenamedData`) are in `baton.distributed.future`, which needs the
backends to fetch; the dispatch modes (which split such an argument by rows) and the worker host (which fetches its
part before the method runs) recognise them by this base, below both.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from baton.data import DataProto


class RemoteData:
    """Rows held elsewhere, in order. A worker call's argument of this type is split by rows in the driver without
    fetching (`len`, `chunk`, `padded`) and fetched by the worker that receives its part (`get`)."""

    def get(self, timeout_s: float | None = None) -> DataProto:
        """Fetch the rows as one DataProto (at most `timeout_s`; None: the producer's default)."""
        raise NotImplementedError

    def __len__(self) -> int:
        """The number of rows; costs the shards' row counts at most, never their data."""
        raise NotImplementedError

    def chunk(self, n: int) -> list[RemoteData]:
        """`n` parts of consecutive rows, sized as `DataProto.chunk` (differing by at most one); fetches no data."""
        raise NotImplementedError

    def padded(self, divisor: int) -> tuple[RemoteData, int]:
        """As `DataProto.padded`: rows from the start repeated at the end until `divisor` divides the length; also
        returns the number of rows added."""
        raise NotImplementedError
