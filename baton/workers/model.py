"""`ModelWorker`: a worker that owns one strategy; the base of the actor, rollout, reference and critic roles."""

from __future__ import annotations

from baton.data import DataProto, TensorBucket
from baton.distributed import Dispatch, Worker, register
from baton.strategy import StrategyConfig, create_strategy
from baton.strategy.logprobs import sampling_temperature


class ModelWorker(Worker):
    """Holds `self.strategy`, built from a `StrategyConfig` in the worker's own process."""

    def __init__(self, config: StrategyConfig):
        self.config = config
        self.strategy = create_strategy(config)
        if getattr(self.strategy, "rank_info", None) is not None:  # a model-parallel layout: dispatch follows it
            self.set_rank_info(self.strategy.rank_info)

    @register(Dispatch.DP_COMPUTE)
    def compute_log_probs(self, batch: DataProto) -> DataProto:
        """log_probs and entropy [rows, response_len] at the temperature the responses were sampled at
        (`sampling_temperature`: the rollout's record; 1 for responses that were not sampled)."""
        return self.strategy.forward(batch, temperature=sampling_temperature(batch))

    @register(Dispatch.ONE_TO_ALL_ONE)
    def export_weights(self, bucket_bytes: int = 256 << 20) -> list:
        """Every rank takes part (sharded strategies gather); rank 0 returns the buckets: on Ray as
        object-store refs (the driver never holds the weights), in-process as `TensorBucket`s."""
        buckets = []
        for tensors in self.strategy.export_weights(bucket_bytes):
            if tensors:
                bucket = TensorBucket(tensors)
                buckets.append(_put(bucket) if self.context.backend == "ray" else bucket)
        return buckets

    @register(Dispatch.ONE_TO_ALL)
    def import_weights(self, buckets: list) -> None:
        """Load buckets made by `export_weights`, one at a time."""
        self.strategy.import_weights(_fetch(b).tensors for b in buckets)

    @register(Dispatch.ONE_TO_ALL_ONE)
    def export_adapter(self) -> tuple:
        """A LoRA role's adapter: (its tensors as one bucket, an object-store ref on Ray; adapter_config.json's dict)."""
        tensors, config = self.strategy.export_adapter()
        bucket = TensorBucket(tensors)
        return (_put(bucket) if self.context.backend == "ray" else bucket), config

    @register(Dispatch.ONE_TO_ALL)
    def import_adapter(self, adapter: tuple) -> None:
        """Serve an adapter made by `export_adapter` on this role's base weights."""
        bucket, config = adapter
        self.strategy.import_adapter(_fetch(bucket).tensors, config)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, overwrite: bool = False) -> None:
        self.strategy.save_checkpoint(path, overwrite=overwrite)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        self.strategy.load_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def offload(self) -> None:
        self.strategy.offload()

    @register(Dispatch.ONE_TO_ALL)
    def reload(self) -> None:
        self.strategy.reload()


def _put(bucket: TensorBucket):
    import ray

    return ray.put(bucket)


def _fetch(bucket):
    if isinstance(bucket, TensorBucket):
        return bucket
    import ray

    return ray.get(bucket)
