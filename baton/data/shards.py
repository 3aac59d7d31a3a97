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
    them on Ray), every rank the same number, and the fingerprints of the pieces it sent, by weight name; `stream`:
    the sync's id where it is loaded a bucket at a time."""

    buckets: list
    fingerprints: dict[str, int] = field(default_factory=dict)
    stream: str | None = None  # a streamed sync's id: its buckets arrive over several loads (a weight's blocks too)


class WeightPiece(NamedTuple):
    """One weight as one rank sends it: `rows`, its rows from `first_row` (None: another rank sends them), the whole
    weight's `shape` and `dtype`; a tied weight is sent once, its other names right after it with `tied_to` set and
    no rows. `block`: the whole weight's rows [start, end) this piece belongs to, where a weight larger than a bucket
    goes in blocks of rows over several buckets (None: the whole weight)."""

    name: str
    rows: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    first_row: int = 0
    tied_to: str | None = None
    block: tuple[int, int] | None = None

    @property
    def num_bytes(self) -> int:
        """The whole weight's size, or its block's (every rank counts the same, whatever its rows)."""
        return 0 if self.tied_to is not None else self.num_rows * _row_bytes(self.shape, self.dtype)

    @property
    def num_rows(self) -> int:
        """The whole weight's rows, or its block's (a scalar counts as one row)."""
        if self.block is not None:
            return self.block[1] - self.block[0]
        return self.shape[0] if self.shape else 1

    def cast(self, dtype: torch.dtype) -> "WeightPiece":
        return self._replace(rows=None if self.rows is None else self.rows.to(dtype), dtype=dtype)


def _row_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape[1:]) * dtype.itemsize


def pieces_buckets(pieces: Iterable[WeightPiece], bucket_bytes: int, num_ranks: int,
                   dtype: torch.dtype | None = None) -> Iterator[TensorBucket]:
    """One rank's `pieces` (a strategy's `weight_pieces`, each tied name right after its weight) in buckets of at most
    `bucket_bytes` per rank of the weights' whole sizes (a larger weight in blocks of rows), cut where the next weight
    would take a bucket past that: every one of `num_ranks` ranks cuts at the same weights and rows. `dtype`: floating
    weights cast to it (the destination's)."""
    for group in pieces_groups(pieces, bucket_bytes, num_ranks, dtype):
        yield pieces_bucket(group, dtype)


def pieces_groups(pieces: Iterable[WeightPiece], bucket_bytes: int, num_ranks: int,
                  dtype: torch.dtype | None = None) -> Iterator[list[WeightPiece]]:
    """`pieces_buckets`' cut, the pieces as they are (a shared-memory sync casts them as it copies them): weights
    counted at their size in `dtype` where given."""
    limit = bucket_bytes * num_ranks
    group, size = [], 0
    for whole in pieces:
        sent_dtype = dtype if dtype is not None and whole.dtype.is_floating_point else whole.dtype
        for piece in row_blocks(whole, limit, sent_dtype):
            num_bytes = 0 if piece.tied_to is not None else piece.num_rows * _row_bytes(piece.shape, sent_dtype)
            if group and piece.tied_to is None and size + num_bytes > limit:  # a tied name stays with its weight
                yield group
                group, size = [], 0
            group.append(piece)
            size += num_bytes
    if group:
        yield group


def row_blocks(piece: WeightPiece, limit: int, dtype: torch.dtype) -> Iterator[WeightPiece]:
    """`piece` as it is where its whole weight fits in `limit` bytes (as `dtype`), else in blocks of the whole weight's
    rows that do (every rank cuts the same blocks), each with this rank's rows of it."""
    row_bytes = _row_bytes(piece.shape, dtype)
    if piece.tied_to is not None or not piece.shape or piece.shape[0] * row_bytes <= limit:
        yield piece
        return
    per_block = max(1, limit // row_bytes)
    held = 0 if piece.rows is None else piece.rows.shape[0]
    for start in range(0, piece.shape[0], per_block):
        end = min(piece.shape[0], start + per_block)
        first, last = max(start, piece.first_row), min(end, piece.first_row + held)
        rows = piece.rows[first - piece.first_row : last - piece.first_row] if first < last else None
        yield piece._replace(rows=rows, first_row=first if rows is not None else start, block=(start, end))


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


class PartialWeights:
    """The weights a streaming destination has received part of: those larger than a bucket arrive as blocks of rows
    over several buckets (`row_blocks`), each put together in place as its blocks come (`assemble`), with the tied
    names that wait for them."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}
        self.aliases: dict[str, str] = {}


def assemble(buckets: list[TensorBucket], into: Callable[[str], torch.Tensor | None] | None = None,
             partial: PartialWeights | None = None) -> dict[str, torch.Tensor]:
    """Bucket k of every source rank, in rank order → the whole weights it holds (a weight with one piece is that
    piece, not a copy). A weight of several pieces is put together in `into(name)` where that gives a plain tensor of
    its shape and dtype (the destination's own: the pieces are copied once, straight into it), else in a new one.
    `partial`: a weight that arrives in blocks of rows over several buckets is kept there until its last block, and
    returned with that bucket's weights. ValueError where the pieces do not make up a weight's shape (with `partial`:
    where they overrun it)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    aliases: dict[str, str] = {} if partial is None else partial.aliases
    for bucket in buckets:
        for name, tensor in bucket.tensors.items():
            pieces.setdefault(name, []).append((bucket.offsets.get(name, 0), tensor))
            shapes[name] = tuple(bucket.shapes.get(name, tensor.shape))
        aliases.update(bucket.aliases)
    whole = {}
    for name, parts in pieces.items():
        shape, rows = shapes[name], [0]
        for first, tensor in parts:
            rows.append(rows[-1] + (tensor.shape[0] if tensor.dim() else 1))
        in_order = all(first == row for (first, _), row in zip(parts, rows))
        if len(parts) == 1 and tuple(parts[0][1].shape) == shape:
            whole[name] = parts[0][1]
        elif in_order and shape and rows[-1] == shape[0]:
            whole[name] = _target(into, name, shape, parts[0][1])
            for (first, part), end in zip(parts, rows[1:]):
                whole[name][first:end].copy_(part)
        elif partial is not None and shape:
            if name not in partial.tensors:
                partial.tensors[name], partial.rows[name] = _target(into, name, shape, parts[0][1]), 0
            for first, part in parts:
                partial.tensors[name][first : first + part.shape[0]].copy_(part)
                partial.rows[name] += part.shape[0]
            if partial.rows[name] > shape[0]:
                raise ValueError(f"weight {name!r} arrived as {partial.rows[name]} rows, more than its {shape}; the "
                                 "sources' buckets are not one sync's")
            if partial.rows[name] == shape[0]:
                whole[name] = partial.tensors.pop(name)
                del partial.rows[name]
        else:
            got = tuple(torch.cat([tensor for _, tensor in parts]).shape) if len(parts) > 1 else tuple(parts[0][1].shape)
            raise ValueError(f"weight {name!r} arrived as pieces of shape {got}, not its {shape}; the sources' buckets "
                             "are not one sync's")
    for alias, name in list(aliases.items()):
        if name in whole:
            whole[alias] = whole[name]
            if partial is not None:
                del aliases[alias]
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
        add_fingerprints(total, part.fingerprints)
    return total


def add_fingerprints(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """`more` added into `total` (pieces of the same weights: a weight's blocks in several buckets, or other ranks')."""
    for name, value in more.items():
        total[name] = (total.get(name, 0) + value) % _MOD
    return total


def differing(expected: dict[str, int], served: dict[str, int]) -> list[str]:
    """The weights whose served fingerprint is not the expected one (or is missing), sorted."""
    return sorted(name for name, value in expected.items() if served.get(name) != value)


__all__ = ["PartialWeights", "WeightPiece", "WeightShards", "add_fingerprints", "assemble", "bucket_fingerprints", "differing", "fingerprint",
           "joined_fingerprints", "piece_fingerprint", "pieces_bucket", "pieces_buckets", "pieces_groups", "row_blocks"]
