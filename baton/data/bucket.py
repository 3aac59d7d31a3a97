"""`TensorBucket`: named tensors of any shapes (a slice of a model's weights) that cross processes as numpy buffers."""

from __future__ import annotations

from typing import Any

import torch

from baton.data.proto import tensors_from_numpy, tensors_to_numpy


class TensorBucket:
    """A dict of named tensors, pickled as numpy buffers so Ray's object store hands them over zero-copy.

    Unlike `DataProto` the tensors share no row dimension. Tensors arrive on CPU and read-only
    when they come from the object store: copy them into place (e.g. `param.copy_(t)`).
    """

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def __getstate__(self) -> dict[str, Any]:
        arrays, torch_dtypes = tensors_to_numpy(self.tensors)
        return {"arrays": arrays, "torch_dtypes": torch_dtypes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tensors = tensors_from_numpy(state["arrays"], state["torch_dtypes"])

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
