"""`ModelWorker`: a worker that owns one strategy; the base of the actor, rollout, reference and critic roles."""

from __future__ import annotations

import warnings

import torch

from baton.data import DataProto, TensorBucket
from baton.data.shared_buckets import SharedBucketRing
from baton.data.shards import (
    WeightShards, add_fingerprints, bucket_fingerprints, piece_fingerprint, pieces_bucket, pieces_groups,
)
from baton.distributed import Dispatch, Worker, register
from baton.strategy import StrategyConfig, create_strategy
from baton.strategy.logprobs import sampling_temperature
from baton.workers import sync_group
from baton.workers.weight_sync import assembled_buckets, fetch_bucket, put_bucket


class ModelWorker(Worker):
    """Holds `self.strategy`, built from a `StrategyConfig` in the worker's own process."""

    _shared_slots: SharedBucketRing | None = None  # a shared-memory weight sync's slots

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

    @register(Dispatch.ONE_TO_ALL)
    def export_weights(self, bucket_bytes: int = 256 << 20, dtype: str | None = None,
                       skip: list[str] | None = None) -> WeightShards:
        """Every rank's part of the weights (the strategy's `weight_pieces`: a sharded model's ranks each send their
        rows, nobody gathers the whole model), with its pieces' fingerprints: on Ray as object-store refs (the driver
        never holds the weights), in-process as `TensorBucket`s. `dtype`: the destination's (`weight_dtype`); `skip`:
        weights not to send (a delta sync's unchanged ones)."""
        self.begin_export(bucket_bytes, dtype, skip)
        shards = WeightShards([])
        while (part := self.next_exported()).buckets:
            shards.buckets += part.buckets
            add_fingerprints(shards.fingerprints, part.fingerprints)  # a weight in blocks: over several buckets
        return shards

    @register(Dispatch.ONE_TO_ALL)
    def begin_export(self, bucket_bytes: int = 256 << 20, dtype: str | None = None, skip: list[str] | None = None,
                     transport: str = "object_store", group: str | None = None, stream: str | None = None) -> None:
        """Start `export_weights` a bucket at a time (`next_exported`), so that a destination loads one bucket while
        the next is made. transport: "object_store" (as `put_bucket` makes them); "shared_memory" (this host's:
        `baton.data.shared_buckets`, the rows copied once, cast on the way, into one of two slots, so bucket k must
        be loaded before bucket k + 2 is asked for); "collective" (sync group `group`: `baton.workers.sync_group`,
        each bucket packed here and broadcast by `send_exported`). stream: the sync's id, on every part sent (its
        destinations load it a bucket at a time)."""
        left_out = set(skip or ())
        pieces = (piece for piece in self.strategy.weight_pieces()
                  if piece.name not in left_out and piece.tied_to not in left_out)
        self._export_dtype, self._export_transport, self._export_group = _dtype(dtype), transport, group
        self._export_stream = stream
        self._exporting = pieces_groups(pieces, bucket_bytes, self.world_size, self._export_dtype)

    @register(Dispatch.ONE_TO_ALL)
    def next_exported(self) -> WeightShards:
        """The next bucket of the export `begin_export` started, with its fingerprints (of what the destinations will
        read); no bucket once it is done (every rank ends at the same call: they cut their buckets alike)."""
        pieces = next(self._exporting, None)
        if pieces is None:
            return WeightShards([])
        if self._export_transport == "collective":
            sent, bucket = sync_group.pack(self._export_group, self.rank, pieces_bucket(pieces), self._export_dtype)
            return WeightShards([sent], bucket_fingerprints(bucket), self._export_stream)
        if self._export_transport == "shared_memory":
            if self._shared_slots is None:
                self._shared_slots = SharedBucketRing()
            try:
                sent, bucket = self._shared_slots.write(pieces_bucket(pieces), self._export_dtype)
                return WeightShards([sent], bucket_fingerprints(bucket), self._export_stream)
            except OSError as error:  # /dev/shm is full (a container's is often 64 MiB): the object store takes it
                warnings.warn(f"weight sync through shared memory failed ({error}); this bucket goes through the "
                              "object store (give the container a larger /dev/shm, e.g. docker --shm-size)",
                              stacklevel=1)
        bucket = pieces_bucket(pieces, self._export_dtype)
        return WeightShards([put_bucket(bucket, self.context.backend)], bucket_fingerprints(bucket),
                            self._export_stream)

    @register(Dispatch.ONE_TO_ALL)
    def send_exported(self) -> None:
        """A collective export's last packed bucket to the destinations (returns once they have received it)."""
        sync_group.send(self._export_group)

    @register(Dispatch.ONE_TO_ALL)
    def open_sync_store(self, group: str, on_one_node: bool, num_members: int) -> tuple[str, int]:
        """Serve sync group `group`'s store from this worker (a source's rank 0): where its members meet."""
        return sync_group.open_store(group, on_one_node, num_members)

    @register(Dispatch.ONE_TO_ALL)
    def join_sync_group(self, group: str, address: tuple[str, int], on_one_node: bool, as_source: bool,
                        num_sources: int, num_destinations: int) -> None:
        """Join a weight sync's process groups (`baton.workers.sync_group.join`) as a source rank or a destination."""
        sync_group.join(group, address, on_one_node, self.rank if as_source else None,
                        None if as_source else self.rank, num_sources, num_destinations)

    @register(Dispatch.ONE_TO_ALL)
    def piece_fingerprints(self, dtype: str | None = None) -> dict[str, int]:
        """The fingerprints of this rank's rows of every weight, as `export_weights` would send them (a delta sync
        compares them, summed over the ranks, with what the destination holds)."""
        fingerprints = {}
        for piece in self.strategy.weight_pieces():
            if piece.rows is not None:
                if dtype is not None and piece.dtype.is_floating_point:
                    piece = piece.cast(_dtype(dtype))
                fingerprints[piece.name] = piece_fingerprint(piece)
        return fingerprints

    @register(Dispatch.ONE_TO_ALL)
    def import_weights(self, shards: list[WeightShards], fingerprints: bool = False) -> dict[str, int] | None:
        """Load every source rank's `export_weights`, one bucket (of every rank) at a time. fingerprints: then return
        those of the weights this call completed, computed from the parameters once loaded (`weight_fingerprints`)."""
        loaded = []
        self.strategy.import_weights(assembled_buckets(shards, getattr(self.strategy, "hf_model", None), loaded))
        return self.strategy.weight_fingerprints(loaded) if fingerprints else None

    @register(Dispatch.ONE_TO_ALL)
    def weight_fingerprints(self, names: list[str]) -> dict[str, int] | None:
        """The fingerprints of the named weights this worker serves (None: its strategy computes none)."""
        return self.strategy.weight_fingerprints(names)

    @register(Dispatch.ONE_TO_ALL_ONE)
    def weight_dtype(self) -> str | None:
        """The dtype of this model's floating weights, which a sync into it sends (None: as the source holds them)."""
        dtype = self.strategy.weight_dtype
        return None if dtype is None else str(dtype).removeprefix("torch.")

    @register(Dispatch.ONE_TO_ALL_ONE)
    def export_adapter(self) -> tuple:
        """A LoRA role's adapter: (its tensors as one bucket, an object-store ref on Ray; adapter_config.json's dict)."""
        tensors, config = self.strategy.export_adapter()
        return put_bucket(TensorBucket(tensors), self.context.backend), config

    @register(Dispatch.ONE_TO_ALL)
    def import_adapter(self, adapter: tuple) -> None:
        """Serve an adapter made by `export_adapter` on this role's base weights."""
        bucket, config = adapter
        self.strategy.import_adapter(fetch_bucket(bucket).tensors, config)

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


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)
