"""`TensorBucket`: named tensors of any shapes (a slice of a model's weights) that cross processes as numpy buffers;
and `PackedBucket`, a bucket laid out in one byte buffer, as a weight sync's shared-memory slot or collective message
carries it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from baton.data.proto import tensors_from_numpy, tensors_to_numpy


class TensorBucket:
    """A dict of named tensors, pickled as numpy buffers so Ray's object store hands them over zero-copy.

    Unlike `DataProto` the tensors share no row dimension. Tensors arrive on CPU and read-only
    when they come from the object store: copy them into place (e.g. `param.copy_(t)`).
    A bucket of a sharded weight sync (`baton.data.shards`) holds pieces: `shapes[name]` is the whole weight's shape
    where the tensor is a block of its rows starting at row `offsets[name]`; `aliases` maps a tied weight's name to
    the weight whose tensor it shares.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]] | None = None,
                 offsets: dict[str, int] | None = None, aliases: dict[str, str] | None = None):
        self.tensors = tensors
        self.shapes, self.offsets, self.aliases = shapes or {}, offsets or {}, aliases or {}

    def __getstate__(self) -> dict[str, Any]:
        arrays, torch_dtypes = tensors_to_numpy(self.tensors)
        return {"arrays": arrays, "torch_dtypes": torch_dtypes, "shapes": self.shapes, "offsets": self.offsets,
                "aliases": self.aliases}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors = tensors_from_numpy(state["arrays"], state["torch_dtypes"])
        self.shapes, self.offsets, self.aliases = state["shapes"], state["offsets"], state["aliases"]

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


Layout = dict[str, tuple[str, tuple[int, ...], int]]  # name -> (dtype name, shape, byte offset)
_ALIGN = 64


def byte_layout(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None, start: int = 0) -> tuple[Layout, int]:
    """Where each of `tensors` (floating ones cast to `dtype` where given) lies in one byte buffer, from byte `start`,
    each on a 64-byte boundary; and the buffer's size."""
    layout, end = {}, start
    for name, tensor in tensors.items():
        out = dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype
        layout[name] = (str(out).removeprefix("torch."), tuple(tensor.shape), end)
        end += -(-tensor.numel() * out.itemsize // _ALIGN) * _ALIGN
    return layout, end


@dataclass(frozen=True)
class PackedBucket:
    """A `TensorBucket` as one byte buffer carries it (a weight sync's shared-memory slot or collective message):
    where each tensor lies (`layout`, from byte `start`; the buffer's `size`), and the bucket's `shapes` / `offsets` /
    `aliases`. A few hundred bytes: what the driver hands a destination instead of the tensors."""

    layout: Layout
    size: int
    start: int = 0
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    offsets: dict[str, int] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    @classmethod
    def pack(cls, bucket: TensorBucket, buffer: Callable[[int], torch.Tensor], dtype: torch.dtype | None = None,
             start: int = 0) -> tuple["PackedBucket", TensorBucket]:
        """`bucket`'s tensors (floating ones cast to `dtype` where given) copied into `buffer(size)` (uint8, at least
        `size` bytes) from byte `start`: the layout, and the packed tensors."""
        layout, size = byte_layout(bucket.tensors, dtype, start)
        packed = cls(layout, size, start, dict(bucket.shapes), dict(bucket.offsets), dict(bucket.aliases))
        unpacked = packed.unpack(buffer(size))
        for name, tensor in bucket.tensors.items():
            unpacked.tensors[name].copy_(tensor.detach())
        return packed, unpacked

    def unpack(self, memory: torch.Tensor) -> TensorBucket:
        """The bucket's tensors in `memory`, as views (`byte_views`' checks first)."""
        return TensorBucket(byte_views(memory, self.layout, self.start), self.shapes, self.offsets, self.aliases)


def byte_views(memory: torch.Tensor, layout: Layout, start: int = 0) -> dict[str, torch.Tensor]:
    """The tensors `layout` places in `memory` (uint8), as views; ValueError for a layout that names something other
    than a torch dtype or places a tensor outside [start, the buffer's end) (a layout may come from another process)."""
    views = {}
    for name, (dtype_name, shape, offset) in layout.items():
        dtype = getattr(torch, dtype_name, None) if isinstance(dtype_name, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a weight bucket's layout names dtype {dtype_name!r}, which is not a torch dtype")
        size = math.prod(shape) * dtype.itemsize
        if offset < start or offset + size > memory.numel():
            raise ValueError(f"a weight bucket's layout places tensor {name!r} outside its buffer")
        views[name] = memory[offset : offset + size].view(dtype).view(shape)
    return views
