"""DataProto: the row-aligned batch container that workers pass to each other.

A DataProto holds tensors, numpy columns and free-form metadata; every operation keeps all
columns aligned on dim 0. It pickles tensors as numpy buffers so Ray can move them zero-copy.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from baton.data.atomic import atomic_file

# torch dtypes that `Tensor.numpy()` handles; any other dtype (bfloat16, float8, complex32, ...)
# is pickled as a same-width integer view and viewed back on arrival.
_NUMPY_COMPATIBLE_DTYPES = {
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint16, torch.uint32, torch.uint64,
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
}
_INT_DTYPE_BY_ITEMSIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Index = int | slice | Sequence[int] | np.ndarray | torch.Tensor


@dataclass(eq=False, repr=False)
class DataProto:
    """A batch of rows: tensors, numpy columns and metadata.

    Fields:
        batch: name -> torch.Tensor, each of shape [num_rows, ...]. Tensors may live on any
            device; they are never 0-dim.
        non_tensor_batch: name -> np.ndarray, each of shape [num_rows, ...]. Strings, lists and
            other Python objects go in 1-D arrays of dtype=object (see `from_dict`).
        meta_info: free-form dict that applies to the whole batch (sampling settings, step...).
            The key "metrics" is special: `chunk`/`split` give it to the first piece only, and
            `concat` merges it from every part into name -> list of values.

    Invariant: every entry of `batch` and `non_tensor_batch` has the same size on dim 0, which is
    `len(self)`; a DataProto with no entries has 0 rows. The constructor checks it, every
    operation keeps it; after mutating the dicts by hand call `check_consistency()`.

    Derived DataProtos (indexing, select, chunk, ...) share tensors and arrays with their source
    where they can (slices are views) and get a shallow copy of `meta_info`. Use `equals`, not
    `==`, to compare two DataProtos.

    Files: `save`/`load` write and read plain data (safetensors for the tensors, JSON for the rest), so a file from
    anyone loads without running code; `save_pickle`/`load_trusted_pickle` keep any Python object, and loading one
    runs whatever code the file names: only files you made.

    Pickling (Ray, multiprocessing, `save_pickle`) sends every tensor as a detached, contiguous CPU numpy
    array, so pickle protocol 5 can ship it out-of-band and Ray's object store can hand it over
    zero-copy. The receiver gets CPU tensors that may share read-only memory: move them to its
    device with `to(device)`, and clone before writing in place. `copy.copy`/`copy.deepcopy` go
    through the same path, so they also return CPU tensors.
    """

    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.batch = dict(self.batch or {})
        self.non_tensor_batch = dict(self.non_tensor_batch or {})
        self.meta_info = dict(self.meta_info or {})
        self.check_consistency()

    # ---- construction -------------------------------------------------------------------------

    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict[str, Any] | None = None,
    ) -> DataProto:
        """Build from tensors and non-tensor columns.

        Non-tensor lists/tuples become 1-D object arrays with one element per list item (a list of
        lists stays 1-D, one inner list per row); numpy arrays are kept as they are.
        """
        non_tensor_batch = {k: _to_numpy_column(v) for k, v in (non_tensors or {}).items()}
        return cls(batch=tensors, non_tensor_batch=non_tensor_batch, meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict[str, Any] | None = None) -> DataProto:
        """Build from one dict: torch tensors go to `batch`, everything else to `non_tensor_batch`."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info)

    def check_consistency(self) -> None:
        """Raise ValueError naming the key if an entry has the wrong type or row count."""
        for part, entries, kind in (("batch", self.batch, torch.Tensor),
                                    ("non_tensor_batch", self.non_tensor_batch, np.ndarray)):
            for key, value in entries.items():
                if not isinstance(value, kind):
                    raise ValueError(
                        f"{part}[{key!r}] is a {type(value).__name__}, expected {kind.__module__}."
                        f"{kind.__name__}; tensors go in batch, numpy arrays in non_tensor_batch "
                        f"(DataProto.from_dict converts lists to object arrays)")
                if value.ndim == 0:
                    raise ValueError(
                        f"{part}[{key!r}] is 0-dim; entries need a row dim 0, so reshape it to "
                        f"[num_rows, ...] or put batch-wide scalars in meta_info")
        columns = _columns(self)
        if not columns:
            return
        ref_name, ref = columns[0]
        for name, value in columns[1:]:
            if value.shape[0] != ref.shape[0]:
                raise ValueError(
                    f"{name} has {value.shape[0]} rows but {ref_name} has {ref.shape[0]}; "
                    f"every entry must share dim 0")

    def __len__(self) -> int:
        columns = _columns(self)
        return columns[0][1].shape[0] if columns else 0

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
                            for k, v in self.batch.items())
        arrays = ", ".join(f"{k}: {v.shape} {v.dtype}" for k, v in self.non_tensor_batch.items())
        return (f"DataProto(rows={len(self)}, batch={{{tensors}}}, non_tensor_batch={{{arrays}}}, "
                f"meta_info keys={list(self.meta_info)})")

    # ---- row selection ------------------------------------------------------------------------

    def __getitem__(self, idx: Index) -> DataProto:
        """Rows by int (a 1-row DataProto), slice (views), int array/list/tensor, or bool mask."""
        rows = _normalize_index(idx, len(self))
        if isinstance(rows, slice):
            batch = {k: v[rows] for k, v in self.batch.items()}
            non_tensor_batch = {k: v[rows] for k, v in self.non_tensor_batch.items()}
        else:
            rows_t = torch.from_numpy(rows)
            batch = {k: v[rows_t.to(v.device)] for k, v in self.batch.items()}
            non_tensor_batch = {k: v[rows] for k, v in self.non_tensor_batch.items()}
        return DataProto(batch, non_tensor_batch, dict(self.meta_info))

    def chunk(self, num_chunks: int) -> list[DataProto]:
        """Split into `num_chunks` consecutive pieces whose sizes differ by at most one, larger first.

        Like np.array_split: 10 rows into 4 gives [3, 3, 2, 2]; 3 rows into 4 gives [1, 1, 1, 0].
        """
        if num_chunks < 1:
            raise ValueError(f"chunk needs num_chunks >= 1, got {num_chunks}")
        base, extra = divmod(len(self), num_chunks)
        sizes = [base + 1] * extra + [base] * (num_chunks - extra)
        return self._split_sizes(sizes)

    def split(self, split_size: int) -> list[DataProto]:
        """Split into consecutive pieces of `split_size` rows; the last may be smaller.

        A 0-row DataProto gives one empty piece, so `concat(x.split(k))` always rebuilds `x`.
        """
        if split_size < 1:
            raise ValueError(f"split needs split_size >= 1, got {split_size}")
        num_full, rest = divmod(len(self), split_size)
        sizes = [split_size] * num_full + ([rest] if rest or num_full == 0 else [])
        return self._split_sizes(sizes)

    def _split_sizes(self, sizes: list[int]) -> list[DataProto]:
        pieces, start = [], 0
        for i, size in enumerate(sizes):
            piece = self[start:start + size]
            if i > 0:
                piece.meta_info.pop("metrics", None)  # metrics belong to the batch once
            pieces.append(piece)
            start += size
        return pieces

    def repeat(self, repeat_times: int, interleave: bool = True) -> DataProto:
        """Repeat every row: interleave gives rows a, a, b, b; otherwise a, b, a, b."""
        if repeat_times < 1:
            raise ValueError(f"repeat needs repeat_times >= 1, got {repeat_times}")
        rows = np.arange(len(self))
        rows = np.repeat(rows, repeat_times) if interleave else np.tile(rows, repeat_times)
        return self[rows]

    def padded(self, divisor: int) -> tuple[DataProto, int]:
        """Append rows, cycling from the first row, until len is divisible by `divisor`.

        Returns (padded, pad_size). When no padding is needed (or there are no rows to copy)
        returns (self, 0). `padded.unpadded(pad_size)` gives the original rows back.
        """
        if divisor < 1:
            raise ValueError(f"padded needs divisor >= 1, got {divisor}")
        num_rows = len(self)
        pad_size = -num_rows % divisor
        if num_rows == 0 or pad_size == 0:
            return self, 0
        rows = np.concatenate([np.arange(num_rows), np.arange(pad_size) % num_rows])
        return self[rows], pad_size

    def unpadded(self, pad_size: int) -> DataProto:
        """Drop the last `pad_size` rows (the inverse of `padded`)."""
        if not 0 <= pad_size <= len(self):
            raise ValueError(f"pad_size must be in [0, {len(self)}], got {pad_size}")
        return self[:len(self) - pad_size]

    # ---- key selection ------------------------------------------------------------------------

    def select(
        self,
        batch_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> DataProto:
        """A new DataProto with only the given keys; None keeps the whole part. Shares values."""
        return DataProto(
            _pick(self.batch, batch_keys, "batch"),
            _pick(self.non_tensor_batch, non_tensor_keys, "non_tensor_batch"),
            _pick(self.meta_info, meta_keys, "meta_info"),
        )

    def pop(
        self,
        batch_keys: Iterable[str] = (),
        non_tensor_keys: Iterable[str] = (),
        meta_keys: Iterable[str] = (),
    ) -> DataProto:
        """Remove the given keys from self and return them as a new DataProto."""
        popped = self.select(list(batch_keys), list(non_tensor_keys), list(meta_keys))
        for part, popped_part in ((self.batch, popped.batch),
                                  (self.non_tensor_batch, popped.non_tensor_batch),
                                  (self.meta_info, popped.meta_info)):
            for key in popped_part:
                del part[key]
        return popped

    def rename(self, old_keys: str | Sequence[str], new_keys: str | Sequence[str]) -> DataProto:
        """Rename batch / non_tensor_batch keys in place and return self.

        All renames apply at once, so swapping two names works; a new name that collides with a
        key that stays raises ValueError and leaves self unchanged.
        """
        old_keys = [old_keys] if isinstance(old_keys, str) else list(old_keys)
        new_keys = [new_keys] if isinstance(new_keys, str) else list(new_keys)
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename got {len(old_keys)} old keys but {len(new_keys)} new keys")
        mapping = dict(zip(old_keys, new_keys))
        for old in old_keys:
            if old not in self.batch and old not in self.non_tensor_batch:
                raise ValueError(f"cannot rename {old!r}: no such key; available: "
                                 f"{sorted([*self.batch, *self.non_tensor_batch])}")
        renamed = []
        for part_name, part in (("batch", self.batch), ("non_tensor_batch", self.non_tensor_batch)):
            new_part = {}
            for key, value in part.items():
                new_key = mapping.get(key, key)
                if new_key in new_part:
                    raise ValueError(f"rename would give two {part_name} entries named {new_key!r}")
                new_part[new_key] = value
            renamed.append(new_part)
        self.batch, self.non_tensor_batch = renamed
        return self

    # ---- combining ----------------------------------------------------------------------------

    @staticmethod
    def concat(parts: Sequence[DataProto]) -> DataProto:
        """Concatenate rows of `parts`, which must all have the same keys.

        meta_info["metrics"] is merged into name -> list of values (a part's list is extended, a
        scalar appended); every other meta key must be present and equal in every part.
        """
        if not parts:
            raise ValueError("concat needs at least one DataProto, got an empty list")
        _check_same_columns(parts)
        first = parts[0]
        batch = {k: torch.cat([p.batch[k] for p in parts]) for k in first.batch}
        non_tensor_batch = {k: np.concatenate([p.non_tensor_batch[k] for p in parts])
                            for k in first.non_tensor_batch}
        return DataProto(batch, non_tensor_batch, _merge_meta([p.meta_info for p in parts]))

    def union(self, other: DataProto) -> DataProto:
        """A new DataProto with the keys of both; shared keys must hold equal values.

        Row counts must match unless one side has no tensor or non-tensor entries.
        """
        if _columns(self) and _columns(other) and len(self) != len(other):
            raise ValueError(f"union needs equal row counts, got {len(self)} and {len(other)}")
        merged = []
        for part_name in ("batch", "non_tensor_batch", "meta_info"):
            mine, theirs = getattr(self, part_name), getattr(other, part_name)
            for key in mine.keys() & theirs.keys():
                if not values_equal(mine[key], theirs[key]):
                    raise ValueError(f"union: {part_name}[{key!r}] differs between the two "
                                     f"DataProtos; rename or pop one of them first")
            merged.append({**mine, **theirs})
        return DataProto(*merged)

    # ---- devices, comparison, persistence -----------------------------------------------------

    def to(self, device: torch.device | str) -> DataProto:
        """A new DataProto with every tensor moved to `device`."""
        return DataProto({k: v.to(device) for k, v in self.batch.items()},
                         self.non_tensor_batch, self.meta_info)

    def equals(self, other: DataProto) -> bool:
        """True if both have the same keys, dtypes, shapes and values, and equal meta_info."""
        return (isinstance(other, DataProto)
                and values_equal(self.batch, other.batch)
                and values_equal(self.non_tensor_batch, other.non_tensor_batch)
                and values_equal(self.meta_info, other.meta_info))

    def save(self, path: str | os.PathLike, overwrite: bool = False) -> None:
        """Write to `path` atomically (temp file in the same directory, fsync, rename) as plain data: a safetensors
        file of the tensors, whose metadata holds the non-tensor columns and meta_info as JSON. Non-tensor values
        and meta_info must be JSON's kinds (None, bool, int, float, str, lists, dicts with str keys; numpy scalars
        become Python's): ValueError names the first that is not (`save_pickle` keeps anything)."""
        from safetensors.torch import save as safetensors_bytes

        path = _new_file(path, overwrite)
        columns = {key: _column_to_json(value, f"non_tensor_batch[{key!r}]")
                   for key, value in self.non_tensor_batch.items()}
        metadata = {"format": _SAFE_FORMAT, "non_tensor_batch": json.dumps(columns),
                    "meta_info": json.dumps(_plain(self.meta_info, "meta_info"))}
        # clones: safetensors refuses tensors that share memory (the views of one batch)
        tensors = {key: tensor.detach().cpu().contiguous().clone() for key, tensor in self.batch.items()}
        with atomic_file(path, binary=True) as f:
            f.write(safetensors_bytes(tensors, metadata))

    @staticmethod
    def load(path: str | os.PathLike) -> DataProto:
        """Load a DataProto written by `save`. Reads plain data only (no pickle), so a file from anyone is safe to
        load; ValueError for anything else, a pickle included."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(os.fspath(path), framework="pt") as f:
                metadata = f.metadata() or {}
                if metadata.get("format") != _SAFE_FORMAT:
                    raise ValueError(f"its metadata names no {_SAFE_FORMAT!r} format")
                tensors = {key: f.get_tensor(key) for key in f.keys()}
            columns = json.loads(metadata["non_tensor_batch"])
            meta_info = json.loads(metadata["meta_info"])
            if not isinstance(columns, dict) or not isinstance(meta_info, dict):
                raise ValueError("its non-tensor columns or meta_info are not JSON objects")
            non_tensors = {str(key): _column_from_json(value) for key, value in columns.items()}
        except (SafetensorError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise ValueError(f"{path} is not a DataProto file written by DataProto.save ({type(e).__name__}: {e}); "
                             "a pickle from save_pickle loads with DataProto.load_trusted_pickle, and only from a "
                             "source you trust") from None
        return DataProto(tensors, non_tensors, meta_info)

    def save_pickle(self, path: str | os.PathLike, overwrite: bool = False) -> None:
        """Pickle to `path` atomically, any Python object in the columns and meta_info kept: the same state as a
        pickle sent between processes (tensors as numpy). Read back only with `load_trusted_pickle`."""
        path = _new_file(path, overwrite)
        with atomic_file(path, binary=True) as f:
            pickle.dump(self, f, protocol=5)

    @staticmethod
    def load_trusted_pickle(path: str | os.PathLike) -> DataProto:
        """Load a DataProto written by `save_pickle`. Unpickling runs any code the file names: load only files you
        made or trust as you trust your own code; `load` reads a `save` file from anyone."""
        with open(path, "rb") as f:
            data = pickle.load(f)
        if not isinstance(data, DataProto):
            raise ValueError(f"{path} holds a {type(data).__name__}, not a DataProto")
        return data

    def __getstate__(self) -> dict[str, Any]:
        arrays, torch_dtypes = tensors_to_numpy(self.batch)
        return {"batch": arrays, "torch_dtypes": torch_dtypes,
                "non_tensor_batch": self.non_tensor_batch, "meta_info": self.meta_info}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.batch = tensors_from_numpy(state["batch"], state["torch_dtypes"])
        self.non_tensor_batch = state["non_tensor_batch"]
        self.meta_info = state["meta_info"]
        self.check_consistency()


# ---- helpers --------------------------------------------------------------------------------------

_SAFE_FORMAT = "baton.DataProto/1"  # the safetensors metadata's "format" of a `DataProto.save` file
_MAX_STR_WIDTH = 2**20  # characters per item of a fixed-width string column a file may ask for


def _new_file(path: str | os.PathLike, overwrite: bool) -> str:
    path = os.fspath(path)
    if os.path.exists(path) and not overwrite:
        raise FileExistsError(f"{path} already exists; pass overwrite=True to replace it")
    return path


def _plain(value: Any, where: str) -> Any:
    """`value` as JSON's kinds (numpy scalars as Python's); ValueError naming `where` for anything else."""
    if isinstance(value, np.generic):
        value = value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ValueError(f"{where} has the key {key!r} (a {type(key).__name__}); DataProto.save keeps str "
                                 "keys only: use save_pickle for such data")
        return {key: _plain(item, f"{where}[{key!r}]") for key, item in value.items()}
    raise ValueError(f"{where} is a {type(value).__name__}; DataProto.save keeps JSON's kinds only (None, bool, int, "
                     "float, str, lists, dicts): convert it, or use save_pickle for such data")


def _column_to_json(column: np.ndarray, where: str) -> dict[str, Any]:
    flat = column.ravel()
    values = [_plain(item, f"{where}[{i}]") for i, item in enumerate(flat)] if column.dtype == object else flat.tolist()
    if column.dtype != object:
        _plain(values, where)  # datetimes, bytes
    return {"dtype": column.dtype.str if column.dtype != object else "object", "shape": list(column.shape),
            "values": values}


def _column_from_json(column: Any) -> np.ndarray:
    if not isinstance(column, dict) or not {"dtype", "shape", "values"} <= column.keys():
        raise ValueError("a non-tensor column is not {dtype, shape, values}")
    shape, values = column["shape"], column["values"]
    if (not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape)
            or not isinstance(values, list) or math.prod(shape) != len(values) or not shape):
        raise ValueError(f"a non-tensor column's shape {shape!r} does not hold its {len(values)} values")
    if column["dtype"] == "object":
        array = np.empty(len(values), dtype=object)
        for i, value in enumerate(values):  # one by one: numpy would make a list of lists 2-D
            array[i] = value
        return array.reshape(shape)
    dtype = np.dtype(column["dtype"])
    if dtype.kind not in "biufU" or (dtype.kind == "U" and dtype.itemsize > 4 * _MAX_STR_WIDTH):
        raise ValueError(f"a non-tensor column has the dtype {dtype}, which DataProto.save does not write")
    return np.array(values, dtype=dtype).reshape(shape)


def tensors_to_numpy(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """CPU numpy views of tensors for pickling; dtypes numpy lacks (bf16, fp8) travel as same-width ints,
    named in the second dict so `tensors_from_numpy` can view them back."""
    arrays, torch_dtypes = {}, {}
    for key, tensor in tensors.items():
        tensor = tensor.detach().cpu().contiguous()
        if tensor.dtype not in _NUMPY_COMPATIBLE_DTYPES:
            torch_dtypes[key] = str(tensor.dtype).removeprefix("torch.")
            tensor = tensor.view(_INT_DTYPE_BY_ITEMSIZE[tensor.element_size()])
        arrays[key] = tensor.numpy()
    return arrays, torch_dtypes


def tensors_from_numpy(arrays: dict[str, np.ndarray], torch_dtypes: dict[str, str]) -> dict[str, torch.Tensor]:
    """Inverse of `tensors_to_numpy`, zero-copy (tensors share the arrays' memory)."""
    tensors = {}
    with warnings.catch_warnings():
        # Object-store buffers are read-only; receivers that write in place clone first.
        warnings.filterwarnings("ignore", message=".*non-writable.*", category=UserWarning)
        for key, array in arrays.items():
            tensor = torch.from_numpy(array)
            if key in torch_dtypes:
                tensor = tensor.view(getattr(torch, torch_dtypes[key]))
            tensors[key] = tensor
    return tensors


def values_equal(a: Any, b: Any) -> bool:
    """Strict equality for tensors (dtype + values), arrays (incl. object), dicts, lists, scalars."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.dtype == b.dtype and a.shape == b.shape):
            return False
        if a.dtype == object:
            return all(values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        return bool(np.array_equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(values_equal(x, y) for x, y in zip(a, b)))
    return bool(a == b)


def _to_numpy_column(value: Any) -> Any:
    """Lists/tuples -> 1-D object array, one element per item; anything else unchanged."""
    if not isinstance(value, (list, tuple)):
        return value
    column = np.empty(len(value), dtype=object)
    for i, item in enumerate(value):
        column[i] = item
    return column


def _columns(data: DataProto) -> list[tuple[str, torch.Tensor | np.ndarray]]:
    return ([(f"batch[{k!r}]", v) for k, v in data.batch.items()]
            + [(f"non_tensor_batch[{k!r}]", v) for k, v in data.non_tensor_batch.items()])


def _normalize_index(idx: Index, num_rows: int) -> slice | np.ndarray:
    """Turn any supported row index into a slice or a 1-D int64 array of row numbers."""
    if isinstance(idx, slice):
        return idx
    if isinstance(idx, (bool, np.bool_)):
        raise ValueError("a bare bool is not a row index; pass a bool mask with one entry per row")
    if isinstance(idx, (int, np.integer)):
        row = int(idx)
        if not -num_rows <= row < num_rows:
            raise IndexError(f"row {row} out of range for a DataProto with {num_rows} rows")
        row %= num_rows
        return slice(row, row + 1)
    if isinstance(idx, torch.Tensor):
        idx = idx.detach().cpu().numpy()
    rows = np.asarray(idx)
    if rows.ndim != 1:
        raise ValueError(f"row index must be 1-D, got shape {rows.shape}")
    if rows.dtype == np.bool_:
        if rows.shape[0] != num_rows:
            raise ValueError(f"bool mask has {rows.shape[0]} entries but the DataProto has "
                             f"{num_rows} rows; the mask needs one entry per row")
        return np.flatnonzero(rows)
    if rows.size == 0:
        return rows.astype(np.int64)
    if not np.issubdtype(rows.dtype, np.integer):
        raise ValueError(f"row index must hold ints or bools, got dtype {rows.dtype}")
    return rows.astype(np.int64)


def _pick(part: dict[str, Any], keys: Iterable[str] | None, part_name: str) -> dict[str, Any]:
    if keys is None:
        return dict(part)
    picked = {}
    for key in keys:
        if key not in part:
            raise ValueError(f"{part_name} has no key {key!r}; available: {sorted(part)}")
        picked[key] = part[key]
    return picked


def _check_same_columns(parts: Sequence[DataProto]) -> None:
    """Raise ValueError unless every part has part 0's keys with the same shapes past dim 0."""
    first = dict(_columns(parts[0]))
    for i, part in enumerate(parts[1:], start=1):
        columns = dict(_columns(part))
        if columns.keys() != first.keys():
            name = sorted(columns.keys() ^ first.keys())[0]
            has, lacks = (0, i) if name in first else (i, 0)
            raise ValueError(f"concat: part {lacks} lacks {name}, which part {has} has; every "
                             f"part needs the same keys (use select or pop)")
        for name, value in columns.items():
            if tuple(value.shape[1:]) != tuple(first[name].shape[1:]):
                raise ValueError(f"concat: {name} has shape {tuple(value.shape)} in part {i} but "
                                 f"{tuple(first[name].shape)} in part 0; only dim 0 may differ")


def _merge_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge meta_info for concat: metrics gathered into lists, other keys must agree."""
    merged = {k: v for k, v in metas[0].items() if k != "metrics"}
    for i, meta in enumerate(metas):
        for key in merged.keys() | (meta.keys() - {"metrics"}):
            if key not in meta or key not in merged:
                raise ValueError(f"concat: meta_info[{key!r}] is missing from part "
                                 f"{i if key not in meta else 0}; every part needs the same meta keys")
            if not values_equal(meta[key], merged[key]):
                raise ValueError(f"concat: meta_info[{key!r}] differs between part 0 and part {i}; "
                                 f"make it equal or pop it before concat")
    metrics: dict[str, list] = {}
    for i, meta in enumerate(metas):
        part_metrics = meta.get("metrics", {})
        if not isinstance(part_metrics, dict):
            raise ValueError(f"concat: meta_info['metrics'] of part {i} is a "
                             f"{type(part_metrics).__name__}; it must be a dict name -> value(s)")
        for name, value in part_metrics.items():
            values = metrics.setdefault(name, [])
            if isinstance(value, (list, tuple)):
                values.extend(value)
            else:
                values.append(value)
    if any("metrics" in meta for meta in metas):
        merged["metrics"] = metrics
    return merged
