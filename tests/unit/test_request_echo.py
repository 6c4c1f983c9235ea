"""Answers that extend their request (``verity.controller.request_echo``): what the method left as it
arrived stays on the driver, what it added or changed comes back, and the driver's batch is whole."""

from __future__ import annotations

import pickle

import pytest
import torch
from verity.batch import Batch
from verity.controller.request_echo import (
    FROM_REQUEST,
    HELD_ON_DRIVER,
    RequestSnapshot,
    drop_request_echo,
    restore_request_echo,
    with_held_columns,
    without_held_columns,
)


def request(rows: int = 4) -> Batch:
    return Batch.from_dict(
        {
            "input_ids": torch.arange(rows * 3).reshape(rows, 3),
            "scores": torch.tensor([0.0, 1.0, 2.0, 3.0])[:rows],
        },
        {"uid": [f"u{i}" for i in range(rows)], "extra_info": [{"i": i} for i in range(rows)]},
        {"seed": 7},
    )


def travel(batch: Batch) -> Batch:
    return pickle.loads(pickle.dumps(batch))


def assert_same(a: Batch, b: Batch) -> None:
    assert a.tensor_keys() == b.tensor_keys() and list(a.non_tensors) == list(b.non_tensors)
    for key in a.tensor_keys():
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    assert a.non_tensors == b.non_tensors and a.meta == b.meta and a.pad_rows == b.pad_rows


def round_trip(sent: Batch, method) -> tuple[Batch, Batch, Batch]:
    """(what the method answered, what travelled back, what the driver rebuilt)."""
    arrived = travel(sent)
    snapshot = RequestSnapshot.take(arrived)
    answer = method(arrived)
    light = travel(drop_request_echo(snapshot, answer))
    return answer, light, restore_request_echo(light, sent)


def test_unchanged_request_keys_stay_and_the_driver_rebuilds_the_whole_answer() -> None:
    def generate(batch: Batch) -> Batch:
        batch["responses"] = torch.ones(len(batch), 2, dtype=torch.long)
        batch.non_tensors["trajectory"] = [{"turns": 1}] * len(batch)
        return batch

    answer, light, rebuilt = round_trip(request(), generate)
    assert light.tensor_keys() == ["responses"] and list(light.non_tensors) == ["trajectory"]
    assert light.meta[FROM_REQUEST][2] == ("input_ids", "scores", "uid", "extra_info")
    assert_same(rebuilt, answer)


def test_what_the_method_changed_comes_back_even_in_place() -> None:
    def touch(batch: Batch) -> Batch:
        batch["scores"].add_(0.0)  # an in-place write that changes no value still bumps the version
        batch["input_ids"] = batch["input_ids"] + 1
        batch.non_tensors["extra_info"][0]["i"] = 99  # a dict inside a list, edited in place
        return batch

    answer, light, rebuilt = round_trip(request(), touch)
    assert set(light.tensor_keys()) == {"scores", "input_ids"} and list(light.non_tensors) == ["extra_info"]
    assert_same(rebuilt, answer)
    assert rebuilt.non_tensors["extra_info"][0] == {"i": 99}


def test_a_signed_zero_is_a_change() -> None:
    sent = request()
    sent["scores"] = torch.zeros(4)

    def flip(batch: Batch) -> Batch:
        batch["scores"] = -batch["scores"]  # -0.0 == 0.0, but not bit for bit
        return batch

    answer, light, rebuilt = round_trip(sent, flip)
    assert "scores" in light.tensor_keys()
    assert torch.signbit(rebuilt["scores"]).all()


def test_per_row_images_stay_unless_one_of_them_changed() -> None:
    def images() -> Batch:
        sent = request()
        sent.non_tensors["pixel_values"] = [torch.full((2, 3), float(i)) for i in range(4)]
        return sent

    def same_images(a: list, b: list) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    sent = images()
    answer, light, rebuilt = round_trip(sent, lambda batch: batch)
    assert "pixel_values" not in light.non_tensors and "uid" not in light.non_tensors
    assert same_images(rebuilt.non_tensors["pixel_values"], sent.non_tensors["pixel_values"])

    def edit_one_in_place(batch: Batch) -> Batch:
        batch.non_tensors["pixel_values"][2].mul_(1.0)  # same values, written in place: a change
        return batch

    def replace_one(batch: Batch) -> Batch:
        batch.non_tensors["pixel_values"] = [*batch.non_tensors["pixel_values"][:3], torch.ones(2, 3)]
        return batch

    for method in (edit_one_in_place, replace_one):
        answer, light, rebuilt = round_trip(images(), method)
        assert "pixel_values" in light.non_tensors, method.__name__
        assert same_images(rebuilt.non_tensors["pixel_values"], answer.non_tensors["pixel_values"])


def test_answers_of_another_length_and_other_values_travel_whole() -> None:
    snapshot = RequestSnapshot.take(request())
    twice = request().repeat_interleave(2)
    assert drop_request_echo(snapshot, twice) is twice
    assert drop_request_echo(snapshot, {"loss": 1.0}) == {"loss": 1.0}
    plain = request()
    assert restore_request_echo(plain, request()) is plain  # nothing was dropped: as it is


def test_a_shard_of_another_length_is_refused() -> None:
    _, light, _ = round_trip(request(), lambda batch: batch)
    with pytest.raises(RuntimeError, match="has 4 rows, its request shard 3"):
        restore_request_echo(light, request(3))


def test_held_columns_do_not_go_out_and_come_back_from_the_driver_in_order():
    full = request()
    full.meta[HELD_ON_DRIVER] = ("extra_info", "scores", "absent")
    sent = without_held_columns(full)
    assert sent.keys() == ["input_ids", "uid"] and HELD_ON_DRIVER not in sent.meta
    assert HELD_ON_DRIVER in full.meta and "extra_info" in full  # the driver's batch is untouched
    arrived = travel(sent)
    arrived["responses"] = torch.ones(4, 2, dtype=torch.long)  # what the method adds
    answer = with_held_columns(travel(arrived), full)
    assert answer.keys() == ["input_ids", "responses", "scores", "uid", "extra_info"]
    assert torch.equal(answer["scores"], full["scores"]) and answer["extra_info"] == full["extra_info"]
    # a request that holds nothing back goes as it is, and its answer is left alone
    plain = request()
    assert without_held_columns(plain) is plain and with_held_columns(arrived, plain) is arrived


def test_held_columns_that_cannot_be_put_back_are_named():
    full = request()
    full.meta[HELD_ON_DRIVER] = ("uid",)
    with pytest.raises(RuntimeError, match=r"3 rows, its request shard 4.*held on the driver \(uid\)"):
        with_held_columns(without_held_columns(full).index(slice(0, 3)), full)
    clashing = without_held_columns(full)
    clashing.non_tensors["uid"] = ["mine"] * 4  # a method may not invent a key it was not sent
    with pytest.raises(RuntimeError, match=r"key\(s\) \['uid'\] that its request held on the driver"):
        with_held_columns(clashing, full)
