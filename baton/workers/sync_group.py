"""A weight sync's collective path: a gloo process group of its own per source rank, between that rank and every
destination worker, for clusters that do not share a node (where Ray's object store would carry every bucket through
its own transfer and store).

Source rank 0 serves the groups' store (on its node's address, or loopback when every member runs on its node);
every source rank packs bucket k into one buffer (its rows, cast to the destination's dtype) and broadcasts it in its
group, and every destination receives it into a buffer of its own per source rank, while the driver hands the
destinations only the layout (`CollectiveBucket`). The groups belong to the sync, not to the clusters' own
torch.distributed worlds, so a source may be an fsdp2 rank of any layout and a destination any worker. Every wait is
bounded by `SYNC_TIMEOUT`. Gloo carries CPU tensors (and CUDA ones through host memory); an NCCL group between GPU
trainers and engines is not built here.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from baton.data.bucket import PackedBucket, TensorBucket
from baton.distributed.rendezvous import LOOPBACK, connect_store, master_address, node_ip_address, serve_store

SYNC_TIMEOUT = datetime.timedelta(minutes=10)

_STORES: dict[str, object] = {}  # the stores this process serves (source rank 0), by sync group name
_GROUPS: dict[str, dict[int, object]] = {}  # this process's groups, by sync group name: source rank -> its group
_SENDING: dict[str, tuple[torch.Tensor, int]] = {}  # a source's packed bucket (buffer, bytes), by sync group name
_RECEIVING: dict[tuple[str, int], torch.Tensor] = {}  # a destination's buffer per (sync group name, source rank)


@dataclass(frozen=True)
class CollectiveBucket:
    """Bucket k of source rank `source`, as it will arrive in sync group `group` (laid out as `packed` says)."""

    group: str
    source: int
    packed: PackedBucket


def open_store(group: str, on_one_node: bool, num_members: int) -> tuple[str, int]:
    """Serve the store of sync group `group` from this process (source rank 0): where the members meet."""
    host, port = master_address(on_one_node)
    _STORES[group] = serve_store(host, port, num_members, SYNC_TIMEOUT)
    return host, port


def join(group: str, address: tuple[str, int], on_one_node: bool, source_rank: int | None,
         destination_rank: int | None, num_sources: int, num_destinations: int) -> None:
    """Join sync group `group` as source rank `source_rank` (its own group) or as destination worker
    `destination_rank` (every source's group, in source order). Every member calls this at once: each group forms
    when all of its members have joined."""
    store = _STORES.get(group) or connect_store(*address, num_sources + num_destinations, SYNC_TIMEOUT)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK if on_one_node else node_ip_address())]
    options._timeout = SYNC_TIMEOUT
    groups = {}
    for source in range(num_sources) if source_rank is None else [source_rank]:
        rank = 0 if source_rank is not None else 1 + destination_rank
        groups[source] = dist.ProcessGroupGloo(dist.PrefixStore(f"{group}/{source}", store), rank,
                                               1 + num_destinations, options)
    _GROUPS[group] = groups


def pack(group: str, source: int, bucket: TensorBucket,
         dtype: torch.dtype | None = None) -> tuple[CollectiveBucket, TensorBucket]:
    """`bucket`'s tensors (floating ones cast to `dtype` where given) into this source's send buffer for `send`: the
    layout the destinations need, and the packed tensors (what they will receive) for the sender's fingerprints."""
    buffer = _SENDING.get(group, (torch.empty(0, dtype=torch.uint8), 0))[0]

    def memory_for(size: int) -> torch.Tensor:
        nonlocal buffer
        if buffer.numel() < size:
            buffer = torch.empty(size, dtype=torch.uint8)
        return buffer

    packed, sent = PackedBucket.pack(bucket, memory_for, dtype)
    _SENDING[group] = buffer, packed.size
    return CollectiveBucket(group, source, packed), sent


def send(group: str) -> None:
    """Broadcast the bucket `pack` made to this source's destinations (returns once they have it)."""
    buffer, size = _SENDING[group]
    [own] = _groups(group).values()
    _broadcast(own, buffer[:size])


def receive(bucket: CollectiveBucket) -> TensorBucket:
    """`bucket` from its source, received into this destination's buffer for that source (valid until the next
    bucket from it arrives: load it first)."""
    group = _groups(bucket.group).get(bucket.source)
    if group is None:
        raise ValueError(f"this worker is not a destination of source rank {bucket.source} in weight-sync group "
                         f"{bucket.group!r}")
    size = bucket.packed.size
    buffer = _RECEIVING.get((bucket.group, bucket.source))
    if buffer is None or buffer.numel() < size:
        buffer = _RECEIVING[bucket.group, bucket.source] = torch.empty(size, dtype=torch.uint8)
    tensors = bucket.packed.unpack(buffer[:size])  # its layout checked before anything is received
    _broadcast(group, buffer[:size])
    return tensors


def _groups(group: str) -> dict[int, object]:
    if group not in _GROUPS:
        raise ValueError(f"this process has not joined weight-sync group {group!r} (ModelUpdatePair joins its "
                         "clusters on its first collective sync)")
    return _GROUPS[group]


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.timeout = SYNC_TIMEOUT
    group.broadcast([tensor], options).wait()


__all__ = ["CollectiveBucket", "SYNC_TIMEOUT", "join", "open_store", "pack", "receive", "send"]
