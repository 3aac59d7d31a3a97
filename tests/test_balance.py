"""A data-parallel update's batch is reordered so that each rank's piece holds about equal real tokens
(baton.data.balance, verl's balance_batch), in the algorithm all three drivers share."""

from __future__ import annotations

import random

import torch

from baton.data import DataProto
from baton.data.balance import balance_by_tokens, balanced_order
from baton.distributed.dispatch import Layout
from baton.rl import RLAlgorithm
from baton.rl.config import AlgorithmConfig


def piece_sums(lengths: list[int], order: list[int], num_parts: int) -> list[int]:
    size = len(order) // num_parts
    return [sum(lengths[r] for r in order[i * size:(i + 1) * size]) for i in range(num_parts)]


def test_the_pieces_differ_by_at_most_the_longest_row_and_every_row_is_kept_once():
    rng = random.Random(0)
    for num_parts in (2, 4, 8):
        lengths = [int(rng.lognormvariate(6.5, 0.9)) + 1 for _ in range(num_parts * 16)]
        order = balanced_order(lengths, num_parts)
        assert sorted(order) == list(range(len(lengths)))
        balanced, plain = piece_sums(lengths, order, num_parts), piece_sums(lengths, list(range(len(lengths))), num_parts)
        assert max(balanced) - min(balanced) <= max(lengths)
        assert max(balanced) < max(plain)  # the slowest rank's share shrinks
        for i in range(num_parts):  # each piece keeps its rows in their first order
            piece = order[i * len(lengths) // num_parts:(i + 1) * len(lengths) // num_parts]
            assert piece == sorted(piece)


def batch_of(lengths: list[int]) -> DataProto:
    width = max(lengths)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return DataProto.from_dict({"attention_mask": mask, "row": torch.arange(len(lengths))})


def test_a_batch_that_cannot_be_balanced_comes_back_as_it_is():
    batch = batch_of([5, 1, 1, 5, 9])
    assert balance_by_tokens(batch, 2) is batch  # 5 rows do not split into 2 equal pieces
    assert balance_by_tokens(batch, 1) is batch
    assert balance_by_tokens(DataProto.from_dict({"x": torch.zeros(4)}), 2).batch["x"].shape == (4,)


class RecordingRole:
    """A cluster of `dp_size` ranks as the algorithm sees it: its layout and train_step."""

    def __init__(self, dp_size: int):
        self.layout = Layout.plain(dp_size)
        self.batches: list[DataProto] = []

    def train_step(self, batch, loss_fn, loss_unit="token"):
        self.batches.append(batch)
        return [{"loss": 0.0}]


def test_the_algorithm_balances_each_mini_batch_over_the_ranks_and_can_be_told_not_to():
    lengths = [40, 38, 36, 30, 4, 3, 2, 1]  # long rows first: two ranks in data order would get 144 and 10 tokens
    for balance, expected_max in ((True, 77), (False, 144)):  # 154 tokens: 77 each
        role = RecordingRole(dp_size=2)
        RLAlgorithm(AlgorithmConfig(balance_batch=balance)).update(role, batch_of(lengths), loss_fn=None)
        [sent] = role.batches
        sums = [int(piece.batch["attention_mask"].sum()) for piece in sent.chunk(2)]
        assert max(sums) == expected_max and sum(sums) == sum(lengths)
        assert sorted(sent.batch["row"].tolist()) == list(range(8))
