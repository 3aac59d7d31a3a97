"""The worker that runs a workflow's COMPUTE nodes where the data is fetched, not on the driver."""

from __future__ import annotations

from typing import Any

from baton.data import DataProto
from baton.distributed import Dispatch, Worker, register


class ComputeWorker(Worker):
    """Runs `fn(batch, config)` for COMPUTE nodes: fetches the node's input (its rows of every upstream part),
    calls the function and keeps the output here (in Ray's object store), so the driver learns only its row
    count and metrics. CPU only."""

    def __init__(self, settings: dict[str, Any] | None = None):
        self.settings = dict(settings or {})  # what every compute node's config starts from (e.g. the algorithm's)

    @register(Dispatch.ONE_TO_ALL_ONE)
    def run_node(self, node_id: str, executable: str, batch: DataProto, config: dict) -> tuple[Any, int, dict]:
        """(the output DataProto, or its object ref on Ray; its rows; the node's metrics)."""
        from baton.dag.graph import Node, NodeType

        fn = Node(node_id, NodeType.COMPUTE, executable=executable, dependencies=["-"]).resolve()
        result = fn(batch, {**self.settings, **config})
        output, metrics = result if isinstance(result, tuple) else (result, {})
        if not isinstance(output, DataProto):
            raise TypeError(f"node {node_id!r}: {executable} returned {type(output).__name__}; a compute node returns a "
                            "DataProto (its new columns, or the whole batch), or (DataProto, metrics dict)")
        metrics = {k: float(v) for k, v in (metrics or {}).items()}
        if self.context.backend == "ray":
            import ray

            return ray.put(output), len(output), metrics
        return output, len(output), metrics
