"""The pieces of a weight sync (`baton.data.shards`): fingerprints that add up over any row split and see one changed
element, and a destination that refuses pieces which do not make up a weight."""

from __future__ import annotations

import pytest
import torch

from baton.data import TensorBucket
from baton.data.shards import WeightPiece, WeightShards, assemble, fingerprint, pieces_buckets

MOD = 1 << 64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_the_pieces_fingerprints_add_up_to_the_whole_weights_for_any_split(dtype):
    weight = (torch.randn(11, 7, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    for cuts in ([0, 11], [0, 3, 11], [0, 1, 2, 6, 6, 11]):
        parts = [fingerprint(weight[a:b], a * 7) for a, b in zip(cuts, cuts[1:])]
        assert sum(parts) % MOD == fingerprint(weight)


def test_a_tensor_whose_memory_starts_inside_a_word_has_the_fingerprint_of_its_copy():
    flat = torch.arange(9, dtype=torch.float32)
    assert fingerprint(flat[1:5]) == fingerprint(flat[1:5].clone()) != fingerprint(flat[:4])


def test_one_changed_or_moved_element_changes_the_fingerprint():
    weight = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    nudged, swapped = weight.clone(), weight.clone()
    nudged[40, 3] = torch.nextafter(nudged[40, 3], torch.tensor(float("inf")))  # one ulp
    swapped[[0, 1]] = swapped[[1, 0]]
    prints = {fingerprint(weight), fingerprint(nudged), fingerprint(swapped), fingerprint(weight.to(torch.bfloat16))}
    assert len(prints) == 4


def test_pieces_that_do_not_make_up_a_weight_are_refused():
    rows = TensorBucket({"w": torch.ones(2, 3)}, shapes={"w": (5, 3)})
    with pytest.raises(ValueError, match=r"weight 'w' arrived as pieces of shape \(4, 3\), not its \(5, 3\)"):
        assemble([rows, rows])


def test_the_pieces_of_a_weight_go_straight_into_the_destinations_tensor_where_it_fits():
    weight = torch.randn(5, 3)
    ranks = [TensorBucket({"w": weight[:2]}, shapes={"w": (5, 3)}, offsets={"w": 0}),
             TensorBucket({"w": weight[2:]}, shapes={"w": (5, 3)}, offsets={"w": 2})]
    served = {"w": torch.zeros(5, 3)}
    whole = assemble(ranks, served.get)["w"]
    assert whole.data_ptr() == served["w"].data_ptr() and torch.equal(served["w"], weight)
    other_dtype = {"w": torch.zeros(5, 3, dtype=torch.float64)}
    assert torch.equal(assemble(ranks, other_dtype.get)["w"], weight) and not other_dtype["w"].any()


def test_every_rank_cuts_its_buckets_at_the_same_weights_and_tied_names_stay_with_theirs():
    def pieces(rank: int):  # rank 1 holds no rows of "b" (another rank sends them)
        yield WeightPiece("a", torch.zeros(2, 4), (4, 4), torch.float32, 2 * rank)
        yield WeightPiece("b", None if rank else torch.zeros(4, 4), (4, 4), torch.float32)
        yield WeightPiece("b_tied", None, (4, 4), torch.float32, tied_to="b")
        yield WeightPiece("c", torch.zeros(1, 4), (2, 4), torch.float32, rank)

    cut = [[sorted(bucket.tensors) + sorted(bucket.aliases) for bucket in pieces_buckets(pieces(rank), 64, 2)]
           for rank in range(2)]
    assert cut == [[["a", "b", "b_tied"], ["c"]], [["a", "b_tied"], ["c"]]]  # 64 bytes a rank: a and b, then c


def test_a_weight_larger_than_a_bucket_goes_in_blocks_of_rows_and_comes_back_whole():
    from baton.workers.weight_sync import assembled_buckets

    weight = torch.randn(10, 4)  # 160 bytes; a rank's bucket holds 32: 64 bytes of the whole weight, 4 rows

    def pieces(rank: int):  # rank r holds rows 5r..5r+4, so blocks [4, 8) come from both ranks
        yield WeightPiece("embed", weight[5 * rank : 5 * rank + 5], (10, 4), torch.float32, 5 * rank)
        yield WeightPiece("head", None, (10, 4), torch.float32, tied_to="embed")
        yield WeightPiece("norm", torch.ones(4) if rank == 0 else None, (4,), torch.float32)

    shards = [WeightShards(list(pieces_buckets(pieces(rank), 32, 2))) for rank in range(2)]
    assert [len(part.buckets) for part in shards] == [3, 3]  # rows 0-3, 4-7, then 8-9 and the norm: cut alike
    loads = list(assembled_buckets(shards))
    assert [sorted(load) for load in loads] == [[], [], ["embed", "head", "norm"]]
    assert torch.equal(loads[2]["embed"], weight) and loads[2]["head"] is loads[2]["embed"]
    with pytest.raises(ValueError, match=r"weights \['embed'\] arrived incomplete"):
        list(assembled_buckets([WeightShards(part.buckets[:1] + part.buckets[2:]) for part in shards]))
    # Streamed, one load per bucket: the blocks wait between the loads for the last one.
    streamed = [WeightShards(part.buckets, stream="sync-1") for part in shards]
    served = {"embed": torch.zeros(10, 4)}
    for k in range(3):
        for load in assembled_buckets([WeightShards([part.buckets[k]], stream="sync-1") for part in streamed],
                                      _Model(served)):
            assert k != 2 or load["embed"].data_ptr() == served["embed"].data_ptr()
    assert torch.equal(served["embed"], weight)


class _Model(torch.nn.Module):
    """A destination model whose state dict is `tensors` (its own tensors take the blocks as they come)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.tensors = tensors

    def state_dict(self, *args, **kwargs):
        return self.tensors
