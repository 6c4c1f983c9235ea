"""The padding-free window of ``response_logprobs``: same values and gradients, fewer columns computed."""

from __future__ import annotations

import torch
from helpers.tiny_models import tiny_qwen2, tiny_value_model
from verity.engines.logprobs import padding_free_window, response_logprobs
from verity.engines.values import response_values

P, R = 10, 9


def _batch(prompt_lens: list[int], response_lens: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    """Left-padded prompts of the given lengths in P columns, right-padded responses in R columns."""
    g = torch.Generator().manual_seed(seed)
    rows = len(prompt_lens)
    p_len, r_len = torch.tensor(prompt_lens), torch.tensor(response_lens)
    prompt_mask = (torch.arange(P) >= P - p_len[:, None]).long()
    response_mask = (torch.arange(R) < r_len[:, None]).long()
    prompts = torch.randint(1, 60, (rows, P), generator=g) * prompt_mask
    responses = torch.randint(1, 60, (rows, R), generator=g) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        "responses": responses,
        "response_mask": response_mask.float(),
    }


def test_window_is_the_real_columns_of_the_micro_batch():
    mask = _batch([3, 5], [2, 4])["attention_mask"]
    # longest prompt 5 -> first real column 10 - 5 = 5; longest response 4
    assert padding_free_window(mask, R) == (5, 4)


def test_window_keeps_the_position_before_the_first_response_token_and_one_response_column():
    mask = _batch([1], [0])["attention_mask"]  # an empty response
    first, kept = padding_free_window(mask, R)
    assert first == P - 1 and kept == 1


def test_trimmed_logprobs_and_gradients_equal_the_full_width_ones():
    batch = _batch([3, 7, 2, 5], [1, 4, 2, 3], seed=3)
    mask = batch["response_mask"]
    model = tiny_qwen2(seed=1)
    results = []
    for trim in (True, False):
        model.zero_grad()
        lp, ent = response_logprobs(model, batch, temperature=0.7, trim_padding=trim)
        assert lp.shape == ent.shape == (4, R)
        ((lp * mask).sum() + 0.1 * (ent * mask).sum()).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((lp.detach(), ent.detach(), grads))
    (lp_t, ent_t, g_t), (lp_f, ent_f, g_f) = results
    real = mask.bool()
    assert torch.allclose(lp_t[real], lp_f[real], atol=1e-5)
    assert torch.allclose(ent_t[real], ent_f[real], atol=1e-5)
    # padding positions read 0 (columns past the longest response, 4, were not computed at all)
    assert torch.count_nonzero(lp_t[~real]) == 0 and torch.count_nonzero(ent_t[~real]) == 0
    assert g_t.keys() == g_f.keys()
    for name in g_t:
        assert torch.allclose(g_t[name], g_f[name], atol=1e-5), name


def test_a_full_width_micro_batch_is_computed_whole():
    batch = _batch([P, 2], [R, 1], seed=4)
    assert padding_free_window(batch["attention_mask"], R) == (0, R)


def test_trimmed_critic_values_and_gradients_equal_the_full_width_ones():
    batch = _batch([4, 8, 2], [3, 1, 2], seed=5)
    mask = batch["response_mask"]
    critic = tiny_value_model(seed=2)
    results = []
    for trim in (True, False):
        critic.zero_grad()
        values = response_values(critic, batch, trim_padding=trim)
        assert values.shape == (3, R)
        ((values * mask) ** 2).sum().backward()
        grads = {n: p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None}
        results.append((values.detach(), grads))
    (v_t, g_t), (v_f, g_f) = results
    real = mask.bool()
    assert torch.allclose(v_t[real], v_f[real], atol=1e-5)
    assert torch.count_nonzero(v_t[~real]) == 0
    for name in g_f:
        assert torch.allclose(g_t[name], g_f[name], atol=1e-5), name


def test_the_window_and_groups_are_planned_from_the_host_layout_when_given(monkeypatch):
    """The engines plan from host copies (no wait on the device); the values are the same."""
    import verity.engines.logprobs as logprobs_module

    model = tiny_qwen2()
    batch = _batch([3, 7, 7, 2], [4, 9, 1, 6])
    # rows 1 and 2 share a prompt: the group search runs too
    batch["input_ids"][2, :P] = batch["input_ids"][1, :P]
    layout = {"input_ids": batch["input_ids"].clone(), "attention_mask": batch["attention_mask"].clone()}
    seen = []
    real_window = logprobs_module.padding_free_window

    def spy(mask, response_len):
        seen.append(mask)
        return real_window(mask, response_len)

    monkeypatch.setattr(logprobs_module, "padding_free_window", spy)
    with torch.no_grad():
        want, _ = response_logprobs(model, batch)
        got, _ = response_logprobs(model, batch, layout=layout)
    assert seen[0] is batch["attention_mask"] and seen[1] is layout["attention_mask"]
    assert torch.equal(got, want)
