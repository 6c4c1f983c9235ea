"""Micro-batches by tokens, longest first (``verity.engines.micro_batch_groups``): budgets, prompt groups,
answers back in order, gradients unchanged."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_grouped_batch, make_padded_batch, seq_mean_token_mean_loss, tiny_qwen2
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.logprobs import padding_free_window
from verity.engines.micro_batch_groups import micro_batch_groups, restore_index, row_spans
from verity.engines.shared_prompt import find_prompt_groups, grouped_positions


def grpo_rows(prompts: int, n: int, prompt_len: int, response_len: int, seed: int) -> dict[str, torch.Tensor]:
    """``prompts`` x ``n`` rows: each prompt's samples next to each other, long-tailed response lengths."""
    g = torch.Generator().manual_seed(seed)
    p_lens = torch.randint(prompt_len // 2, prompt_len + 1, (prompts,), generator=g).repeat_interleave(n)
    r_lens = (torch.empty(prompts * n).log_normal_(2.0, 0.8, generator=g).long() + 1).clamp(max=response_len)
    prompt_ids = torch.randint(1, 90, (prompts, prompt_len), generator=g).repeat_interleave(n, 0)
    p_mask = (torch.arange(prompt_len) >= prompt_len - p_lens[:, None]).long()
    r_mask = (torch.arange(response_len) < r_lens[:, None]).long()
    responses = torch.randint(1, 90, (prompts * n, response_len), generator=g) * r_mask
    return {
        "input_ids": torch.cat([prompt_ids * p_mask, responses], 1),
        "attention_mask": torch.cat([p_mask, r_mask], 1),
        "responses": responses,
    }


def positions(batch: dict[str, torch.Tensor], groups: list[torch.Tensor]) -> int:
    """Positions the model computes over the micro-batches: each one's padded window, or its shared-prompt
    layout where that saves at least 10% (as ``engines.logprobs`` decides)."""
    response_len = batch["responses"].shape[1]
    prompt_len = batch["input_ids"].shape[1] - response_len
    total = 0
    for rows in groups:
        mask, ids = batch["attention_mask"][rows], batch["input_ids"][rows]
        first, kept = padding_free_window(mask, response_len)
        padded = len(rows) * (prompt_len - first + kept)
        shared = grouped_positions(find_prompt_groups(ids, mask, prompt_len), prompt_len - first, kept)
        total += shared if shared <= 0.9 * padded else padded
    return total


def window_cost(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> int:
    spans = row_spans(batch["attention_mask"][rows], batch["responses"].shape[1])
    return len(rows) * int(spans[:, 1].max() - spans[:, 0].min())


def test_no_budget_is_consecutive_rows() -> None:
    batch = make_padded_batch(rows=7)
    groups = micro_batch_groups(batch, 7, 3)
    assert [g.tolist() for g in groups] == [[0, 1, 2], [3, 4, 5], [6]]
    assert restore_index(groups) is None


@pytest.mark.parametrize("cost", ["window", "tokens"])
def test_budget_cover_and_cost(cost: str) -> None:
    batch = grpo_rows(8, 4, 12, 40, seed=2)
    budget = 52 + 40
    groups = micro_batch_groups(batch, 32, 6, budget, cost=cost)
    assert sorted(torch.cat(groups).tolist()) == list(range(32))
    for rows in groups:
        assert len(rows) <= 6
        used = window_cost(batch, rows) if cost == "window" else int(batch["attention_mask"][rows].sum())
        assert len(rows) == 1 or used <= budget
    restore = restore_index(groups)
    assert restore is not None and torch.equal(torch.cat(groups)[restore], torch.arange(32))
    # only the first rows are covered (the rest: Batch.split padding)
    assert sorted(torch.cat(micro_batch_groups(batch, 30, 6, budget, cost=cost)).tolist()) == list(range(30))


def test_prompt_groups_stay_together_and_keep_the_shared_prompt_saving() -> None:
    """Longest first by prompt group computes fewer positions (shared prompts counted) than the consecutive
    cut and than rows sorted one by one (which scatters a prompt's samples over micro-batches), summed
    over three batches and two budgets (33,623 / 36,041 / 40,947 positions when written)."""
    from verity.batch.balance import pack_micro_batches
    from verity.engines.micro_batches import micro_batch_ranges

    totals = {"grouped": 0, "consecutive": 0, "rows": 0}
    for seed in (5, 6, 7):
        batch = grpo_rows(16, 8, 48, 64, seed=seed)
        spans, lengths = row_spans(batch["attention_mask"], 64), batch["attention_mask"].sum(-1)
        for budget in (896, 1792):
            by_group = micro_batch_groups(batch, 128, 64, budget)
            ids = batch["input_ids"][:, :48]
            for micro in by_group:  # a prompt's rows are cut only at a micro-batch's two ends
                prompts = {tuple(r.tolist()) for r in ids[micro]}
                assert len(micro) >= 8 * (len(prompts) - 2)
            ranges = micro_batch_ranges(batch["attention_mask"], 64, 64, budget)
            one_by_one = pack_micro_batches(lengths, budget, 64, spans=spans, cost="window")
            totals["grouped"] += positions(batch, by_group)
            totals["consecutive"] += positions(batch, [torch.arange(s, e) for s, e in ranges])
            totals["rows"] += positions(batch, [torch.tensor(g) for g in one_by_one])
    assert totals["grouped"] < totals["consecutive"] < totals["rows"]


def test_logprobs_and_gradients_equal_the_row_cut_ones_with_non_consecutive_micro_batches() -> None:
    batch = make_grouped_batch(rows=8, group=2, seed=4)
    batch["response_mask"][3, :] = 1.0  # one long row
    batch["attention_mask"][3, -batch["responses"].shape[1] :] = 1
    rows_only = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2))
    budget = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-2), micro_batch_tokens=22)
    budget.model.load_state_dict(rows_only.model.state_dict())
    groups = micro_batch_groups(batch, 8, 8, 22)
    assert restore_index(groups) is not None and len(groups) > 1  # really reordered and cut

    lp_a, ent_a = rows_only.compute_logprobs(batch, micro_batch_size=8)
    lp_b, ent_b = budget.compute_logprobs(batch, micro_batch_size=8)
    torch.testing.assert_close(lp_b, lp_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_b, ent_a, rtol=1e-5, atol=1e-5)
    out_a = rows_only.forward_backward(batch, seq_mean_token_mean_loss, 8)
    out_b = budget.forward_backward(batch, seq_mean_token_mean_loss, 8)
    assert out_b["loss"] == pytest.approx(out_a["loss"], rel=1e-5)
    grads_a, grads_b = rows_only.full_gradients(), budget.full_gradients()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)
