"""Packing batches for the wire (``verity.controller.wire``): smaller, and restored bit for bit."""

from __future__ import annotations

import torch
from verity.batch import Batch
from verity.controller.wire import (
    WIRE_META,
    pack,
    pack_batch,
    pack_tensor,
    unpack,
    unpack_batch,
    unpack_tensor,
)


def rl_batch(rows: int = 6, width: int = 5) -> Batch:
    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width).clone()
    advantages[2] = -0.0  # a signed zero must come back signed
    return Batch.from_dict(
        {
            "responses": torch.randint(0, 150_000, (rows, width), generator=g),  # needs int32
            "response_mask": (torch.rand(rows, width, generator=g) > 0.3).long(),  # fits int8
            "advantages": advantages,  # one number per row
            "old_logprobs": torch.randn(rows, width, generator=g),  # left as it is
            "big": torch.tensor([2**40, -(2**40), 0, 1, 2, 3, 4, 5])[:rows],  # needs int64
            "flags": torch.tensor([True, False] * 4)[:rows],
            "scores": torch.tensor([0.0, float("nan"), 1.0, 0.5, -0.0, 2.0, 3.0, 4.0])[:rows],
        },
        non_tensors={"uid": [f"u{i}" for i in range(rows)]},
        meta={"step": 3},
    )


def assert_identical(got: Batch, want: Batch) -> None:
    assert got.tensor_keys() == want.tensor_keys()
    for key in want.tensor_keys():
        a, b = got[key], want[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        if a.dtype.is_floating_point:
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), key  # bit for bit
        else:
            assert torch.equal(a, b), key
    assert got.non_tensors == want.non_tensors and got.meta == want.meta and got.pad_rows == want.pad_rows


def test_a_packed_batch_is_smaller_and_comes_back_bit_for_bit():
    batch = rl_batch()
    packed = pack_batch(batch)
    codes = packed.meta[WIRE_META]
    assert codes["advantages"] == (5, None) and packed["advantages"].shape == (6, 1)
    assert codes["response_mask"] == (None, "int64") and packed["response_mask"].dtype == torch.int8
    assert packed["responses"].dtype == torch.int32
    assert {"old_logprobs", "big", "flags", "scores"}.isdisjoint(codes)
    size = lambda b: sum(b[k].nbytes for k in b.tensor_keys())  # noqa: E731
    assert size(packed) < size(batch) / 2
    assert_identical(unpack_batch(packed), batch)


def test_split_shards_of_a_packed_batch_unpack_to_the_split_of_the_original():
    batch = rl_batch(rows=7)
    for got, want in zip(pack_batch(batch).split(2), batch.split(2), strict=True):
        assert_identical(unpack_batch(got), want)


def test_pack_reaches_into_call_arguments_and_leaves_the_rest():
    batch = rl_batch()
    args = (batch, 3, {"b": batch, "x": "text"}, [batch])
    packed = pack(args)
    assert WIRE_META in packed[0].meta and WIRE_META in packed[2]["b"].meta and WIRE_META in packed[3][0].meta
    assert packed[1] == 3 and packed[2]["x"] == "text"
    restored = unpack(packed)
    for got in (restored[0], restored[2]["b"], restored[3][0]):
        assert_identical(got, batch)
    # nothing to shrink: the same object goes out
    plain = Batch.from_dict({"x": torch.randn(4, 3)})
    assert pack_batch(plain) is plain and unpack_batch(plain) is plain


def test_tensors_that_cannot_shrink_are_sent_unchanged():
    for tensor in (torch.randn(4, 3), torch.tensor([True, False]), torch.zeros(0, 3, dtype=torch.long)):
        out, code = pack_tensor(tensor)
        assert code is None and out is tensor
    out, code = pack_tensor(torch.full((3, 4), 7, dtype=torch.int32))
    assert code == (4, "int32") and out.dtype == torch.int8 and out.shape == (3, 1)


def test_whole_number_scores_travel_as_small_integers_and_come_back_bit_for_bit():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        scores = torch.tensor([0.0, 1.0, 1.0, 0.0, -3.0, 100.0], dtype=dtype)
        out, code = pack_tensor(scores)
        assert code == (None, str(dtype).removeprefix("torch.")) and out.dtype == torch.int8
        back = unpack_tensor(out, code)
        assert back.dtype == dtype and torch.equal(back, scores)
    wide, code = pack_tensor(torch.tensor([0.0, 30_000.0]))
    assert wide.dtype == torch.int16 and code == (None, "float32")
    # what a small integer cannot say exactly goes as it is
    for values in ([0.0, 0.5], [1.0, -0.0], [1.0, float("nan")], [1.0, float("inf")], [0.0, 1e6]):
        tensor = torch.tensor(values)
        out, code = pack_tensor(tensor)
        assert code is None and out is tensor, values
    # a row-constant float column of whole numbers: one column, narrowed
    out, code = pack_tensor(torch.ones(3, 4))
    assert code == (4, "float32") and out.shape == (3, 1) and out.dtype == torch.int8
    assert torch.equal(unpack_tensor(out, code), torch.ones(3, 4))


def test_a_1d_tensor_of_one_repeated_element_travels_as_that_element() -> None:
    nan_with_payload = torch.tensor([0x7FC00123], dtype=torch.int32).view(torch.float32)
    for tensor in (
        torch.full((6,), float("nan")),  # an accuracy no row had
        nan_with_payload.expand(5).clone(),
        torch.full((4,), -0.0),
        torch.full((3,), 2**40),
        torch.zeros(7, dtype=torch.int8),
    ):
        out, code = pack_tensor(tensor)
        assert out.shape == (len(tensor), 0) and out.nbytes == 0
        assert code[0] is None and code[1].startswith(
            "fill:" + str(tensor.dtype).removeprefix("torch.") + ":"
        )
        back = unpack_tensor(out, code)
        assert back.dtype == tensor.dtype and back.shape == tensor.shape
        bits = {torch.float32: torch.int32}.get(tensor.dtype)
        assert torch.equal(back.view(bits), tensor.view(bits)) if bits else torch.equal(back, tensor)
    # two NaNs with different payloads are not one element
    mixed = torch.cat([torch.full((1,), float("nan")), nan_with_payload])
    assert pack_tensor(mixed)[1] is None
    assert pack_tensor(torch.ones(1))[1] == (None, "float32")  # one element: only narrowed
    # it splits with its batch: every shard restores its own rows
    batch = Batch.from_dict({"acc": torch.full((5,), float("nan")), "scores": torch.zeros(5)})
    for shard in pack_batch(batch).split(2):
        restored = unpack_batch(shard)
        assert torch.isnan(restored["acc"]).all() and torch.equal(restored["scores"], torch.zeros(len(shard)))


def test_an_advantage_times_a_response_mask_travels_as_a_value_and_a_length():
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 0, 7, 1, 5, 7])
    mask = (torch.arange(7)[None, :] < lengths[:, None]).float()
    advantage = torch.randn(6, generator=g)
    advantage[3] = -advantage[3].abs()  # a negative value times 0: -0.0 past its prefix
    advantage[4] = 0.0  # a zero-advantage row
    for dtype in (torch.float32, torch.float64):
        tensor = advantage.to(dtype)[:, None] * mask.to(dtype)
        batch = Batch.from_dict({"advantages": tensor, "other": torch.randn(6, 7, generator=g)})
        packed = pack_batch(batch)
        assert packed.meta[WIRE_META] == {"advantages": (7, f"prefix:{str(dtype).removeprefix('torch.')}")}
        assert packed["advantages"].shape == (6, 2)
        restored = unpack_batch(packed)["advantages"]
        bits = torch.int32 if dtype == torch.float32 else torch.int64
        assert restored.dtype == dtype and torch.equal(restored.view(bits), tensor.view(bits))
        for got, want in zip(pack_batch(batch).split(4), batch.split(4), strict=True):  # shards, as sent
            assert torch.equal(unpack_batch(got)["advantages"].view(bits), want["advantages"].view(bits))
    # a hole in the mask (a tool turn), or a second value in a row: sent as it is
    holed = advantage[:, None] * torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    second = advantage[:, None] * mask
    second[2, 4] += 1.0
    for tensor in (holed, second):
        out, code = pack_tensor(tensor)
        assert code is None and out is tensor


def test_right_and_left_padded_masks_travel_as_a_value_and_a_length():
    lengths = torch.tensor([3, 0, 7, 1, 5, 7])
    response_mask = (torch.arange(7)[None, :] < lengths[:, None]).long()  # right-padded responses
    attention_mask = response_mask.flip(1)  # left-padded prompts
    labels = 300 * response_mask.int()  # another value than 1: the pairs need int16
    batch = Batch.from_dict(
        {"response_mask": response_mask, "attention_mask": attention_mask, "labels": labels}
    )
    packed = pack_batch(batch)
    assert packed.meta[WIRE_META] == {
        "response_mask": (7, "prefix:int64"),
        "attention_mask": (7, "suffix:int64"),
        "labels": (7, "prefix:int32"),
    }
    assert packed["response_mask"].shape == (6, 2) and packed["response_mask"].dtype == torch.int8
    assert packed["labels"].dtype == torch.int16
    assert packed["attention_mask"][[0, 2, 3]].tolist() == [[1, 3], [1, 7], [1, 1]]  # (value, length)
    assert_identical(unpack_batch(packed), batch)
    for got, want in zip(pack_batch(batch).split(4), batch.split(4), strict=True):  # shards, as sent
        assert_identical(unpack_batch(got), want)
    # a hole (a tool turn's tokens), a mask open at both ends, or two columns: not as pairs
    holed = response_mask.clone()
    holed[2, 3] = 0
    both_ends = response_mask.clone()
    both_ends[1, 6] = 1
    for tensor in (holed, both_ends, response_mask[:, :2]):
        out, code = pack_tensor(tensor)
        assert code == (None, "int64") and out.shape == tensor.shape  # only narrowed
        assert torch.equal(unpack_batch(pack_batch(Batch.from_dict({"m": tensor})))["m"], tensor)


def test_position_ids_of_left_padded_prompts_travel_as_one_start_per_row():
    from verity.rollout.prompts import position_ids_from_mask

    lengths = torch.tensor([3, 0, 7, 1, 5, 7])
    attention_mask = (torch.arange(7)[None, :] >= 7 - lengths[:, None]).long()
    positions = position_ids_from_mask(attention_mask)
    shifted = torch.arange(7)[None, :] + torch.arange(6)[:, None]  # counts from 0..5: negative starts
    batch = Batch.from_dict({"position_ids": positions, "shifted": shifted})
    packed = pack_batch(batch)
    assert packed.meta[WIRE_META] == {"position_ids": (7, "ramp:int64"), "shifted": (7, "ramp:int64")}
    assert packed["position_ids"].shape == (6, 1) and packed["position_ids"].dtype == torch.int8
    assert_identical(unpack_batch(packed), batch)
    for got, want in zip(pack_batch(batch).split(4), batch.split(4), strict=True):  # shards, as sent
        assert_identical(unpack_batch(got), want)
    bent = positions.clone()
    bent[2, 3] += 1  # not a count any more
    out, code = pack_tensor(bent)
    assert code == (None, "int64") and out.shape == bent.shape


def test_rows_marked_as_repeats_go_once_when_exact_and_split_in_whole_runs():
    from verity.controller.wire import REPEATED_ROWS, ROW_REPEATS

    prompts = Batch.from_dict(
        {"input_ids": torch.arange(36).reshape(6, 6), "group": torch.arange(6)},
        non_tensors={"uid": [f"p{i}" for i in range(6)], "image": [torch.zeros(2)] * 6},
        meta={"seed": 5},
    )
    rows = prompts.repeat_interleave(4)
    rows.meta[REPEATED_ROWS] = 4
    want = prompts.repeat_interleave(4)  # what every receiver must see: the rows, without the mark
    packed = pack_batch(rows, parts=3)  # 6 prompts over 3 ranks: whole runs
    assert len(packed) == 6 and packed.meta[ROW_REPEATS] == 4 and REPEATED_ROWS not in packed.meta
    assert_identical(unpack_batch(packed), want)
    for got, part in zip(packed.split(3), want.split(3), strict=True):  # each rank's shard
        assert_identical(unpack_batch(got), part)
    # 6 prompts over 4 ranks would cut a run: the rows go as they are, the mark taken off
    whole = pack_batch(rows, parts=4)
    assert len(whole) == 24 and ROW_REPEATS not in whole.meta and REPEATED_ROWS not in whole.meta
    assert_identical(unpack_batch(whole), want)
    # rows that are not exact repeats (a tensor or a per-row value differs) go as they are
    for key in ("input_ids", "uid"):
        bent = prompts.repeat_interleave(4)
        if key == "uid":
            bent.non_tensors["uid"][5] = "other"
        else:
            bent["input_ids"][5, 0] = -1
        bent.meta[REPEATED_ROWS] = 4
        assert len(pack_batch(bent)) == 24 and ROW_REPEATS not in pack_batch(bent).meta
    # an unmarked batch is never compacted, however repetitive
    plain = prompts.repeat_interleave(4)
    assert len(pack_batch(plain)) == 24
