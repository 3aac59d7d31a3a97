"""A weight sync's buckets through shared memory (`/dev/shm`), where the source and its destinations run on one host.

Each source process keeps two files there (a ring of two slots) and copies bucket k into slot k mod 2, casting to
the destination's dtype on the way: one copy, straight from its weights, with no object-store write and no
temporary. It hands the destinations a `SharedBucket`, a few hundred bytes that say which file, which generation
and where each tensor lies; a destination maps the file once and copies the tensors into its parameters. Two slots
let the source write bucket k + 1 while the destinations read bucket k, so the sender must wait until bucket k is
loaded before it asks for bucket k + 2 (`ModelUpdatePair` does); each slot's header holds the generation it was
last written for, and a reader that finds another one (the slot was overwritten under it) raises instead of loading
mixed weights.

The files are the source's: removed when it closes the ring or exits, and, since a killed process removes nothing,
a source removes those of dead processes of this user when it makes its own. A destination opens only files under
`/dev/shm` named as a source names them, and checks every tensor lies inside the file.
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import socket
import uuid
from collections import OrderedDict
from dataclasses import dataclass

import torch

from baton.data.bucket import PackedBucket, TensorBucket

SHM_DIR = "/dev/shm"
_PREFIX = "baton-sync"
_NAME = re.compile(rf"^{_PREFIX}-(\d+)-[0-9a-f]{{32}}-\d+-\d+$")
_HEADER = 64  # bytes before the tensors: magic, generation (int64 each)
_MAGIC = 0x62746E53594E4331  # "btnSYNC1"
_OPEN_FILES = 16  # a destination keeps this many files mapped (two per source rank it reads)


def available() -> bool:
    """Whether this host has a shared-memory directory a sync can use."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def host_id() -> str:
    """This host (its name and this boot): a bucket written here is readable only by processes with the same."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class SharedBucket:
    """One bucket in a source's slot: the file, the generation it was written as, the host, and where its tensors
    lie in the file."""

    path: str
    generation: int
    host: str
    packed: PackedBucket


class SharedBucketRing:
    """A source's two slots. `write` copies a bucket's tensors into the next slot, growing its file when a bucket is
    larger than any before (OSError where /dev/shm has no room for it: send that bucket another way); `close` removes
    the files."""

    def __init__(self, slots: int = 2):
        if not available():
            raise ValueError(f"no writable {SHM_DIR} on this host: sync through Ray's object store instead")
        _remove_files_of_dead_processes()
        self.host = host_id()
        self._name = f"{_PREFIX}-{os.getpid()}-{uuid.uuid4().hex}"
        self._files: list[tuple[str, torch.Tensor] | None] = [None] * slots
        self._generation = 0
        atexit.register(self.close)

    def write(self, bucket: TensorBucket, dtype: torch.dtype | None = None) -> tuple[SharedBucket, TensorBucket]:
        """`bucket`'s tensors (floating ones cast to `dtype` where given) into the next slot: its description for the
        destinations, and the slot's tensors (what they will read) for the sender's fingerprints."""
        self._generation += 1
        slot = self._generation % len(self._files)

        def memory_for(size: int) -> torch.Tensor:
            path, memory = self._slot(slot, size)
            memory[8:16].view(torch.int64)[0] = -1  # being written: a reader of the slot's last bucket sees a change
            return memory

        packed, written = PackedBucket.pack(bucket, memory_for, dtype, _HEADER)
        path, memory = self._files[slot]
        memory[:16].view(torch.int64).copy_(torch.tensor([_MAGIC, self._generation]))
        return SharedBucket(path, self._generation, self.host, packed), written

    @property
    def num_bytes(self) -> int:
        """The shared memory the slots hold now."""
        return sum(memory.numel() for _, memory in filter(None, self._files))

    def _slot(self, slot: int, size: int) -> tuple[str, torch.Tensor]:
        current = self._files[slot]
        if current is not None and current[1].numel() >= size:
            return current
        if current is not None:
            _remove(current[0])
            self._files[slot] = None
        path = os.path.join(SHM_DIR, f"{self._name}-{slot}-{self._generation}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # the pages now, or ENOSPC here: a full /dev/shm must not crash a write
            memory = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
        except OSError:
            _remove(path)
            raise
        finally:
            os.close(fd)
        self._files[slot] = (path, memory)
        return path, memory

    def close(self) -> None:
        for slot, current in enumerate(self._files):
            if current is not None:
                _remove(current[0])
                self._files[slot] = None


_MAPPED: OrderedDict[str, torch.Tensor] = OrderedDict()


def read_shared(bucket: SharedBucket) -> TensorBucket:
    """The tensors of `bucket`, in place in the source's slot (read-only by contract: copy them into parameters),
    after `check_generation`."""
    if bucket.host != host_id():
        raise ValueError(f"a shared-memory bucket from host {bucket.host!r} cannot be read on {host_id()!r}: a sync "
                         "between hosts goes through Ray's object store")
    directory, name = os.path.split(bucket.path)
    if directory != SHM_DIR or not _NAME.match(name):
        raise ValueError(f"{bucket.path!r} is not a weight-sync slot (files {SHM_DIR}/{_PREFIX}-*)")
    memory = _map(bucket.path)
    tensors = bucket.packed.unpack(memory)
    check_generation(bucket, memory)
    return tensors


def check_generation(bucket: SharedBucket, memory: torch.Tensor | None = None) -> None:
    """Raises where `bucket`'s slot no longer holds it (the source wrote another bucket into it)."""
    memory = _map(bucket.path) if memory is None else memory
    magic, generation = (int(v) for v in memory[:16].view(torch.int64))
    if magic != _MAGIC or generation != bucket.generation:
        raise ValueError(f"weight-sync slot {bucket.path} was overwritten while bucket {bucket.generation} was read "
                         "(a source may be at most one bucket ahead of its destinations)")


def _map(path: str) -> torch.Tensor:
    """A slot's file, mapped (the last few stay mapped: a sync reads the same files bucket after bucket)."""
    memory = _MAPPED.pop(path, None)
    if memory is None:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise ValueError(f"weight-sync slot {path} is gone: its source process ended or wrote a larger bucket "
                             "before this one was read") from None
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER:
                raise ValueError(f"weight-sync slot {path} has {size} bytes: too short for its header")
            memory = torch.frombuffer(mmap.mmap(fd, size), dtype=torch.uint8)
        finally:
            os.close(fd)
    _MAPPED[path] = memory
    while len(_MAPPED) > _OPEN_FILES:
        _MAPPED.popitem(last=False)
    return memory


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_files_of_dead_processes() -> None:
    """A killed source leaves its slots behind: remove this user's whose process is gone."""
    for name in os.listdir(SHM_DIR):
        match = _NAME.match(name)
        if match is None:
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _remove(path)
        except (PermissionError, FileNotFoundError):
            pass


__all__ = ["SharedBucket", "SharedBucketRing", "available", "check_generation", "host_id", "read_shared"]
