"""A weight sync's buckets through shared memory (`baton.data.shared_buckets`): what a destination reads is what the
source wrote, cast on the way; a slot overwritten under a reader, a file that is gone and a descriptor that points
elsewhere are refused; the files of dead sources are removed."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import replace

import pytest
import torch

from baton.data import TensorBucket
from baton.data.shared_buckets import SHM_DIR, SharedBucketRing, available, check_generation, read_shared
from baton.data.shards import bucket_fingerprints

pytestmark = pytest.mark.skipif(not available(), reason="no writable /dev/shm on this host")


def bucket(seed: int, rows: int = 5) -> TensorBucket:
    generator = torch.Generator().manual_seed(seed)
    return TensorBucket({"w": torch.randn(rows, 3, generator=generator), "steps": torch.arange(4)},
                        shapes={"w": (10, 3)}, offsets={"w": 5}, aliases={"lm_head.weight": "w"})


@pytest.fixture
def ring():
    ring = SharedBucketRing()
    yield ring
    ring.close()


def test_a_destination_reads_what_the_source_wrote_cast_to_its_dtype(ring):
    sent, written = ring.write(bucket(0), torch.bfloat16)
    read = read_shared(sent)
    assert torch.equal(read.tensors["w"], bucket(0).tensors["w"].to(torch.bfloat16))
    assert torch.equal(read.tensors["steps"], torch.arange(4))  # integer tensors keep their dtype
    assert (read.shapes, read.offsets, read.aliases) == ({"w": (10, 3)}, {"w": 5}, {"lm_head.weight": "w"})
    assert bucket_fingerprints(read) == bucket_fingerprints(written)


def test_a_slot_overwritten_under_its_reader_is_refused(ring):
    first, _ = ring.write(bucket(0))
    read = read_shared(first)
    ring.write(bucket(1))  # the other slot: the first bucket is still there
    check_generation(first)
    ring.write(bucket(2))  # into the first bucket's slot
    with pytest.raises(ValueError, match="was overwritten while bucket 1 was read"):
        check_generation(first)
    with pytest.raises(ValueError, match="was overwritten"):
        read_shared(first)
    assert not torch.equal(read.tensors["w"], bucket(0).tensors["w"])  # why: the memory under it changed


def test_a_larger_bucket_takes_a_new_file_and_the_old_one_is_gone(ring):
    small, _ = ring.write(bucket(0))
    ring.write(bucket(1))
    large, _ = ring.write(bucket(2, rows=5000))  # the first slot again, in a larger file
    assert large.path != small.path and not os.path.exists(small.path)
    with pytest.raises(ValueError, match="is gone"):
        read_shared(small)
    assert torch.equal(read_shared(large).tensors["w"], bucket(2, rows=5000).tensors["w"])


def test_a_descriptor_that_points_elsewhere_is_refused(ring):
    sent, _ = ring.write(bucket(0))
    with pytest.raises(ValueError, match="is not a weight-sync slot"):
        read_shared(replace(sent, path="/etc/passwd"))
    with pytest.raises(ValueError, match="cannot be read on"):
        read_shared(replace(sent, host="elsewhere/0"))
    with pytest.raises(ValueError, match="names dtype .load., which is not a torch dtype"):
        read_shared(replace(sent, packed=replace(sent.packed, layout={"w": ("load", (5, 3), 64)})))
    with pytest.raises(ValueError, match="places tensor .w. outside its buffer"):
        read_shared(replace(sent, packed=replace(sent.packed, layout={"w": ("float32", (1 << 20, 3), 64)})))


def test_a_dead_sources_files_are_removed_and_a_closed_ring_leaves_none():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = os.path.join(SHM_DIR, f"baton-sync-{int(dead.stdout)}-{uuid.uuid4().hex}-0-1")
    open(left, "wb").close()
    ring = SharedBucketRing()
    assert not os.path.exists(left)
    first, _ = ring.write(bucket(0))
    second, _ = ring.write(bucket(1))
    ring.close()
    assert not os.path.exists(first.path) and not os.path.exists(second.path)
