"""Errors raised by the single controller when a remote call goes wrong."""

from __future__ import annotations


class LayoutError(ValueError):
    """A resource layout that cannot be placed (bad device ids, sizes, overlap). Raised before any actor starts."""


class WorkerError(RuntimeError):
    """A worker method raised. Names the cluster, rank and method, and carries the remote traceback."""

    def __init__(self, cluster: str, rank: int, method: str, remote_traceback: str, *, died: bool = False):
        self.cluster = cluster
        self.rank = rank
        self.method = method
        self.remote_traceback = remote_traceback
        self.died = died
        what = "died" if died else "raised"
        super().__init__(
            f"worker {cluster}[rank {rank}] {what} in {method}():\n{remote_traceback.rstrip()}"
        )


class WorkerDiedError(WorkerError):
    """A worker's process is gone (killed, crashed, out of memory, node lost)."""

    def __init__(self, cluster: str, rank: int, method: str, reason: str):
        super().__init__(cluster, rank, method, reason, died=True)


class CallTimeoutError(TimeoutError):
    """A remote call did not finish within its timeout."""


class OversubscriptionWarning(UserWarning):
    """The worker processes on a node run more torch threads than it has cores."""
