"""baton: distributed reinforcement-learning post-training of language models."""

from baton.data import DataProto
from baton.distributed import (
    Cluster,
    DataProtoFuture,
    Dispatch,
    Execute,
    RankInfo,
    ResourceManager,
    ResourcePool,
    Worker,
    WorkerConfig,
    WorkerSpec,
    create_clusters_parallel,
    create_colocated_clusters,
    materialize_concat,
    register,
    register_dispatch_mode,
)

__version__ = "0.1.0"
__all__ = [
    "Cluster", "DataProto", "DataProtoFuture", "Dispatch", "Execute", "RankInfo", "ResourceManager", "ResourcePool",
    "Worker", "WorkerConfig", "WorkerSpec", "create_clusters_parallel", "create_colocated_clusters",
    "materialize_concat", "register", "register_dispatch_mode",
]
