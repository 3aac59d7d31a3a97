"""The pieces of a weight sync (`baton.data.shards`): fingerprints that add up over any row split and see one changed
element, and a destination that refuses pieces which do not make up a weight."""

from __future__ import annotations

import pytest
import torch

from baton.data import TensorBucket
from baton.data.shards import WeightPiece, assemble, fingerprint, pieces_buckets

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
