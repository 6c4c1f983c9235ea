"""Token-balanced partitions (``verity.batch.balance``): every row once, the stated bound, order restored."""

from __future__ import annotations

import random

import pytest
import torch
from verity.batch import Batch
from verity.batch.balance import (
    balanced_order,
    fill_capacities,
    inverse_permutation,
    karmarkar_karp,
    pack_micro_batches,
    part_sums,
    split_row_counts,
)


def long_tailed(n: int, seed: int) -> list[int]:
    """Lengths with a median near 256 and a tail to ~4k (lognormal)."""
    rng = random.Random(seed)
    return [max(1, min(4096, int(rng.lognormvariate(5.55, 0.9)))) for _ in range(n)]


def assert_cover(parts: list[list[int]], rows: int) -> None:
    flat = sorted(i for part in parts for i in part)
    assert flat == list(range(rows))


@pytest.mark.parametrize("equal_size", [False, True])
@pytest.mark.parametrize(("rows", "k", "seed"), [(64, 2, 0), (96, 4, 1), (120, 8, 2), (8, 8, 3), (6, 3, 4)])
def test_karmarkar_karp_covers_and_balances(rows: int, k: int, seed: int, equal_size: bool) -> None:
    lengths = long_tailed(rows, seed)
    parts = karmarkar_karp(lengths, k, equal_size=equal_size)
    assert len(parts) == k
    assert_cover(parts, rows)
    sums = part_sums(lengths, parts)
    assert max(sums) - min(sums) <= max(lengths)  # the stated bound
    assert sums == sorted(sums, reverse=True)  # heaviest first
    if equal_size:
        assert {len(p) for p in parts} == {rows // k}


def test_karmarkar_karp_beats_consecutive_cut() -> None:
    lengths = sorted(long_tailed(256, 7))  # the worst case for a consecutive cut
    parts = karmarkar_karp(lengths, 2, equal_size=True)
    sums = part_sums(lengths, parts)
    cut = [sum(lengths[:128]), sum(lengths[128:])]
    assert max(sums) - min(sums) < (max(cut) - min(cut)) / 50


def test_edge_cases() -> None:
    assert karmarkar_karp([5, 3], 4) in ([[0], [1], [], []],)  # k > rows: empty parts, every row once
    assert karmarkar_karp([], 3) == [[], [], []]
    equal = karmarkar_karp([7] * 12, 3, equal_size=True)
    assert part_sums([7] * 12, equal) == [28, 28, 28]
    huge = [1] * 9 + [1000]
    parts = karmarkar_karp(huge, 2)
    assert sorted(part_sums(huge, parts)) == [9, 1000]  # one huge row: it alone on one part
    parts = karmarkar_karp(huge, 2, equal_size=True)
    assert sorted(part_sums(huge, parts)) == [5, 1004]
    with pytest.raises(ValueError, match="divide"):
        karmarkar_karp([1, 2, 3], 2, equal_size=True)
    with pytest.raises(ValueError, match="k must be"):
        karmarkar_karp([1], 0)
    with pytest.raises(ValueError, match=">= 0"):
        karmarkar_karp([1, -1], 2)


def test_fill_capacities() -> None:
    lengths = [10, 1, 9, 2, 8, 3, 7]
    parts = fill_capacities(lengths, [3, 3, 1])
    assert [len(p) for p in parts] == [3, 3, 1]
    assert_cover(parts, 7)
    with pytest.raises(ValueError, match="sum to the rows"):
        fill_capacities(lengths, [3, 3])


def test_split_row_counts_matches_batch_split() -> None:
    for rows in range(1, 12):
        for parts in range(1, 6):
            batch = Batch.from_dict({"x": torch.arange(rows)})
            real = [len(p) - p.pad_rows for p in batch.split(parts)]
            assert split_row_counts(rows, parts) == real


def mini_batch_members(rows: int, parts: int, mini_batch_rows: int) -> list[set[int]]:
    """Positions of each mini-batch as the update walks them (each rank its slices)."""
    size = -(-rows // parts)
    per_rank = max(1, mini_batch_rows // parts) if mini_batch_rows else size
    out: dict[int, set[int]] = {}
    for p in range(rows):
        out.setdefault((p % size) // per_rank, set()).add(p)
    return [out[k] for k in sorted(out)]


@pytest.mark.parametrize(
    ("rows", "parts", "mini"), [(64, 2, 16), (64, 2, 0), (96, 4, 32), (30, 4, 8), (7, 2, 0)]
)
def test_balanced_order_keeps_mini_batches_and_balances(rows: int, parts: int, mini: int) -> None:
    lengths = torch.tensor(sorted(long_tailed(rows, rows)))  # sorted: consecutive cut is worst
    order = balanced_order(lengths, parts, mini)
    assert sorted(order.tolist()) == list(range(rows))  # a permutation
    for members in mini_batch_members(rows, parts, mini):  # each row stays in its mini-batch
        assert {int(order[p]) for p in members} == members
    batch = Batch.from_dict({"tokens": lengths})
    shards = batch.index(order).split(parts)
    loads = [int(s["tokens"][: len(s) - s.pad_rows].sum()) for s in shards]
    before = [int(s["tokens"][: len(s) - s.pad_rows].sum()) for s in batch.split(parts)]
    assert max(loads) - min(loads) <= max(before) - min(before)
    if rows % parts == 0:
        n_minis = len(mini_batch_members(rows, parts, mini))
        assert max(loads) - min(loads) <= n_minis * int(lengths.max())
    # the inverse permutation restores the order of what comes back
    back = Batch.concat(shards).index(inverse_permutation(order))
    assert torch.equal(back["tokens"], lengths)


def test_balanced_order_two_ranks_long_tail_is_tight() -> None:
    lengths = torch.tensor(long_tailed(512, 11))
    order = balanced_order(lengths, 2)
    a, b = lengths[order[:256]].sum(), lengths[order[256:]].sum()
    assert abs(int(a) - int(b)) <= int(lengths.max())
    assert torch.equal(balanced_order(lengths, 1), torch.arange(512))


def test_pack_micro_batches_tokens_and_rows() -> None:
    lengths = [100, 5, 60, 40, 300, 10, 10, 10]
    batches = pack_micro_batches(lengths, 120, 3)
    assert_cover(batches, len(lengths))
    assert batches[0] == [4]  # over the budget on its own: a micro-batch of its own, first
    for mb in batches:
        assert len(mb) <= 3
        assert len(mb) == 1 or sum(lengths[i] for i in mb) <= 120
    assert pack_micro_batches(lengths, 0, 3) == [[0, 1, 2], [3, 4, 5], [6, 7]]  # no budget: in order


def test_pack_micro_batches_window_cost_and_groups() -> None:
    # four prompt groups of two rows: a group's rows stay together when the budget allows
    lengths = [10, 12, 30, 28, 11, 9, 31, 29]
    groups = [0, 0, 1, 1, 2, 2, 3, 3]
    spans = torch.tensor([[0, v] for v in lengths])
    batches = pack_micro_batches(lengths, 64, 8, spans=spans, groups=groups, cost="window")
    assert_cover(batches, 8)
    for mb in batches:
        assert len(mb) * (max(lengths[i] for i in mb)) <= 64
        assert len({groups[i] for i in mb}) * 2 == len(mb)  # whole groups only
    assert batches[0] == [6, 7]  # the longest group first
    with pytest.raises(ValueError, match="cost"):
        pack_micro_batches(lengths, 64, 8, cost="rows")  # type: ignore[arg-type]
