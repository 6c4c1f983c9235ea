"""Loss aggregation: hand-computed modes, and the global-normalisation property.

Property: split the mini-batch's rows into micro-batches and/or data-parallel
shards, aggregate each part with the context of the WHOLE mini-batch, and sum
-> the loss (and gradient) of the whole mini-batch, for every mode.
"""

from __future__ import annotations

import pytest
import torch
from verity.algorithms import (
    AggregationContext,
    PolicyLossConfig,
    ValueLossConfig,
    aggregate_loss,
    entropy_bonus,
    get_policy_loss,
    kl_loss,
    value_loss,
)

MODES = ["token-sum", "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def tensor(rows):
    return torch.tensor(rows, dtype=torch.float32)


LOSS = tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
MASK = tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # third row fully masked


def test_context_from_mask_counts_non_empty_rows():
    ctx = AggregationContext.from_mask(MASK, max_response_len=4)
    assert (ctx.global_tokens, ctx.global_seqs, ctx.max_response_len) == (3.0, 2.0, 4)
    assert AggregationContext.from_mask(MASK).max_response_len == 3
    parts = AggregationContext.from_masks([MASK[:1], MASK[1:, :1]], max_response_len=4)
    assert parts == ctx


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-sum", 1 + 2 + 4),  # the plain sum over masked-in tokens
        ("token-mean", (1 + 2 + 4) / 3),  # 7 / 3 tokens
        ("seq-mean-token-sum", (3 + 4) / 2),  # row sums 3, 4 over 2 non-empty rows
        ("seq-mean-token-mean", (1.5 + 4) / 2),  # row means 1.5, 4
        ("seq-mean-token-sum-norm", 7 / (2 * 4)),  # total 7 over 2 rows x max length 4
    ],
)
def test_modes_hand_computed(mode, expected):
    ctx = AggregationContext.from_mask(MASK, max_response_len=4)
    assert aggregate_loss(LOSS, MASK, mode, ctx).item() == pytest.approx(expected)


def test_all_masked_minibatch_gives_zero_not_nan():
    ctx = AggregationContext.from_mask(torch.zeros(2, 3))
    for mode in MODES:
        assert aggregate_loss(LOSS[:2], torch.zeros(2, 3), mode, ctx).item() == 0.0


def random_batch(seed: int, batch: int = 8, length: int = 6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)).float()
    holes = (torch.rand(batch, length, generator=gen) < 0.2).float()  # observation tokens
    mask = mask * (1 - holes)
    mask[3] = 0.0  # a fully masked row
    return gen, mask


def partitions(batch: int):
    """Row partitions: micro-batches of 1, of 4, uneven sizes, 2 shards x micro-batches of 1 and of 4."""
    rows = list(range(batch))
    yield [rows[i : i + 1] for i in rows]
    yield [rows[i : i + 4] for i in range(0, batch, 4)]
    yield [rows[:1], rows[1:4], rows[4:]]
    shard0, shard1 = rows[0::2], rows[1::2]  # interleaved data-parallel shards
    yield [shard0[:2], shard0[2:], shard1[:2], shard1[2:]]
    yield [[r] for r in shard0] + [shard1]


def trimmed(mask_part: torch.Tensor) -> int:
    """Width of a micro-batch after trimming trailing all-padding columns (at least 1)."""
    used = (mask_part.sum(0) > 0).nonzero()
    return int(used.max().item()) + 1 if used.numel() else 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sum_over_parts_equals_whole_batch(mode, seed):
    gen, mask = random_batch(seed)
    loss_mat = torch.randn(mask.shape, generator=gen)
    ctx = AggregationContext.from_mask(mask, max_response_len=mask.shape[1])
    whole = aggregate_loss(loss_mat, mask, mode, ctx)
    for parts in partitions(mask.shape[0]):
        total = sum(aggregate_loss(loss_mat[rows], mask[rows], mode, ctx) for rows in parts)
        torch.testing.assert_close(total, whole)
        # micro-batches trimmed to their own padded width give the same sum too
        total = 0.0
        for rows in parts:
            width = trimmed(mask[rows])
            total = total + aggregate_loss(loss_mat[rows][:, :width], mask[rows][:, :width], mode, ctx)
        torch.testing.assert_close(total, whole)


def grads_of(fn, params):
    (grad,) = torch.autograd.grad(fn(), [params])
    return grad


LOSS_NAMES = ["ppo", "gspo", "gpg", "cispo"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", LOSS_NAMES)
def test_policy_loss_gradient_independent_of_split(name, mode):
    gen, mask = random_batch(7)
    old = -torch.rand(mask.shape, generator=gen)
    params = (old + 0.3 * torch.randn(mask.shape, generator=gen)).requires_grad_(True)
    adv = torch.randn(mask.shape, generator=gen)
    config = PolicyLossConfig(name=name, loss_agg_mode=mode, clip_ratio_c=3.0)
    ctx = AggregationContext.from_mask(mask)
    fn = get_policy_loss(name)

    def loss_over(parts):
        def total():
            return sum(
                fn(
                    logprobs=params[rows],
                    old_logprobs=old[rows],
                    advantages=adv[rows],
                    response_mask=mask[rows],
                    agg=ctx,
                    config=config,
                )[0]
                for rows in parts
            )

        return total

    whole_rows = [list(range(mask.shape[0]))]
    whole_loss = loss_over(whole_rows)()
    whole_grad = grads_of(loss_over(whole_rows), params)
    assert whole_grad.abs().sum() > 0
    for parts in partitions(mask.shape[0]):
        torch.testing.assert_close(loss_over(parts)(), whole_loss)
        torch.testing.assert_close(grads_of(loss_over(parts), params), whole_grad)


@pytest.mark.parametrize("mode", MODES)
def test_value_kl_and_entropy_terms_independent_of_split(mode):
    gen, mask = random_batch(11)
    params = torch.randn(mask.shape, generator=gen).requires_grad_(True)
    other = torch.randn(mask.shape, generator=gen)
    ctx = AggregationContext.from_mask(mask)

    def terms(rows):
        v, _ = value_loss(
            values=params[rows],
            old_values=other[rows],
            returns=other[rows] + 1.0,
            response_mask=mask[rows],
            agg=ctx,
            config=ValueLossConfig(cliprange_value=0.2, loss_agg_mode=mode),
        )
        k, _ = kl_loss(
            logprobs=-params[rows].abs(),
            ref_logprobs=-other[rows].abs(),
            response_mask=mask[rows],
            agg=ctx,
            kind="k3+",
            loss_agg_mode=mode,
        )
        e, _ = entropy_bonus(
            entropy=params[rows].exp(), response_mask=mask[rows], agg=ctx, loss_agg_mode=mode, coef=0.1
        )
        return v + k + e

    rows_all = list(range(mask.shape[0]))
    whole = terms(rows_all)
    (whole_grad,) = torch.autograd.grad(whole, [params])
    for parts in partitions(mask.shape[0]):
        total = sum(terms(rows) for rows in parts)
        torch.testing.assert_close(total, whole)
        (grad,) = torch.autograd.grad(total, [params])
        torch.testing.assert_close(grad, whole_grad)
