"""`TensorBucket`: named tensors of any shapes (a slice of a model's weights) that cross processes as numpy buffers."""

from __future__ import annotations

from typing import Any

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
