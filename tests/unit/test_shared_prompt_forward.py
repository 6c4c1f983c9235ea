"""The grouped layout of ``response_logprobs``: one sequence per prompt group, same values and gradients."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import tiny_qwen2, tiny_qwen2_config
from verity.engines import shared_prompt
from verity.engines.logprobs import padding_free_window, response_logprobs
from verity.engines.shared_prompt import build_grouped_inputs, find_prompt_groups, should_share_prompts

P, R = 10, 9


def _grouped_batch(groups: list[tuple[int, list[int]]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows in groups: ``(prompt length, [response length of each sample])``; each group's prompt is repeated."""
    g = torch.Generator().manual_seed(seed)
    prompt_rows, response_rows, prompt_masks, response_masks = [], [], [], []
    for prompt_len, response_lens in groups:
        mask = (torch.arange(P) >= P - prompt_len).long()
        prompt = torch.randint(1, 60, (P,), generator=g) * mask
        for response_len in response_lens:
            r_mask = (torch.arange(R) < response_len).long()
            prompt_rows.append(prompt)
            prompt_masks.append(mask)
            response_rows.append(torch.randint(1, 60, (R,), generator=g) * r_mask)
            response_masks.append(r_mask)
    prompts, responses = torch.stack(prompt_rows), torch.stack(response_rows)
    attention_mask = torch.cat([torch.stack(prompt_masks), torch.stack(response_masks)], 1)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": torch.stack(response_masks).float(),
    }


# groups of unequal size (a group split across micro-batches has fewer rows), unequal prompt
# lengths, early-ended and empty responses
GROUPS = [(4, [3, 1, 5, 2]), (7, [2, 2]), (2, [0, 4, 1, 3]), (5, [6])]


def _values_and_grads(model, batch, share: bool):
    model.zero_grad()
    lp, ent = response_logprobs(model, batch, temperature=0.7, share_prompts=share)
    mask = batch["response_mask"]
    ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


def test_groups_follow_the_rows_order_and_count_members():
    batch = _grouped_batch(GROUPS, seed=2)
    groups = find_prompt_groups(batch["input_ids"], batch["attention_mask"], P)
    assert groups.group.tolist() == [0, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3]
    assert groups.slot.tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 0]
    assert groups.first_row.tolist() == [0, 4, 6, 10]
    assert groups.members == 4


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_grouped_logprobs_entropy_and_gradients_equal_the_padded_ones(attn, monkeypatch):
    batch = _grouped_batch(GROUPS, seed=3)
    model = tiny_qwen2(seed=1)
    model.config._attn_implementation = attn
    used = []
    original = shared_prompt.grouped_response_logits
    monkeypatch.setattr(
        "verity.engines.logprobs.grouped_response_logits",
        lambda *a, **k: used.append(1) or original(*a, **k),
    )
    lp_g, ent_g, grads_g = _values_and_grads(model, batch, share=True)
    assert used, "the grouped layout was not used"
    lp_p, ent_p, grads_p = _values_and_grads(model, batch, share=False)
    assert len(used) == 1
    real = batch["attention_mask"][:, P:].bool()
    assert torch.allclose(lp_g[real], lp_p[real], atol=1e-5)
    assert torch.allclose(ent_g[real], ent_p[real], atol=1e-5)
    assert (lp_g[~real] == 0).all() and (ent_g[~real] == 0).all()
    assert torch.isfinite(lp_g).all()
    assert grads_g.keys() == grads_p.keys()
    for name in grads_p:
        assert torch.allclose(grads_g[name], grads_p[name], atol=1e-5), name


def test_a_sample_never_sees_another_sample_of_its_group():
    # changing sample 2's tokens must leave samples 1 and 3 of the same group unchanged
    batch = _grouped_batch([(4, [5, 5, 5])], seed=4)
    model = tiny_qwen2(seed=2)
    with torch.no_grad():
        before, _ = response_logprobs(model, batch)
        batch["input_ids"][1, P:] = (batch["input_ids"][1, P:] + 7) % 60 + 1
        batch["responses"][1] = batch["input_ids"][1, P:]
        after, _ = response_logprobs(model, batch)
    assert torch.equal(before[[0, 2]], after[[0, 2]])
    assert not torch.equal(before[1], after[1])


def test_the_mask_lets_samples_see_the_prompt_and_their_own_past_only():
    batch = _grouped_batch([(2, [2, 1])], seed=5)
    groups = find_prompt_groups(batch["input_ids"], batch["attention_mask"], P)
    first, kept = padding_free_window(batch["attention_mask"], R)
    assert (first, kept) == (P - 2, 2)
    inputs = build_grouped_inputs(batch, groups, first, kept, None)
    mask = inputs["attention_mask"][0, 0].int()
    # columns: prompt p0 p1 | sample 0: s0 s1 | sample 1: t0 (t1 is padding)
    assert mask.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 1, 1],  # a padding query sees itself and the real keys before it
    ]
    assert inputs["position_ids"][0].tolist() == [0, 1, 2, 3, 2, 2]  # the rows' own positions
    additive = build_grouped_inputs(batch, groups, first, kept, torch.float32)["attention_mask"]
    assert additive.dtype == torch.float32
    assert ((additive == 0) == inputs["attention_mask"]).all()


def test_the_padded_window_runs_when_grouping_saves_nothing_or_cannot_apply():
    distinct = _grouped_batch([(4, [3]), (5, [2]), (3, [4])], seed=6)
    model = tiny_qwen2(seed=1)
    groups = find_prompt_groups(distinct["input_ids"], distinct["attention_mask"], P)
    first, kept = padding_free_window(distinct["attention_mask"], R)
    assert not should_share_prompts(model, distinct, groups, first, kept)  # one row per prompt

    shared = _grouped_batch(GROUPS, seed=3)
    groups = find_prompt_groups(shared["input_ids"], shared["attention_mask"], P)
    first, kept = padding_free_window(shared["attention_mask"], R)
    assert should_share_prompts(model, shared, groups, first, kept)
    assert not should_share_prompts(model, {**shared, "pixel_values": [None]}, groups, first, kept)

    from transformers import Qwen2ForCausalLM

    flash = Qwen2ForCausalLM(tiny_qwen2_config())
    flash.config._attn_implementation = "flash_attention_2"  # takes no custom 4-D mask
    assert not should_share_prompts(flash, shared, groups, first, kept)


def test_grouped_critic_values_and_gradients_equal_the_padded_ones():
    from helpers.tiny_models import tiny_value_model
    from verity.engines.values import response_values

    batch = _grouped_batch(GROUPS, seed=7)
    model = tiny_value_model(seed=3)
    groups = find_prompt_groups(batch["input_ids"], batch["attention_mask"], P)
    assert should_share_prompts(model, batch, groups, *padding_free_window(batch["attention_mask"], R))
    results = []
    for share in (True, False):
        model.zero_grad()
        values = response_values(model, batch, share_prompts=share)
        (values * batch["response_mask"]).pow(2).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((values.detach(), grads))
    (v_g, g_g), (v_p, g_p) = results
    real = batch["attention_mask"][:, P:].bool()
    assert torch.allclose(v_g[real], v_p[real], atol=1e-5) and (v_g[~real] == 0).all()
    for name in g_p:
        assert torch.allclose(g_g[name], g_p[name], atol=1e-5), name
