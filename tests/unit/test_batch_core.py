"""Batch: building, indexing, split/concat with padding, repeat, union, pickling."""

from __future__ import annotations

import pickle

import cloudpickle
import numpy as np
import pytest
import torch
from verity.batch import Batch, BatchError


def make_batch(n: int) -> Batch:
    """Row i has responses [i, 100+i], scores float(i), ground_truth str(i)."""
    rows = torch.arange(n)
    return Batch.from_dict(
        {"responses": torch.stack([rows, rows + 100], dim=1), "scores": rows.float()},
        {"ground_truth": [str(i) for i in range(n)]},
        {"temperature": 1.0},
    )


# ---------------------------------------------------------------- building and access
def test_from_dict_reads_batch_size_and_keys():
    b = make_batch(5)
    assert len(b) == 5
    assert b.keys() == ["responses", "scores", "ground_truth"]
    assert b["responses"].shape == (5, 2)
    assert b["ground_truth"] == ["0", "1", "2", "3", "4"]
    assert b.meta == {"temperature": 1.0}
    assert "scores" in b and "missing" not in b


def test_from_dict_only_lists_and_empty():
    b = Batch.from_dict(non_tensors={"prompt_text": ["a", "b", "c"]})
    assert len(b) == 3
    assert len(Batch.from_dict()) == 0
    assert len(Batch.from_dict(batch_size=4)) == 4


def test_from_dict_rejects_mismatched_lengths_naming_key():
    with pytest.raises(BatchError, match="'scores'.*first dimension is 4, expected B=3"):
        Batch.from_dict({"responses": torch.zeros(3, 2), "scores": torch.zeros(4)})
    with pytest.raises(BatchError, match="'ground_truth': has 2 values, expected B=3"):
        Batch.from_dict({"scores": torch.zeros(3)}, {"ground_truth": ["a", "b"]})
    with pytest.raises(BatchError, match="'scores'.*0-d tensor"):
        Batch.from_dict({"scores": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="'scores'.*expected a torch.Tensor, got list"):
        Batch.from_dict({"scores": [1.0, 2.0]})
    with pytest.raises(TypeError, match="'uid'.*got int"):
        Batch.from_dict({"scores": torch.zeros(2)}, {"uid": 3})
    with pytest.raises(BatchError, match="'scores' is given both"):
        Batch.from_dict({"scores": torch.zeros(2)}, {"scores": [1, 2]})


def test_setitem_getitem_and_pop():
    b = make_batch(3)
    b["values"] = torch.ones(3, 2)
    b["uid"] = ("u0", "u1", "u2")
    assert b["uid"] == ["u0", "u1", "u2"]
    assert torch.equal(b["values"], torch.ones(3, 2))
    with pytest.raises(BatchError, match="'values'.*first dimension is 2, expected B=3"):
        b["values"] = torch.ones(2, 2)
    with pytest.raises(BatchError, match="'uid': has 4 values"):
        b["uid"] = ["a", "b", "c", "d"]
    with pytest.raises(KeyError, match="no key 'nope'"):
        b["nope"]
    # a list replaces a tensor of the same name and vice versa
    b["scores"] = [0, 1, 2]
    assert b.non_tensor_keys()[-1] == "scores" and "scores" not in b.tensor_keys()
    b["scores"] = np.array([1.0, 2.0, 3.0])
    assert b["scores"].tolist() == [1.0, 2.0, 3.0] and "scores" not in b.non_tensors
    assert b.pop("uid") == ["u0", "u1", "u2"] and "uid" not in b
    del b["values"]
    assert "values" not in b


def test_setitem_on_empty_batch_defines_size():
    b = Batch.from_dict()
    b["scores"] = torch.zeros(6)
    assert len(b) == 6


def test_batch_is_not_iterable():
    with pytest.raises(TypeError, match="not iterable"):
        list(make_batch(2))


# ---------------------------------------------------------------- rows
def test_index_variants():
    b = make_batch(6)
    assert b.index(2)["scores"].tolist() == [2.0]
    assert b.index(-1)["ground_truth"] == ["5"]
    assert b[1:3]["scores"].tolist() == [1.0, 2.0]
    assert b.index([4, 0, 4])["ground_truth"] == ["4", "0", "4"]
    assert b.index(torch.tensor([5, 1]))["responses"].tolist() == [[5, 105], [1, 101]]
    mask = torch.tensor([True, False, False, True, False, True])
    picked = b.index(mask)
    assert picked["scores"].tolist() == [0.0, 3.0, 5.0] and picked["ground_truth"] == ["0", "3", "5"]
    assert picked.meta == {"temperature": 1.0}
    with pytest.raises(IndexError, match="row 6 is out of range for B=6"):
        b.index(6)
    with pytest.raises(BatchError, match="boolean mask has length 2"):
        b.index(torch.tensor([True, False]))
    with pytest.raises(TypeError, match="must be integers"):
        b.index(torch.tensor([0.5]))


def test_select_keeps_only_named_keys():
    b = make_batch(4)
    s = b.select("scores", "ground_truth")
    assert s.keys() == ["scores", "ground_truth"]
    assert s["scores"].data_ptr() == b["scores"].data_ptr()  # no copy
    with pytest.raises(KeyError, match=r"no key\(s\) \['nope'\]"):
        b.select("scores", "nope")


def test_repeat_interleave_is_interleaved():
    b = make_batch(3)
    r = b.repeat_interleave(2)
    assert r["scores"].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
    assert r["ground_truth"] == ["0", "0", "1", "1", "2", "2"]
    assert r["responses"][:, 1].tolist() == [100, 100, 101, 101, 102, 102]
    with pytest.raises(BatchError, match="n must be an integer >= 1"):
        b.repeat_interleave(0)


# ---------------------------------------------------------------- split / concat
@pytest.mark.parametrize(
    ("rows", "parts", "sizes", "pads", "first_rows"),
    [
        # 10 rows in 4 parts: padded to 12 with rows 0 and 1 appended at the end
        (10, 4, [3, 3, 3, 3], [0, 0, 0, 2], [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 0, 1]]),
        # 1 row in 4 parts: three padding copies of row 0
        (1, 4, [1, 1, 1, 1], [0, 1, 1, 1], [[0], [0], [0], [0]]),
        # 8 rows in 4 parts: no padding
        (8, 4, [2, 2, 2, 2], [0, 0, 0, 0], [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (5, 1, [5], [0], [[0, 1, 2, 3, 4]]),
    ],
)
def test_split_pads_and_concat_drops_padding(rows, parts, sizes, pads, first_rows):
    b = make_batch(rows)
    split = b.split(parts)
    assert [len(p) for p in split] == sizes
    assert [p.pad_rows for p in split] == pads
    assert [p["scores"].long().tolist() for p in split] == first_rows
    assert [p["ground_truth"] for p in split] == [[str(i) for i in r] for r in first_rows]
    back = Batch.concat(split)
    assert len(back) == rows and back.pad_rows == 0
    assert torch.equal(back["responses"], b["responses"])
    assert back["ground_truth"] == b["ground_truth"]
    assert back.meta == b.meta


def test_resplitting_a_padded_part_keeps_track_of_padding():
    b = make_batch(5)
    left, right = b.split(2)  # rows [0,1,2] and [3,4,pad0]
    assert right.pad_rows == 1
    sub = right.split(2)  # [3,4] and [pad, pad]
    assert [p.pad_rows for p in sub] == [0, 2]
    back = Batch.concat([left, Batch.concat(sub)])
    assert back["scores"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_padding_scales_with_repeat_interleave():
    part = make_batch(10).split(4)[3]  # rows 9, pad, pad
    doubled = part.repeat_interleave(2)
    assert doubled.pad_rows == 4
    assert Batch.concat([doubled])["scores"].tolist() == [9.0, 9.0]


def test_split_rejects_empty_batch_and_bad_n():
    with pytest.raises(BatchError, match="cannot split an empty batch"):
        Batch.from_dict({"scores": torch.zeros(0)}).split(2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(BatchError, match="n must be an integer >= 1"):
            make_batch(4).split(bad)


def test_concat_errors_name_the_key():
    a, b = make_batch(2), make_batch(3)
    with pytest.raises(BatchError, match="empty list"):
        Batch.concat([])
    with pytest.raises(TypeError, match="item 1 is a dict"):
        Batch.concat([a, {}])
    c = make_batch(3)
    c["values"] = torch.zeros(3, 2)
    with pytest.raises(BatchError, match=r"tensor keys of part 1 differ from part 0 in \['values'\]"):
        Batch.concat([a, c])
    d = make_batch(3)
    d["responses"] = torch.zeros(3, 5, dtype=torch.long)
    with pytest.raises(BatchError, match=r"key 'responses' with shapes \[\[2, 2\], \[3, 5\]\]"):
        Batch.concat([a, d])
    joined = Batch.concat([a, b])
    assert joined["scores"].tolist() == [0.0, 1.0, 0.0, 1.0, 2.0]


# ---------------------------------------------------------------- union / to
def test_union_merges_and_checks_shared_keys():
    b = make_batch(3)
    extra = Batch.from_dict(
        {"values": torch.ones(3, 2), "scores": torch.arange(3.0)}, {"uid": ["a", "b", "c"]}
    )
    u = b.union(extra)
    assert u.keys() == ["responses", "scores", "values", "ground_truth", "uid"]
    assert "values" not in b  # inputs untouched
    clash = Batch.from_dict({"scores": torch.tensor([0.0, 1.0, 5.0])})
    with pytest.raises(BatchError, match="key 'scores' has different values"):
        b.union(clash)
    with pytest.raises(BatchError, match=r"key 'scores' differs: torch.float32\[3\] vs torch.int64\[3\]"):
        b.union(Batch.from_dict({"scores": torch.arange(3)}))
    with pytest.raises(BatchError, match="key 'ground_truth' has different values"):
        b.union(Batch.from_dict(non_tensors={"ground_truth": ["0", "1", "x"]}))
    with pytest.raises(BatchError, match="meta key 'temperature' differs"):
        b.union(Batch.from_dict({"values": torch.ones(3, 2)}, meta={"temperature": 0.5}))
    with pytest.raises(BatchError, match=r"batch sizes differ \(3 vs 2\)"):
        b.union(make_batch(2))


def test_to_moves_tensors():
    b = make_batch(2).to("meta")
    assert b["scores"].device.type == "meta"
    assert b["ground_truth"] == ["0", "1"]


# ---------------------------------------------------------------- pickling
def _assert_same(a: Batch, b: Batch) -> None:
    assert a.keys() == b.keys() and len(a) == len(b)
    for key in a.tensor_keys():
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key
    assert a.non_tensors == b.non_tensors and a.meta == b.meta and a.pad_rows == b.pad_rows


@pytest.mark.parametrize(
    "dumps,loads", [(pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)]
)
def test_pickle_roundtrip_all_dtypes(dumps, loads):
    b = Batch.from_dict(
        {
            "f32": torch.randn(4, 3),
            "bf16": torch.randn(4, 3).to(torch.bfloat16),
            "f16": torch.randn(4, 3).half(),
            "i64": torch.arange(4),
            "mask": torch.tensor([True, False, True, True]),
            "transposed": torch.randn(3, 4).t(),
        },
        {"extra_info": [{"i": i} for i in range(4)]},
        {"step": 7},
    ).split(3)[1]
    out = loads(dumps(b))
    _assert_same(b, out)
    out["f32"].add_(1.0)  # received tensors are writable


def test_pickle_out_of_band_buffers_are_copied_when_read_only():
    b = make_batch(4)
    buffers: list = []
    data = pickle.dumps(b, protocol=5, buffer_callback=buffers.append)
    assert buffers, "CPU tensors should travel out of band"
    read_only = [memoryview(bytes(buf.raw())) for buf in buffers]
    out = pickle.loads(data, buffers=read_only)
    _assert_same(b, out)
    out["scores"].mul_(2)
    assert out["scores"].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_pickling_a_slice_sends_only_its_rows():
    big = Batch.from_dict({"values": torch.zeros(1000, 256)})
    whole = len(pickle.dumps(big, protocol=5))
    part = len(pickle.dumps(big[:10], protocol=5))
    assert part < whole / 50
