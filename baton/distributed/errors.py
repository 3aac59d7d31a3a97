"""Errors raised by the single controller when a remote call goes wrong."""

from __future__ import annotations

import re

# CSI sequences (colours, cursor moves) that Ray puts in its task errors for terminals.
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def strip_ansi(text: str) -> str:
    return _ANSI_ESCAPE.sub("", text)


class LayoutError(ValueError):
    """A resource layout that cannot be placed (bad device ids, sizes, overlap). Raised before any actor starts."""


class WorkerError(RuntimeError):
    """A worker method raised. Names the cluster, rank and method, and carries the remote traceback.

    The cluster keeps working after a method raised; the subclasses below mean its processes are gone.
    """

    what = "raised"
    died = False

    def __init__(self, cluster: str, rank: int, method: str, remote_traceback: str):
        self.cluster = cluster
        self.rank = rank
        self.method = method
        self.remote_traceback = strip_ansi(remote_traceback)
        super().__init__(f"worker {cluster}[rank {rank}] {self.what} in {method}():\n{self.remote_traceback.rstrip()}")


class WorkerDiedError(WorkerError):
    """A worker's process is gone (killed, crashed, out of memory, node lost); its cluster's processes were stopped."""

    what = "died"
    died = True


class WorkerFrozenError(WorkerDiedError):
    """A worker's process stopped answering its heartbeat (SIGSTOP, stuck in the kernel, swapping, holding the GIL).

    Its cluster's processes were stopped (killed), so it counts as died for code that handles lost workers.
    """

    what = "froze"


class ClusterStoppedError(RuntimeError):
    """A call on a cluster whose processes were stopped (after a timeout, a frozen or dead worker, or shutdown)."""


class CallTimeoutError(TimeoutError):
    """A remote call did not finish within its timeout."""


class OversubscriptionWarning(UserWarning):
    """The worker processes on a node run more torch threads than it has cores."""
