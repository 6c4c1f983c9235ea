"""Resident rows (verity.batch.transport): handles on the driver, whole rows where a worker or the driver reads them."""

from __future__ import annotations

import pickle

import pytest
import torch
from verity.batch import Batch, BatchError, keep_resident, materialize, transport, validate
from verity.batch.transport import (
    DRIVER_TRANSFERS,
    RESIDENT,
    HandleRuns,
    handle_column_bytes,
    resident_row_tokens,
)


class FakeRef:
    """Stands in for a Ray ObjectRef: an id with ``hex()``."""

    def __init__(self, key: str) -> None:
        self.key = key

    def hex(self) -> str:
        return self.key


class FakeStore:
    def __init__(self) -> None:
        self.objects: dict[str, Batch] = {}
        self.fetches: list[list[str]] = []

    def put(self, obj: Batch) -> FakeRef:
        ref = FakeRef(f"obj{len(self.objects)}")
        self.objects[ref.key] = pickle.loads(pickle.dumps(obj))  # what the object store keeps is a copy
        return ref

    def get(self, refs: list[FakeRef]) -> list[Batch]:
        self.fetches.append([r.key for r in refs])
        return [self.objects[r.key] for r in refs]


def generated(rows: int, prompt_width: int, response_width: int = 3, seed: int = 0, pad: int = 0) -> Batch:
    """Rows as a rollout returns them: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, prompt_width + 1, (rows,), generator=g)
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - prompt_lens[:, None]).long()
    prompts = torch.where(prompt_mask.bool(), torch.randint(5, 50, (rows, prompt_width), generator=g), pad)
    response_lens = torch.randint(1, response_width + 1, (rows,), generator=g)
    response_mask = (torch.arange(response_width) < response_lens[:, None]).long()
    responses = torch.where(
        response_mask.bool(), torch.randint(5, 50, (rows, response_width), generator=g), pad
    )
    attention = torch.cat([prompt_mask, response_mask], 1)
    return Batch.from_dict(
        {
            "prompts": prompts,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention,
            "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
            "response_mask": response_mask,
            "rollout_logprobs": -torch.rand(rows, response_width, generator=g),
        },
        {"uid": [f"p{seed}-{i}" for i in range(rows)]},
        meta={"seed": seed},
    )


PROMPT_SIDE = ["prompts", "input_ids", "attention_mask", "position_ids"]


def assert_same(a: Batch, b: Batch) -> None:
    assert sorted(a.keys()) == sorted(b.keys())
    for key in a.tensor_keys():
        assert torch.equal(a[key], b[key]), key
    for key in a.non_tensor_keys():
        assert a[key] == b[key], key


def test_keep_resident_moves_the_prompt_side_only() -> None:
    store = FakeStore()
    rows = generated(6, 5)
    light = keep_resident(rows, pad_token_id=0, put=store.put)
    assert light.tensor_keys() == ["responses", "response_mask", "rollout_logprobs"]
    assert light.resident_keys() == PROMPT_SIDE
    listed = light.keys()  # a Batch is not iterable: keys() is how its keys are listed
    assert RESIDENT not in listed and RESIDENT not in light
    for key in PROMPT_SIDE:
        assert key in light
    assert light.meta == {"seed": 0} and light["uid"] == rows["uid"]
    assert torch.equal(resident_row_tokens(light), rows["attention_mask"].sum(-1))
    validate(light)  # resident keys are checked where they are materialized
    assert "resident=[prompts, input_ids, attention_mask, position_ids]" in repr(light)


def test_materialize_gives_back_the_rows_in_any_order_after_split_and_concat() -> None:
    store = FakeStore()
    rows = generated(7, 4)
    light = keep_resident(rows, pad_token_id=0, put=store.put)
    order = torch.tensor([6, 0, 3, 3, 1])
    assert_same(materialize(light.index(order), fetch=store.get), rows.index(order))
    parts = light.split(3)  # pads the last part by repeating rows
    joined = Batch.concat([pickle.loads(pickle.dumps(p)) for p in parts])  # as after a trip through workers
    assert_same(materialize(joined, fetch=store.get), rows)
    store.fetches.clear()
    materialize(light.repeat_interleave(2), fetch=store.get)
    # each key's object fetched once, however many rows point at it
    assert store.fetches == [["obj0"], ["obj1"], ["obj2"], ["obj3"]]
    store.fetches.clear()
    materialize(light.select("attention_mask"), fetch=store.get)
    assert store.fetches == [["obj2"]]  # a key alone is fetched alone


def test_select_restricts_the_handles_to_the_keys_asked_for() -> None:
    store = FakeStore()
    light = keep_resident(generated(4, 3), pad_token_id=0, put=store.put)
    picked = light.select("input_ids", "attention_mask", "responses")
    assert picked.resident_keys() == ["input_ids", "attention_mask"]
    full = materialize(picked, fetch=store.get)
    assert sorted(full.keys()) == ["attention_mask", "input_ids", "responses"]
    assert RESIDENT not in light.select("responses", "uid").non_tensors


def test_rows_of_differently_wide_prompt_batches_are_left_padded_to_the_widest() -> None:
    store = FakeStore()
    narrow, wide = generated(3, 2, seed=1, pad=9), generated(2, 5, seed=2, pad=9)
    joined = Batch.concat(
        [
            keep_resident(narrow, pad_token_id=9, put=store.put),
            keep_resident(wide, pad_token_id=9, put=store.put),
        ]
    )
    full = materialize(joined, fetch=store.get)
    assert full["input_ids"].shape == (5, 8) and full["prompts"].shape == (5, 5)
    assert torch.equal(full["input_ids"][:3, :3], torch.full((3, 3), 9))  # token ids padded with pad_token_id
    assert torch.equal(full["input_ids"][:3, 3:], narrow["input_ids"])
    assert torch.equal(full["attention_mask"][:3, :3], torch.zeros(3, 3, dtype=torch.long))
    # position ids stay cumsum(attention_mask) - 1 clipped at 0
    assert torch.equal(full["position_ids"], (full["attention_mask"].cumsum(-1) - 1).clamp(min=0))
    assert torch.equal(full["input_ids"][3:], wide["input_ids"])


def test_a_key_is_never_both_resident_and_local() -> None:
    store = FakeStore()
    light = keep_resident(generated(4, 3), pad_token_id=0, put=store.put)
    assert "position_ids" in light.resident_keys()  # asked once: the batch remembers the answer for its column
    light["position_ids"] = torch.zeros(4, 6, dtype=torch.long)  # the driver's value wins
    assert "position_ids" not in light.resident_keys()
    assert torch.equal(
        materialize(light, fetch=store.get)["position_ids"], torch.zeros(4, 6, dtype=torch.long)
    )
    other = Batch.from_dict({"input_ids": torch.zeros(4, 6, dtype=torch.long)})
    with pytest.raises(BatchError, match="resident in one batch and local in the other"):
        light.union(other)
    with pytest.raises(BatchError, match="handles"):
        light[RESIDENT] = [None] * 4


def test_without_ray_or_prompt_side_keys_nothing_moves() -> None:
    rows = generated(3, 2)
    assert keep_resident(rows, pad_token_id=0) is rows  # no Ray in this process
    scores = Batch.from_dict({"scores": torch.ones(3)})
    assert keep_resident(scores, pad_token_id=0, put=FakeStore().put) is scores
    assert materialize(scores) is scores


def test_generate_answers_rows_in_host_memory(monkeypatch) -> None:
    """A rollout on an accelerator returns device tensors; what a worker answers is on the CPU."""
    from types import SimpleNamespace

    from verity.workers import rollout_side

    moved_to = []
    real_to = Batch.to

    def spy_to(self, device, non_blocking=False):
        moved_to.append(str(device))
        return real_to(self, device, non_blocking)

    monkeypatch.setattr(Batch, "to", spy_to)
    monkeypatch.setattr(rollout_side, "keep_resident", lambda rows, pad, also: ("resident", rows))
    monkeypatch.setattr(rollout_side, "resident_response_keys", lambda cfg: ())
    rows = Batch.from_dict({"responses": torch.ones(2, 3, dtype=torch.long)})
    out = rollout_side.rows_for_driver(SimpleNamespace(), rows, pad_token_id=0)
    assert moved_to == ["cpu"]
    assert out[1]["responses"].device.type == "cpu"


def test_rollout_logprobs_stay_unless_they_are_the_old_logprobs() -> None:
    from verity.config import load_config
    from verity.workers.rollout_side import resident_response_keys

    driver = "reward.placement=driver"
    assert resident_response_keys(load_config([driver])) == ("rollout_logprobs",)
    assert resident_response_keys(load_config([driver, "actor.off_policy.is_cap=2.0", "trainer.mode=async"])) == (
        "rollout_logprobs",
    )
    assert resident_response_keys(load_config([driver, "actor.old_logprobs=rollout"])) == ()


def test_response_ids_stay_when_the_workers_score_them() -> None:
    from verity.config import load_config
    from verity.workers.rollout_side import resident_response_keys

    assert resident_response_keys(load_config(["reward.placement=workers"])) == (
        "rollout_logprobs",
        "responses",
        "response_attention",
    )
    assert resident_response_keys(load_config(["reward.placement=driver"])) == ("rollout_logprobs",)


def test_response_side_keys_kept_with_the_rows_are_not_padded_when_prompt_widths_differ() -> None:
    store: dict[int, Batch] = {}

    def put(value: Batch) -> int:
        store[len(store)] = value
        return len(store) - 1

    def fetch(refs: list[int]) -> list[Batch]:
        return [store[r] for r in refs]

    def rows(prompt_width: int, seed: int) -> Batch:
        g = torch.Generator().manual_seed(seed)
        prompts = torch.randint(3, 9, (2, prompt_width), generator=g)
        responses = torch.randint(3, 9, (2, 4), generator=g)
        return Batch.from_dict(
            {
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], 1),
                "attention_mask": torch.ones(2, prompt_width + 4, dtype=torch.long),
                "rollout_logprobs": -torch.rand(2, 4, generator=g),
            }
        )

    narrow, wide = rows(3, 0), rows(5, 1)
    kept = [keep_resident(b, 0, put, also=("rollout_logprobs", "not_there")) for b in (narrow, wide)]
    assert "rollout_logprobs" in kept[0].resident_keys() and "responses" in kept[0].tensor_keys()
    joined = materialize(Batch.concat(kept), fetch)
    assert torch.equal(
        joined["rollout_logprobs"], torch.cat([narrow["rollout_logprobs"], wide["rollout_logprobs"]])
    )
    assert joined["prompts"].shape == (4, 5) and joined["input_ids"].shape == (4, 9)  # the prompt side padded


def test_a_handle_column_travels_as_runs_of_rows_and_comes_back_row_for_row() -> None:
    store = FakeStore()
    a = keep_resident(generated(6, 5), pad_token_id=0, put=store.put)
    b = keep_resident(generated(4, 5, seed=1), pad_token_id=0, put=store.put)
    joined = Batch.concat([a, b])
    runs = HandleRuns(joined.non_tensors[RESIDENT]).runs
    assert [(first, count) for _, first, count in runs] == [(0, 6), (0, 4)]
    picked = joined.index(torch.tensor([0, 1, 2, 7, 3, 8, 9]))  # out of order: more runs, same rows
    assert [(f, c) for _, f, c in HandleRuns(picked.non_tensors[RESIDENT]).runs] == [
        (0, 3),
        (1, 1),
        (3, 1),
        (2, 2),
    ]
    for batch in (joined, picked):
        back = pickle.loads(pickle.dumps(batch))
        assert [(s.block_id, i) for s, i in back.non_tensors[RESIDENT]] == [
            (s.block_id, i) for s, i in batch.non_tensors[RESIDENT]
        ]
        assert back.resident_keys() == batch.resident_keys()
        assert_same(materialize(back, fetch=store.get), materialize(batch, fetch=store.get))
    # counted as its runs: far below a tuple a row
    assert handle_column_bytes(joined.non_tensors[RESIDENT]) < len(pickle.dumps(joined.non_tensors[RESIDENT]))


def test_reading_a_resident_key_on_the_driver_fetches_it_once_and_counts_it(monkeypatch) -> None:
    store = FakeStore()
    monkeypatch.setattr(transport, "_ray_get", store.get)
    narrow, wide = generated(3, 2, seed=1, pad=9), generated(2, 5, seed=2, pad=9)
    joined = Batch.concat([keep_resident(b, pad_token_id=9, put=store.put) for b in (narrow, wide)])
    picked = joined.index(torch.tensor([4, 0, 2]))
    whole = materialize(picked, fetch=store.get)
    store.fetches.clear()
    DRIVER_TRANSFERS.take()
    value = picked["input_ids"]  # a plug-in or stage just reads the key
    assert torch.equal(value, whole["input_ids"])  # padded to the widest prompt, rows in order
    assert store.fetches == [["obj5", "obj1"]]  # the key's object of each source, once
    _, received = DRIVER_TRANSFERS.take()
    assert received == narrow["input_ids"].nbytes + wide["input_ids"].nbytes  # what crossed: whole objects
    assert "input_ids" in picked.tensor_keys() and "input_ids" not in picked.resident_keys()
    # kept: read again, not fetched again
    assert picked["input_ids"] is value and store.fetches == [["obj5", "obj1"]]
    assert picked.resident_keys() == ["prompts", "attention_mask", "position_ids"]
    assert torch.equal(picked.pop("prompts"), whole["prompts"]) and "prompts" not in picked
    assert_same(materialize(picked, fetch=store.get), whole.select(*picked.keys()))


def test_concat_reads_a_key_that_other_parts_already_hold(monkeypatch) -> None:
    store = FakeStore()
    monkeypatch.setattr(transport, "_ray_get", store.get)
    rows = [generated(3, 4, seed=s) for s in (1, 2)]
    parts = [keep_resident(b, pad_token_id=0, put=store.put) for b in rows]
    parts[0]["prompts"]  # noqa: B018 - a stage read it in one round only
    joined = Batch.concat(parts)
    assert "prompts" in joined.tensor_keys() and "prompts" not in joined.resident_keys()
    assert torch.equal(joined["prompts"], torch.cat([b["prompts"] for b in rows]))
    assert_same(materialize(joined, fetch=store.get), Batch.concat(rows))
