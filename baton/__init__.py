"""baton: distributed reinforcement-learning post-training of language models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton._lazy import lazy_exports

__version__ = "0.1.0"

# Exported name -> the module that defines it. Imported on first use, so that `import baton`
# (and the `baton` command's --help) does not pay for torch and Ray.
_EXPORTS = {
    "DataProto": "baton.data",
    **{name: "baton.distributed" for name in (
        "Cluster", "DataProtoFuture", "Dispatch", "Execute", "RankInfo", "ResourceManager", "ResourcePool", "Worker",
        "WorkerConfig", "WorkerSpec", "create_clusters_parallel", "create_colocated_clusters", "materialize_concat",
        "register", "register_dispatch_mode",
    )},
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
