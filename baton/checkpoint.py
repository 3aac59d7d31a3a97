"""Checkpoint files that run no code when read, the manifest that tells a whole checkpoint from a damaged one, and
disk errors said in words.

A state file (`<name>.state`) is a safetensors file: an object's tensors are its tensors and the rest of the object
is JSON in its metadata, each tensor replaced by a reference; tuples, numpy arrays and dicts with non-string keys are
tagged so that they come back as they were. Reading one builds tensors and plain data, nothing else. (Not named
`.safetensors`: tools that load a model directory read every `*.safetensors` file in it as weights.) A checkpoint
directory's `manifest.json`, written last, holds the size and sha256 of every other file under it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
import sys
from contextlib import contextmanager

import numpy as np
import torch

STATE_SUFFIX = ".state"
MANIFEST = "manifest.json"
PIPELINE_STATE = "pipeline_state" + STATE_SUFFIX  # in a step directory, beside one directory per role
_STATE_FORMAT = "baton-state-1"
_MANIFEST_FORMAT = "baton-manifest-1"
_TENSOR, _TUPLE, _ARRAY, _ITEMS = "__tensor__", "__tuple__", "__ndarray__", "__items__"
_TAGS = {_TENSOR, _TUPLE, _ARRAY, _ITEMS}
_DISK_ERRORS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                errno.EPERM: "permission denied"}


class CheckpointError(OSError):
    """A checkpoint that cannot be written or read; the message names the path and says why in words.
    `errno` is the failed system call's, None for a damaged or refused file."""

    def __str__(self) -> str:
        return self.strerror if self.errno is not None else super().__str__()


class DamagedCheckpointError(CheckpointError):
    """A checkpoint whose files differ from its manifest: `checkpoint`, and `file`, the first that differs."""

    def __init__(self, checkpoint: str, file: str, reason: str):
        super().__init__(f"checkpoint {checkpoint} is damaged: {file} {reason}")
        self.checkpoint, self.file = checkpoint, file


# --- state files ----------------------------------------------------------------------------------


def save_state(path: str, obj) -> None:
    """Write `obj` to the state file `path`: tensors, numpy arrays, numbers, strings, None, and lists, tuples and
    dicts of them (what `state_dict()`s and RNG states hold). numpy scalars are saved as Python numbers."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    skeleton = json.dumps(_encode(obj, tensors, set()))
    save_file(tensors, path, metadata={"format": _STATE_FORMAT, "state": skeleton})


def load_state(path: str):
    """The object `save_state` wrote to `path`, its tensors on the CPU in memory of their own. Where only
    `<name>.pt` exists (torch.save: checkpoints from before state files), that is read by torch's weights-only
    unpickler (see `_load_legacy`)."""
    from safetensors import SafetensorError, safe_open

    if not os.path.exists(path) and os.path.exists(_legacy_path(path)):
        return _load_legacy(_legacy_path(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"state file {path} does not exist")
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            # Copies: a tensor safetensors hands out is mapped from the file, which a later change could pull away.
            tensors = {key: f.get_tensor(key).clone() for key in f.keys()}
    except SafetensorError as e:
        raise CheckpointError(f"{path} is not a baton state file: {e}") from e
    if metadata.get("format") != _STATE_FORMAT:
        raise CheckpointError(f"{path} is not a baton state file: its metadata has no format {_STATE_FORMAT!r}")
    return _decode(json.loads(metadata["state"]), tensors)


def has_state(path: str) -> bool:
    """Whether the state file `path`, or the `.pt` file an older checkpoint holds in its place, exists."""
    return os.path.exists(path) or os.path.exists(_legacy_path(path))


def _legacy_path(path: str) -> str:
    return path.removesuffix(STATE_SUFFIX) + ".pt"


def _load_legacy(path: str):
    """A torch.save file, read with torch's weights-only unpickler allowing also the numpy types of RNG states;
    refused if it holds any other object, because unpickling one can run code."""
    reconstruct = np._core.multiarray._reconstruct
    allowed = [np.ndarray, np.dtype, type(np.dtype(np.uint32)), reconstruct,
               (reconstruct, "numpy.core.multiarray._reconstruct")]  # the name numpy 1 pickles it under
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} (a torch.save file of an older checkpoint) holds objects other than tensors, numbers and numpy "
            "arrays; baton does not unpickle them, as that can run code. Resume from a checkpoint written by this "
            "version, or start afresh") from e


def _encode(obj, tensors: dict[str, torch.Tensor], storages: set[int]):
    if isinstance(obj, torch.Tensor):
        tensor = obj.detach().cpu().contiguous()
        if tensor.numel():  # safetensors refuses two tensors over one storage
            pointer = tensor.untyped_storage().data_ptr()
            tensor = tensor.clone() if pointer in storages else tensor
            storages.add(tensor.untyped_storage().data_ptr())
        key = str(len(tensors))
        tensors[key] = tensor
        return {_TENSOR: key}
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("cannot save a numpy array of Python objects in a state file")
        return {_ARRAY: obj.tolist(), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        return obj.item()
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, tuple):
        return {_TUPLE: [_encode(v, tensors, storages) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v, tensors, storages) for v in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and not _TAGS & obj.keys():
            return {k: _encode(v, tensors, storages) for k, v in obj.items()}
        return {_ITEMS: [[_encode(k, tensors, storages), _encode(v, tensors, storages)] for k, v in obj.items()]}
    raise TypeError(f"cannot save a {type(obj).__name__} in a state file: it holds tensors, numpy arrays, numbers, "
                    "strings, None, and lists, tuples and dicts of them")


def _decode(obj, tensors: dict[str, torch.Tensor]):
    if isinstance(obj, list):
        return [_decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    if _TUPLE in obj:
        return tuple(_decode(v, tensors) for v in obj[_TUPLE])
    if _ARRAY in obj:
        return np.array(obj[_ARRAY], dtype=np.dtype(obj["dtype"])).reshape(obj["shape"])
    if _ITEMS in obj:
        return {_decode(k, tensors): _decode(v, tensors) for k, v in obj[_ITEMS]}
    return {k: _decode(v, tensors) for k, v in obj.items()}


# --- the manifest ---------------------------------------------------------------------------------


def write_manifest(directory: str) -> None:
    """Record the size and sha256 of every file under `directory` in its manifest.json (write it last)."""
    files = {name: {"size": os.path.getsize(path), "sha256": _sha256(path)} for name, path in _files(directory)}
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"format": _MANIFEST_FORMAT, "files": files}, f, indent=1)


def verify_manifest(directory: str) -> bool:
    """Check every file under `directory` against its manifest.json; False if it has none (nothing to check).
    Raises DamagedCheckpointError naming the first file that is missing, not listed, or of another size or content."""
    path = os.path.join(directory, MANIFEST)
    if not os.path.isfile(path):
        return False
    try:
        with open(path) as f:
            listed = {name: (entry["size"], entry["sha256"]) for name, entry in json.load(f)["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedCheckpointError(directory, MANIFEST, f"cannot be read ({e})") from e
    present = dict(_files(directory))
    unlisted = sorted(present.keys() - listed.keys())
    if unlisted:
        raise DamagedCheckpointError(directory, unlisted[0], "is not in its manifest (added after it was written)")
    for name, (expected_size, expected_sha256) in sorted(listed.items()):
        if name not in present:
            raise DamagedCheckpointError(directory, name, "is missing")
        size = os.path.getsize(present[name])
        if size != expected_size:
            raise DamagedCheckpointError(directory, name, f"is {size} bytes; the manifest says {expected_size}")
        if _sha256(present[name]) != expected_sha256:
            raise DamagedCheckpointError(directory, name, "has other contents than when it was written (sha256 differs)")
    return True


def verify_checkpoint(path: str) -> None:
    """Raise DamagedCheckpointError if `path` differs from its manifest. One without a manifest (an older baton
    wrote it) is loaded unchecked, which this says on stderr."""
    if not verify_manifest(path):
        print(f"baton: {path} has no {MANIFEST} (an older baton wrote it): loading it without checking its files",
              file=sys.stderr)


def newest_intact(checkpoints: list[str]) -> str:
    """The newest of `checkpoints` (oldest first) that passes `verify_checkpoint`; says on stderr which newer ones
    are damaged and that it falls back. Raises CheckpointError if none passes."""
    damaged = []
    for path in reversed(checkpoints):
        try:
            verify_checkpoint(path)
        except DamagedCheckpointError as e:
            print(f"baton: {e}", file=sys.stderr)
            damaged.append(e)
            continue
        if damaged:
            print(f"baton: falling back to {path}, the newest intact checkpoint", file=sys.stderr)
        return path
    raise CheckpointError(f"no intact checkpoint in {os.path.dirname(checkpoints[-1])}: "
                          + "; ".join(str(e) for e in damaged)
                          + ". Start afresh (no trainer.resume) or pass trainer.resume=<path> of a copy you trust")


def _files(directory: str) -> list[tuple[str, str]]:
    """(path relative to `directory`, full path) of every file under it but the manifest, sorted."""
    found = []
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, directory).replace(os.sep, "/")
            if relative != MANIFEST:
                found.append((relative, path))
    return sorted(found)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def directory_size(directory: str) -> int:
    """Bytes in the files under `directory`."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)


# --- disk errors ----------------------------------------------------------------------------------


def ensure_free_space(run_dir: str, needed_bytes: int | None, checkpoint: str) -> None:
    """Raise CheckpointError (ENOSPC) before `checkpoint` is written if the file system of `run_dir` has less free
    space than `needed_bytes` (None: unknown, nothing to check)."""
    if needed_bytes is None:
        return
    free = shutil.disk_usage(run_dir).free
    if free < needed_bytes:
        raise CheckpointError(errno.ENOSPC, f"cannot write checkpoint {checkpoint}: no space left on device for the "
                              f"run directory {run_dir}: needs about {_size(needed_bytes)} (the size of the last "
                              f"checkpoint), {_size(free)} free. Free some space, or point trainer.run_dir elsewhere",
                              run_dir)


@contextmanager
def writing(checkpoint: str, partial: str, needed_bytes: int | None = None, remove: bool = True):
    """Within: `partial` is written, to become `checkpoint`. If that fails, `partial` is removed (if `remove`: by the
    process that owns it) and a disk error behind the failure (see `disk_error`) is raised again as a CheckpointError
    that names `checkpoint` and says why in words."""
    try:
        yield
    except BaseException as error:
        if remove:
            shutil.rmtree(partial, ignore_errors=True)
        cause = disk_error(error)
        if cause is None:
            raise
        words = _DISK_ERRORS[cause.errno]
        if cause.errno in (errno.ENOSPC, errno.EDQUOT):
            free = _size(shutil.disk_usage(_existing_parent(checkpoint)).free)
            words += f": needs about {_size(needed_bytes)}, {free} free" if needed_bytes else f": {free} free"
        where = f" (writing {cause.filename})" if cause.filename else ""
        raise CheckpointError(cause.errno, f"cannot write checkpoint {checkpoint}: {words}{where}",
                              cause.filename) from error


def disk_error(error: BaseException | None) -> OSError | None:
    """The full-disk, read-only or permission error behind `error`, following its causes: a WorkerError's cause is
    the exception the worker raised (on both backends). safetensors reports I/O errors only as text
    ("... (os error 28)"), so its errno is read from there."""
    from safetensors import SafetensorError

    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_ERRORS:
            return error
        if isinstance(error, SafetensorError):
            match = re.search(r"\(os error (\d+)\)", str(error))
            if match and int(match.group(1)) in _DISK_ERRORS:
                return OSError(int(match.group(1)), os.strerror(int(match.group(1))))
        error = error.__cause__ or error.__context__
    return None


def _existing_parent(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes / 1e3:.1f} kB"
