"""The single controller: workers, clusters, dispatch modes, resources, futures; on Ray or in-process."""

from baton.distributed.cluster import (
    Cluster,
    WorkerConfig,
    WorkerSpec,
    create_clusters_parallel,
    create_colocated_clusters,
)
from baton.distributed.dispatch import Dispatch, Execute, Layout, register, register_dispatch_mode
from baton.distributed.errors import (
    CallTimeoutError,
    ClusterStoppedError,
    LayoutError,
    OversubscriptionWarning,
    WorkerDiedError,
    WorkerError,
    WorkerFrozenError,
)
from baton.distributed.future import CallFuture, DataProtoFuture, JoinedData, materialize_concat
from baton.distributed.resource import ResourceManager, ResourcePool
from baton.distributed.worker import RankInfo, Worker, WorkerContext

__all__ = [
    "CallFuture", "CallTimeoutError", "Cluster", "ClusterStoppedError", "DataProtoFuture", "Dispatch", "Execute", "JoinedData",
    "Layout", "LayoutError", "OversubscriptionWarning", "RankInfo", "ResourceManager", "ResourcePool", "Worker",
    "WorkerConfig", "WorkerContext", "WorkerDiedError", "WorkerError", "WorkerFrozenError", "WorkerSpec",
    "create_clusters_parallel", "create_colocated_clusters", "materialize_concat", "register", "register_dispatch_mode",
]
