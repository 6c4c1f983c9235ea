"""Micro-batches cut by a token budget (``fsdp2.micro_batch_tokens``): the ranges and the exactness."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_padded_batch, seq_mean_token_mean_loss, tiny_qwen2
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.micro_batches import micro_batch_ranges
from verity.engines.options import FSDP2Options


def _mask(prompt_lens: list[int], response_lens: list[int], p: int = 4, r: int = 3) -> torch.Tensor:
    prompt = torch.stack([(torch.arange(p) >= p - n).long() for n in prompt_lens])
    response = torch.stack([(torch.arange(r) < n).long() for n in response_lens])
    return torch.cat([prompt, response], 1)


def test_without_a_budget_ranges_are_fixed_row_counts():
    mask = _mask([4] * 5, [3] * 5)
    assert micro_batch_ranges(mask, 3, 2) == [(0, 2), (2, 4), (4, 5)]
    assert micro_batch_ranges(mask, 3, 8) == [(0, 5)]


def test_a_budget_cuts_by_rows_times_window_width():
    # rows 0-1: window 4 prompt + 3 response = 7 columns; rows 2-3: 1 + 1 -> columns 3..4, width 2
    mask = _mask([4, 4, 1, 1], [3, 3, 1, 1])
    assert micro_batch_ranges(mask, 3, 8, max_tokens=14) == [(0, 2), (2, 4)]
    assert micro_batch_ranges(mask, 3, 8, max_tokens=13) == [(0, 1), (1, 2), (2, 4)]
    # a narrow row after wide ones is charged the wide window it joins
    assert micro_batch_ranges(mask, 3, 8, max_tokens=21) == [(0, 3), (3, 4)]
    # rows cap as well as tokens
    assert micro_batch_ranges(mask, 3, 1, max_tokens=1000) == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_a_row_wider_than_the_budget_gets_a_range_of_its_own():
    mask = _mask([4, 4], [3, 3])
    assert micro_batch_ranges(mask, 3, 8, max_tokens=2) == [(0, 1), (1, 2)]


def test_ranges_cover_every_row_in_order():
    batch = make_padded_batch(rows=23, seed=5)
    for tokens in (0, 1, 10, 25, 60, 10_000):
        ranges = micro_batch_ranges(batch["attention_mask"], batch["responses"].shape[1], 6, tokens)
        assert ranges[0][0] == 0 and ranges[-1][1] == 23
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
        assert all(0 < end - start <= 6 for start, end in ranges)


def test_bad_settings_are_rejected_with_the_key_name():
    mask = _mask([4], [3])
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batch_ranges(mask, 3, 0)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        micro_batch_ranges(mask, 3, 4, max_tokens=-1)
    with pytest.raises(ValueError, match="fsdp2.micro_batch_tokens"):
        FSDP2Options(micro_batch_tokens=-5).validate()
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), micro_batch_tokens=-1)


def test_config_key_reaches_validation():
    from verity.config import load_config

    with pytest.raises(ValueError, match="micro_batch_tokens"):
        load_config(["actor.fsdp2.micro_batch_tokens=-3"])
    assert load_config(["actor.fsdp2.micro_batch_tokens=2048"]).actor.fsdp2.micro_batch_tokens == 2048


def test_gradients_and_logprobs_equal_the_row_cut_ones():
    batch = make_padded_batch(rows=9, seed=3)
    torch.manual_seed(0)
    model = tiny_qwen2()
    rows_only = FSDP2Engine(model, OptimConfig(lr=1e-2))
    budget = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), micro_batch_tokens=20)
    budget.model.load_state_dict(rows_only.model.state_dict())
    width = batch["input_ids"].shape[1]
    ranges = micro_batch_ranges(batch["attention_mask"], batch["responses"].shape[1], 9, 20)
    assert len(ranges) > 2 and 9 * width > 20  # the budget really cuts

    lp_a, ent_a = rows_only.compute_logprobs(batch, micro_batch_size=9)
    lp_b, ent_b = budget.compute_logprobs(batch, micro_batch_size=9)
    torch.testing.assert_close(lp_b, lp_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=1e-5, atol=1e-5)

    out_a = rows_only.forward_backward(batch, seq_mean_token_mean_loss, 9)
    out_b = budget.forward_backward(batch, seq_mean_token_mean_loss, 9)
    assert out_b["loss"] == pytest.approx(out_a["loss"], rel=1e-5)
    grads_a, grads_b = rows_only.full_gradients(), budget.full_gradients()
    assert any(g.abs().max() > 1e-4 for g in grads_a.values())
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_step_moves_its_rows_once_and_plans_from_the_host():
    from verity.engines.micro_batches import host_layout, on_device, take_rows

    batch = {
        "input_ids": torch.arange(12).view(4, 3),
        "attention_mask": torch.ones(4, 3, dtype=torch.long),
        "advantages": torch.arange(4.0),
    }
    moved = on_device(batch, 3, torch.device("meta"))  # the first 3 rows (the rest are Batch.split padding)
    assert moved["input_ids"].device.type == "meta" and moved["input_ids"].shape == (3, 3)
    assert take_rows(moved, 1, 3, torch.device("meta"))["advantages"].shape == (2,)
    assert on_device(batch, 3, torch.device("cpu")) is batch  # nothing to move
    micro = take_rows(batch, 1, 3, torch.device("cpu"))
    assert torch.equal(micro["advantages"], torch.tensor([1.0, 2.0]))
    plan = host_layout(batch, 1, 3)
    assert set(plan) == {"input_ids", "attention_mask"}
    assert torch.equal(plan["input_ids"], batch["input_ids"][1:3])
    on_meta = {k: v.to("meta") for k, v in batch.items()}
    assert host_layout(on_meta, 0, 2) is None  # rows already on a device: nothing to plan from on the host
    with_images = {**batch, "pixel_values": [None] * 4, "image_grid_thw": [None] * 4}
    assert on_device(with_images, 4, torch.device("cpu")) is with_images  # pixels move per micro-batch
