"""Weights in pieces: what each training rank sends in a weight sync, how a destination puts the pieces of one
bucket back together, and the fingerprint that shows which values a destination holds.

A sharded model is sent by every rank that holds a part no lower rank holds: each weight as a block of rows (dim 0)
per sending rank, in rank order. Every rank cuts its buckets at the same weights (by the weights' whole sizes), so
bucket k of every rank holds pieces of the same weights and a destination assembles one bucket at a time: no process
holds more than its own shard, or the whole model, plus one bucket.

A fingerprint is a sum over the 8-byte words of a tensor's bytes of (the word) × (a hash of its index), in integers
modulo 2^64: exact and order-free, so the pieces' fingerprints, each computed where the piece lives with its global
offset, add up to the whole tensor's, and a destination computes the same number from the tensor it serves. One
changed element, or one tensor that kept its old values, changes it. It is one integer dot product over the tensor's
memory, at about the speed of copying it, so a sync can afford it on both ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, NamedTuple

import torch

from baton.data.bucket import TensorBucket

_MOD = 1 << 64
_PERIOD = 1 << 19  # words: the index hash repeats every 4 MiB, so weights apart by a multiple of it may swap unseen
_HASHES: dict[torch.device, torch.Tensor] = {}


def _hashes(device: torch.device) -> torch.Tensor:
    """h(j) for j in [0, 2^19): splitmix64's finaliser of j, as int64 (the same on every machine)."""
    if device not in _HASHES:
        h = torch.arange(_PERIOD, dtype=torch.int64) * -7046029254386353131  # 0x9E3779B97F4A7C15, wrapping
        h = (h ^ ((h >> 30) & ((1 << 34) - 1))) * -4658895280553007687  # 0xBF58476D1CE4E5B9
        h = (h ^ ((h >> 27) & ((1 << 37) - 1))) * -7723592293110705685  # 0x94D049BB133111EB
        _HASHES[device] = (h ^ ((h >> 31) & ((1 << 33) - 1))).to(device)
    return _HASHES[device]


def fingerprint(tensor: torch.Tensor, first: int = 0) -> int:
    """Σ word_j · h(j mod 2^19) mod 2^64 over the 8-byte words of the whole tensor's bytes (the last one zero-padded),
    for the words `tensor` holds, where `first` is the flat index of its first element in the whole tensor it is a
    piece of (a piece that starts or ends inside a word counts its own bytes of it, the others as zeros): exact
    integer arithmetic, so any split of a tensor into pieces sums to the whole's. One pass over the tensor on its
    device, at about memory-copy speed on CPU (an integer dot product, no temporaries)."""
    flat = tensor.detach().contiguous().reshape(-1)
    lead = first * flat.element_size() % 8
    words = _words(flat, lead)
    hashes = _hashes(words.device)
    total, start, word = 0, 0, first * flat.element_size() // 8
    while start < words.numel():
        offset = (word + start) % _PERIOD
        end = min(words.numel(), start + _PERIOD - offset)
        total += _dot(words[start:end], hashes[offset : offset + end - start])
        start = end
    return total % _MOD


def _words(flat: torch.Tensor, lead: int) -> torch.Tensor:
    """`flat`'s bytes as int64 words, after `lead` zero bytes and zero-padded to whole words (a copy only then, or
    where the tensor's memory does not start on a word)."""
    num_bytes = flat.numel() * flat.element_size()
    tail = -(lead + num_bytes) % 8
    if lead == 0 and tail == 0:
        try:
            return flat.view(torch.int64)
        except RuntimeError:  # its storage offset is not a whole number of words
            pass
    padded = torch.zeros(lead + num_bytes + tail, dtype=torch.uint8, device=flat.device)
    padded[lead : lead + num_bytes] = flat.view(torch.uint8)
    return padded.view(torch.int64)


def _dot(words: torch.Tensor, hashes: torch.Tensor) -> int:
    """Σ words · hashes, wrapping in int64 (so exact mod 2^64)."""
    if words.device.type == "cpu":
        return int(torch.dot(words, hashes))
    return int((words * hashes).sum())


@dataclass
class WeightShards:
    """One source rank's part of a weight sync: its buckets (`TensorBucket`s of pieces, or object-store references to
    them on Ray), every rank the same number, and the fingerprints of the pieces it sent, by weight name."""

    buckets: list
    fingerprints: dict[str, int] = field(default_factory=dict)


class WeightPiece(NamedTuple):
    """One weight as one rank sends it: `rows`, its rows from `first_row` (None: another rank sends them), the whole
    weight's `shape` and `dtype`; a tied weight is sent once, its other names right after it with `tied_to` set and
    no rows."""

    name: str
    rows: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    first_row: int = 0
    tied_to: str | None = None

    @property
    def num_bytes(self) -> int:
        """The whole weight's size (every rank counts the same, whatever its rows)."""
        return 0 if self.tied_to is not None else math.prod(self.shape) * self.dtype.itemsize

    def cast(self, dtype: torch.dtype) -> "WeightPiece":
        return self._replace(rows=None if self.rows is None else self.rows.to(dtype), dtype=dtype)


def pieces_buckets(pieces: Iterable[WeightPiece], bucket_bytes: int, num_ranks: int,
                   dtype: torch.dtype | None = None) -> Iterator[TensorBucket]:
    """One rank's `pieces` (a strategy's `weight_pieces`, each tied name right after its weight) in buckets, cut
    where the weights' whole sizes reach `bucket_bytes` per rank: every one of `num_ranks` ranks cuts at the same
    weights. `dtype`: floating weights cast to it (the destination's)."""
    for group in pieces_groups(pieces, bucket_bytes, num_ranks, dtype):
        yield pieces_bucket(group, dtype)


def pieces_groups(pieces: Iterable[WeightPiece], bucket_bytes: int, num_ranks: int,
                  dtype: torch.dtype | None = None) -> Iterator[list[WeightPiece]]:
    """`pieces_buckets`' cut, the pieces as they are (a shared-memory sync casts them as it copies them): weights
    counted at their size in `dtype` where given."""
    group, size = [], 0
    for piece in pieces:
        if piece.tied_to is None and size >= bucket_bytes * num_ranks:  # a tied name stays with its weight
            yield group
            group, size = [], 0
        group.append(piece)
        size += piece.num_bytes if dtype is None or not piece.dtype.is_floating_point else (
            piece.num_bytes // piece.dtype.itemsize * dtype.itemsize)
    if group:
        yield group


def pieces_bucket(pieces: list[WeightPiece], dtype: torch.dtype | None = None) -> TensorBucket:
    """A bucket of the rows this rank sends of `pieces` (floating ones cast to `dtype` where given), with their
    weights' shapes and first rows and the tied names."""
    if dtype is not None:
        pieces = [piece.cast(dtype) if piece.dtype.is_floating_point else piece for piece in pieces]
    sent = [piece for piece in pieces if piece.rows is not None]
    return TensorBucket({piece.name: piece.rows.detach().cpu() for piece in sent},
                        shapes={piece.name: piece.shape for piece in sent},
                        offsets={piece.name: piece.first_row for piece in sent},
                        aliases={piece.name: piece.tied_to for piece in pieces if piece.tied_to is not None})


def piece_fingerprint(piece: WeightPiece) -> int:
    """The fingerprint of this rank's rows of a weight, as a part of the whole weight's."""
    return fingerprint(piece.rows, piece.first_row * math.prod(piece.shape[1:]))


def bucket_fingerprints(bucket: TensorBucket) -> dict[str, int]:
    """The fingerprint of each piece in `bucket`, as a part of its whole weight's."""
    return {name: fingerprint(rows, bucket.offsets.get(name, 0) * math.prod(rows.shape[1:]))
            for name, rows in bucket.tensors.items()}


def assemble(buckets: list[TensorBucket],
             into: Callable[[str], torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
    """Bucket k of every source rank, in rank order → the whole weights it holds (a weight with one piece is that
    piece, not a copy). A weight of several pieces is put together in `into(name)` where that gives a plain tensor of
    its shape and dtype (the destination's own: the pieces are copied once, straight into it), else in a new one.
    ValueError where the pieces do not make up a weight's shape."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, str] = {}
    for bucket in buckets:
        for name, tensor in bucket.tensors.items():
            pieces.setdefault(name, []).append((bucket.offsets.get(name, 0), tensor))
            shapes[name] = tuple(bucket.shapes.get(name, tensor.shape))
        aliases.update(bucket.aliases)
    whole = {}
    for name, parts in pieces.items():
        rows = [0]
        for first, tensor in parts:
            rows.append(rows[-1] + (tensor.shape[0] if tensor.dim() else 1))
        if len(parts) == 1 or rows[-1] != shapes[name][0] or any(
                first != row for (first, _), row in zip(parts, rows)):
            tensor = parts[0][1] if len(parts) == 1 else torch.cat([tensor for _, tensor in parts])
        else:
            tensor = _target(into, name, shapes[name], parts[0][1])
            for (first, part), end in zip(parts, rows[1:]):
                tensor[first:end].copy_(part)
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"weight {name!r} arrived as pieces of shape {tuple(tensor.shape)}, not its "
                             f"{shapes[name]}; the sources' buckets are not one sync's")
        whole[name] = tensor
    for alias, name in aliases.items():
        if name in whole:
            whole[alias] = whole[name]
    return whole


def _target(into, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """`into(name)` where it is a plain contiguous tensor of `shape` and `like`'s dtype and device; else a new one."""
    target = into(name) if into is not None else None
    if (target is not None and type(target) in (torch.Tensor, torch.nn.Parameter) and tuple(target.shape) == shape
            and target.dtype == like.dtype and target.device == like.device and target.is_contiguous()):
        return target.detach()
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def joined_fingerprints(shards: list[WeightShards]) -> dict[str, int]:
    """Each weight's fingerprint from every rank's pieces' (the whole tensor's, by construction)."""
    total: dict[str, int] = {}
    for part in shards:
        for name, value in part.fingerprints.items():
            total[name] = (total.get(name, 0) + value) % _MOD
    return total


def differing(expected: dict[str, int], served: dict[str, int]) -> list[str]:
    """The weights whose served fingerprint is not the expected one (or is missing), sorted."""
    return sorted(name for name, value in expected.items() if served.get(name) != value)


__all__ = ["WeightPiece", "WeightShards", "assemble", "bucket_fingerprints", "differing", "fingerprint",
           "joined_fingerprints", "piece_fingerprint", "pieces_bucket", "pieces_buckets", "pieces_groups"]
