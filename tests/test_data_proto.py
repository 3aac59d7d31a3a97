"""Tests for baton.data.DataProto: construction, row and key operations, combining, persistence."""

import pickle

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.data import DataProto

FAST = settings(max_examples=50, deadline=None)


def make(num_rows: int = 4, metrics: dict | None = None) -> DataProto:
    """Rows i hold ids [i, i+100], a bool, a uid string and a list of length i % 3."""
    meta = {"temperature": 0.7}
    if metrics is not None:
        meta["metrics"] = metrics
    return DataProto.from_dict(
        tensors={
            "ids": torch.stack([torch.arange(num_rows), torch.arange(num_rows) + 100], dim=1),  # [rows, 2]
            "mask": torch.arange(num_rows) % 2 == 0,  # [rows]
        },
        non_tensors={
            "uid": [f"u{i}" for i in range(num_rows)],
            "lst": [[i] * (i % 3) for i in range(num_rows)],
        },
        meta_info=meta,
    )


def ids(data: DataProto) -> list[int]:
    return data.batch["ids"][:, 0].tolist()


# ---- construction -------------------------------------------------------------------------------


def test_from_dict_builds_object_columns_one_per_row():
    data = DataProto.from_dict(non_tensors={"pairs": [[1, 2], [3, 4], [5, 6]], "ragged": [[1], [2, 3], []]})
    assert len(data) == 3
    assert data.non_tensor_batch["pairs"].shape == (3,)
    assert data.non_tensor_batch["pairs"].dtype == object
    assert data.non_tensor_batch["ragged"][1] == [2, 3]


def test_from_dict_keeps_numpy_arrays():
    array = np.arange(6).reshape(3, 2)
    data = DataProto.from_dict(non_tensors={"a": array})
    assert data.non_tensor_batch["a"] is array


def test_from_single_dict_routes_by_type():
    data = DataProto.from_single_dict({"x": torch.zeros(2, 3), "s": ["a", "b"], "n": np.ones(2)}, {"k": 1})
    assert list(data.batch) == ["x"]
    assert sorted(data.non_tensor_batch) == ["n", "s"]
    assert data.meta_info == {"k": 1}


def test_empty_has_zero_rows():
    assert len(DataProto()) == 0
    assert len(DataProto(meta_info={"a": 1})) == 0


def test_mismatched_rows_names_both_keys_and_lengths():
    expected = r"non_tensor_batch\['uid'\] has 3 rows but batch\['input_ids'\] has 4; every entry"
    with pytest.raises(ValueError, match=expected):
        DataProto.from_dict({"input_ids": torch.zeros(4, 2)}, {"uid": ["a", "b", "c"]})
    with pytest.raises(ValueError, match=r"batch\['b'\] has 5 rows"):
        DataProto(batch={"a": torch.zeros(4), "b": torch.zeros(5)})


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"batch": {"scalar": torch.tensor(1.0)}}, "scalar"),
        ({"non_tensor_batch": {"scalar": np.array(1)}}, "scalar"),
        ({"non_tensor_batch": {"plain_list": ["a", "b"]}}, "plain_list"),
        ({"batch": {"as_numpy": np.zeros(3)}}, "as_numpy"),
        ({"batch": {"ragged_list": [[1, 2], [3]]}}, "ragged_list"),
    ],
)
def test_bad_entries_raise_naming_key(kwargs, key):
    with pytest.raises(ValueError, match=repr(key)):
        DataProto(**kwargs)


def test_check_consistency_catches_later_mutation():
    data = make(4)
    data.batch["extra"] = torch.zeros(3)
    with pytest.raises(ValueError, match="extra"):
        data.check_consistency()


def test_repr_is_short():
    text = repr(make(4))
    assert "rows=4" in text and "ids: (4, 2) int64" in text and "uid: (4,) object" in text


# ---- indexing -----------------------------------------------------------------------------------


def test_int_index_returns_one_row():
    data = make(5)
    assert ids(data[2]) == [2]
    assert ids(data[-1]) == [4]
    assert data[-1].non_tensor_batch["uid"].tolist() == ["u4"]
    with pytest.raises(IndexError):
        data[5]


def test_slice_is_a_view_with_copied_meta():
    data = make(6)
    piece = data[1:4]
    assert ids(piece) == [1, 2, 3]
    assert piece.batch["ids"].data_ptr() == data.batch["ids"][1].data_ptr()
    piece.meta_info["new"] = 1
    assert "new" not in data.meta_info


@pytest.mark.parametrize("index", [[3, 0, -1], np.array([3, 0, 4]), torch.tensor([3, 0, 4])])
def test_int_array_index(index):
    data = make(5)
    assert ids(data[index]) == [3, 0, 4]
    assert data[index].non_tensor_batch["uid"].tolist() == ["u3", "u0", "u4"]


@pytest.mark.parametrize("as_mask", [np.array, torch.tensor])
def test_bool_mask_index(as_mask):
    data = make(4)
    picked = data[as_mask([True, False, False, True])]
    assert ids(picked) == [0, 3]
    assert picked.non_tensor_batch["uid"].tolist() == ["u0", "u3"]


def test_wrong_length_mask_raises():
    with pytest.raises(ValueError, match="3 entries but the DataProto has 4 rows"):
        make(4)[np.array([True, False, True])]


def test_empty_index_gives_zero_rows():
    assert len(make(4)[[]]) == 0


# ---- keys ---------------------------------------------------------------------------------------


def test_select_keeps_only_given_keys():
    data = make(3)
    picked = data.select(batch_keys=["ids"], non_tensor_keys=[], meta_keys=None)
    assert list(picked.batch) == ["ids"] and not picked.non_tensor_batch
    assert picked.meta_info == {"temperature": 0.7}
    assert sorted(data.batch) == ["ids", "mask"]


def test_select_unknown_key_lists_available():
    with pytest.raises(ValueError, match=r"no key 'nope'; available: \['ids', 'mask'\]"):
        make(3).select(batch_keys=["nope"])


def test_pop_removes_from_self():
    data = make(3)
    popped = data.pop(batch_keys=["mask"], non_tensor_keys=["uid"], meta_keys=["temperature"])
    assert list(popped.batch) == ["mask"] and list(popped.non_tensor_batch) == ["uid"]
    assert popped.meta_info == {"temperature": 0.7}
    assert list(data.batch) == ["ids"] and list(data.non_tensor_batch) == ["lst"] and not data.meta_info
    with pytest.raises(ValueError, match="mask"):
        data.pop(batch_keys=["mask"])


def test_rename_single_list_and_swap():
    data = make(3).rename("ids", "input_ids")
    assert "input_ids" in data.batch and "ids" not in data.batch
    data.rename(["uid", "lst"], ["lst", "uid"])
    assert data.non_tensor_batch["lst"].tolist() == ["u0", "u1", "u2"]


def test_rename_collision_raises_and_leaves_self_unchanged():
    data = make(3)
    with pytest.raises(ValueError, match="'mask'"):
        data.rename("ids", "mask")
    assert sorted(data.batch) == ["ids", "mask"]
    with pytest.raises(ValueError, match="'nope'"):
        data.rename("nope", "x")


# ---- chunk, split, concat, union ----------------------------------------------------------------


@pytest.mark.parametrize("num_rows, n, sizes", [(10, 4, [3, 3, 2, 2]), (3, 4, [1, 1, 1, 0]), (0, 2, [0, 0])])
def test_chunk_sizes(num_rows, n, sizes):
    pieces = make(num_rows).chunk(n)
    assert [len(p) for p in pieces] == sizes
    assert ids(DataProto.concat(pieces)) == list(range(num_rows))


def test_chunk_rejects_n_below_one():
    with pytest.raises(ValueError, match="num_chunks >= 1"):
        make(3).chunk(0)


def test_chunk_gives_metrics_to_first_piece_only():
    pieces = make(4, metrics={"loss": [1.0]}).chunk(2)
    assert pieces[0].meta_info["metrics"] == {"loss": [1.0]}
    assert "metrics" not in pieces[1].meta_info
    assert pieces[1].meta_info["temperature"] == 0.7


def test_chunk_pieces_are_views():
    data = make(4)
    assert data.chunk(2)[1].batch["ids"].data_ptr() == data.batch["ids"][2].data_ptr()


def test_split_sizes():
    assert [len(p) for p in make(7).split(3)] == [3, 3, 1]
    assert [len(p) for p in make(6).split(3)] == [3, 3]
    assert [len(p) for p in make(0).split(3)] == [0]


def test_concat_missing_key_names_key_and_part():
    parts = [make(2), make(2), make(2).select(batch_keys=["ids"])]
    with pytest.raises(ValueError, match=r"part 2 lacks batch\['mask'\]"):
        DataProto.concat(parts)


def test_concat_trailing_shape_mismatch():
    parts = [DataProto(batch={"x": torch.zeros(2, 3)}), DataProto(batch={"x": torch.zeros(2, 4)})]
    with pytest.raises(ValueError, match=r"batch\['x'\] has shape \(2, 4\) in part 1"):
        DataProto.concat(parts)


def test_concat_meta_mismatch_names_key():
    other = make(2)
    other.meta_info["temperature"] = 1.0
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs between part 0 and part 1"):
        DataProto.concat([make(2), other])
    other.meta_info.pop("temperature")
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] is missing from part 1"):
        DataProto.concat([make(2), other])


def test_concat_compares_array_meta_by_value():
    parts = [DataProto(meta_info={"w": torch.ones(3), "a": np.arange(2)}) for _ in range(2)]
    assert DataProto.concat(parts).meta_info["w"].tolist() == [1.0, 1.0, 1.0]


def test_concat_merges_metrics_from_every_part():
    parts = [make(1, metrics={"loss": [1.0, 2.0]}), make(1, metrics={"loss": 3.0, "kl": 0.1}), make(1)]
    merged = DataProto.concat(parts)
    assert merged.meta_info["metrics"] == {"loss": [1.0, 2.0, 3.0], "kl": [0.1]}
    assert merged.meta_info["temperature"] == 0.7


def test_concat_empty_list_raises():
    with pytest.raises(ValueError, match="at least one"):
        DataProto.concat([])


def test_union_merges_keys():
    data = make(3)
    same_uid = data.non_tensor_batch["uid"].copy()
    extra = DataProto.from_dict({"reward": torch.ones(3)}, {"uid": same_uid}, {"step": 2})
    merged = data.union(extra)
    assert sorted(merged.batch) == ["ids", "mask", "reward"]
    assert merged.meta_info == {"temperature": 0.7, "step": 2}
    assert "reward" not in data.batch


def test_union_conflict_and_length_mismatch_raise():
    data = make(3)
    with pytest.raises(ValueError, match=r"batch\['ids'\] differs"):
        data.union(DataProto(batch={"ids": torch.zeros(3, 2, dtype=torch.int64)}))
    with pytest.raises(ValueError, match=r"meta_info\['temperature'\] differs"):
        data.union(DataProto(meta_info={"temperature": 1.0}))
    with pytest.raises(ValueError, match="equal row counts, got 3 and 2"):
        data.union(make(2))


# ---- repeat, padding, devices -------------------------------------------------------------------


def test_repeat_interleave_and_tile_order():
    data = make(3)
    assert ids(data.repeat(2, interleave=True)) == [0, 0, 1, 1, 2, 2]
    assert data.repeat(2).non_tensor_batch["uid"].tolist() == ["u0", "u0", "u1", "u1", "u2", "u2"]
    assert ids(data.repeat(2, interleave=False)) == [0, 1, 2, 0, 1, 2]
    assert data.repeat(2, interleave=False).non_tensor_batch["lst"].tolist() == [[], [1], [2, 2]] * 2


def test_padded_cycles_rows_when_pad_exceeds_len():
    data = make(2)
    padded, pad_size = data.padded(7)
    assert pad_size == 5 and ids(padded) == [0, 1, 0, 1, 0, 1, 0]
    assert padded.unpadded(pad_size).equals(data)


def test_padded_no_pad_and_zero_rows_return_self():
    data = make(4)
    assert data.padded(2) == (data, 0)
    empty = make(0)
    assert empty.padded(3) == (empty, 0)
    with pytest.raises(ValueError, match="pad_size"):
        data.unpadded(5)


def test_to_cpu_returns_new():
    data = make(2)
    moved = data.to("cpu")
    assert moved is not data and moved.equals(data)
    assert moved.batch["ids"].device.type == "cpu"


# ---- equality, persistence, pickling ------------------------------------------------------------


def test_equals_checks_dtype_and_object_values():
    data = make(3)
    assert data.equals(make(3))
    other = make(3)
    other.batch["ids"] = other.batch["ids"].float()
    assert not data.equals(other)
    other = make(3)
    other.non_tensor_batch["lst"][2] = [9]
    assert not data.equals(other)


def rich() -> DataProto:
    return DataProto.from_dict(
        tensors={
            "bf16": torch.randn(3, 4).to(torch.bfloat16),  # [rows, 4]
            "f8": torch.randn(3, 2).to(torch.float8_e4m3fn),
            "flag": torch.tensor([True, False, True]),
            "tok": torch.tensor([1, 2, 2**40], dtype=torch.int64),
            "grad": torch.ones(3, requires_grad=True) * 2,
            "strided": torch.arange(12.0).reshape(4, 3).t()[:, :3].t(),  # non-contiguous view
        },
        non_tensors={"uid": ["a", "b", "c"], "lst": [[1], [2, 3], {"k": 4}]},
        meta_info={"metrics": {"loss": [0.5]}, "step": 3},
    )


def test_save_load_round_trip_and_refuses_overwrite(tmp_path):
    data, path = rich(), tmp_path / "batch.pt"
    data.save(path)
    loaded = DataProto.load(path)
    assert loaded.equals(data)
    assert loaded.batch["bf16"].dtype == torch.bfloat16
    with pytest.raises(FileExistsError, match="overwrite=True"):
        make(2).save(path)
    make(2).save(path, overwrite=True)
    assert len(DataProto.load(path)) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["batch.pt"]
    data.save_pickle(tmp_path / "batch.pkl")
    assert DataProto.load_trusted_pickle(tmp_path / "batch.pkl").equals(data)
    with pytest.raises(ValueError, match="load_trusted_pickle"):
        DataProto.load(tmp_path / "batch.pkl")  # the safe load reads no pickle


def test_pickle_round_trip_preserves_values_and_dtypes():
    data = rich()
    loaded = pickle.loads(pickle.dumps(data, protocol=5))
    for key, tensor in data.batch.items():
        assert loaded.batch[key].dtype == tensor.dtype, key
        assert torch.equal(loaded.batch[key], tensor.detach()), key
        assert not loaded.batch[key].requires_grad
    assert loaded.non_tensor_batch["lst"][2] == {"k": 4}
    assert loaded.meta_info == data.meta_info


def test_pickle_sends_tensors_out_of_band():
    data = DataProto(batch={"x": torch.randn(256 * 1024)})  # 1 MiB of float32
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    assert len(payload) < 2_000
    assert sum(b.raw().nbytes for b in buffers) == 1024 * 1024
    loaded = pickle.loads(payload, buffers=buffers)
    assert torch.equal(loaded.batch["x"], data.batch["x"])


def test_unpickled_from_read_only_buffers_is_silent(recwarn):
    data = DataProto(batch={"x": torch.arange(8.0)})
    buffers = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    read_only = [memoryview(b.raw().tobytes()) for b in buffers]
    loaded = pickle.loads(payload, buffers=read_only)
    assert loaded.batch["x"].tolist() == list(range(8))
    assert not [w for w in recwarn if "non-writable" in str(w.message)]


# ---- properties ---------------------------------------------------------------------------------


@FAST
@given(num_rows=st.integers(0, 50), n=st.integers(1, 8))
def test_chunk_concat_round_trip(num_rows, n):
    data = make(num_rows, metrics={"loss": [1.0, 2.0]})
    pieces = data.chunk(n)
    sizes = [len(p) for p in pieces]
    assert len(pieces) == n and sum(sizes) == num_rows
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert DataProto.concat(pieces).equals(data)


@FAST
@given(num_rows=st.integers(0, 50), divisor=st.integers(1, 8))
def test_padded_unpadded_round_trip(num_rows, divisor):
    data = make(num_rows, metrics={"loss": [1.0]})
    padded, pad_size = data.padded(divisor)
    assert len(padded) % divisor == 0 and len(padded) == num_rows + pad_size
    assert padded.unpadded(pad_size).equals(data)


@FAST
@given(num_rows=st.integers(0, 50), size=st.integers(1, 8))
def test_split_concat_round_trip(num_rows, size):
    data = make(num_rows, metrics={"loss": [1.0]})
    pieces = data.split(size)
    assert all(len(p) == size for p in pieces[:-1]) and 0 <= len(pieces[-1]) <= size
    assert DataProto.concat(pieces).equals(data)
