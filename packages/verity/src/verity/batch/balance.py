"""Token-balanced batches: rows partitioned so that every rank and every micro-batch carries about
the same number of tokens.

Long reasoning traces have long-tailed lengths: most rows are short, a few are very long. Cut
in order, one data-parallel rank gets the long rows and sets every step's time. This module
holds the pure arithmetic on row lengths (``[B]`` token counts, ints); nothing here touches a
model or a process group.

* :func:`karmarkar_karp` — the largest-differencing partition of row lengths into ``k`` parts
  of about equal token sums, optionally with the same row count per part. Bound: the heaviest
  part exceeds the lightest by at most the longest row (each merge pairs the heaviest part of
  one partial partition with the lightest of the other, so the spread never grows past the
  larger of the two merged spreads, and it starts at most one row long).
* :func:`fill_capacities` — longest-first into parts with given row counts (the padded case,
  where ``Batch.split`` leaves the last ranks fewer real rows).
* :func:`balanced_order` — the row order that makes ``Batch.split(parts)`` hand every
  data-parallel rank about the same tokens, keeping each row in the mini-batch it belongs to
  today, so an update's optimizer steps see exactly the same rows.
* :func:`pack_micro_batches` — rows into micro-batches longest-first under a token budget
  and a row cap, the rows of one prompt group kept together where the budget allows.
* :func:`inverse_permutation` — the order back.

A group call carries a :class:`BalanceRequest` in ``batch.meta[BALANCE_META]``; the dispatch
(:mod:`verity.controller.dispatch`) reorders the rows before it splits them and restores the
order of what comes back.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "BALANCE_META",
    "MICRO_BATCH_COSTS",
    "BalanceRequest",
    "balanced_order",
    "fill_capacities",
    "inverse_permutation",
    "karmarkar_karp",
    "pack_micro_batches",
    "part_sums",
    "row_tokens",
    "split_row_counts",
]

BALANCE_META = "balance_tokens"  # Batch.meta key of a group call's BalanceRequest (driver side only)
MicroBatchCost = Literal["window", "tokens"]
MICRO_BATCH_COSTS: tuple[str, ...] = ("window", "tokens")


@dataclass(frozen=True)
class BalanceRequest:
    """Ask a ``DP_SPLIT`` group call to give every data-parallel rank about the same tokens.

    Attributes:
        mini_batch_rows: rows of one optimizer step over all ranks (``ppo_mini_batch_size x
            rollout.n``); each rank then takes ``mini_batch_rows // dp_size`` consecutive rows of its
            shard per step, and rows are only exchanged within a mini-batch. 0: the call has no
            mini-batches (a log-prob or value pass): the whole batch is balanced as one.
        costs: ``[B]`` cost of each row (tokens it runs through the model); None: its real tokens
            (:func:`row_tokens`).
    """

    mini_batch_rows: int = 0
    costs: torch.Tensor | None = None


def row_tokens(batch: Any) -> torch.Tensor | None:
    """``[B]`` int64 real tokens per row (``attention_mask.sum(-1)``), or None when unknown here.

    Read from the driver's ``attention_mask`` when the batch holds it, else from the resident rows'
    handles (:func:`verity.batch.transport.resident_row_tokens`), never by fetching the masks.
    """
    from verity.batch.transport import resident_row_tokens

    if "attention_mask" in batch.tensor_keys():
        return batch.tensors.get("attention_mask").sum(-1).long()
    return resident_row_tokens(batch)


def _as_list(lengths: Sequence[int] | torch.Tensor) -> list[int]:
    values = lengths.tolist() if isinstance(lengths, torch.Tensor) else list(lengths)
    out = [int(v) for v in values]
    if any(v < 0 for v in out):
        raise ValueError("row lengths must be >= 0")
    return out


def part_sums(lengths: Sequence[int] | torch.Tensor, parts: Sequence[Sequence[int]]) -> list[int]:
    """Token sum of each part (``parts``: row indices into ``lengths``)."""
    values = _as_list(lengths)
    return [sum(values[i] for i in part) for part in parts]


def karmarkar_karp(
    lengths: Sequence[int] | torch.Tensor, k: int, *, equal_size: bool = False
) -> list[list[int]]:
    """Partition rows into ``k`` parts of about equal token sums (largest differencing method).

    Args:
        lengths: ``[B]`` tokens per row (ints >= 0).
        k: parts, >= 1 (``k > B`` leaves parts empty).
        equal_size: every part gets ``B / k`` rows (``B`` must divide by ``k``).

    Returns:
        ``k`` lists of row indices, each ascending, every row in exactly one; parts ordered by
        token sum, heaviest first. ``max(sums) - min(sums) <= max(lengths)``.
    """
    values = _as_list(lengths)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if equal_size and len(values) % k:
        raise ValueError(f"equal_size needs the rows ({len(values)}) to divide into k={k} parts")
    order = sorted(range(len(values)), key=lambda i: (values[i], i))
    # a state: k parts as (sum, rows), heaviest first; the heap pops the largest spread first
    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    tick = itertools.count()
    if equal_size:
        for start in range(0, len(order), k):
            state = [(values[i], [i]) for i in order[start : start + k]]
            _push(heap, state, tick)
    else:
        for i in order:
            _push(heap, [(values[i], [i])] + [(0, []) for _ in range(k - 1)], tick)
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        first, second = heapq.heappop(heap)[2], heapq.heappop(heap)[2]
        # heaviest part of one with the lightest of the other: the spread stays <= max of both spreads
        merged = [
            (a + b, rows_a + rows_b) for (a, rows_a), (b, rows_b) in zip(first, reversed(second), strict=True)
        ]
        _push(heap, merged, tick)
    parts = [list(rows) for _, rows in heap[0][2]]
    _swap_down(parts, values)
    parts.sort(key=lambda rows: -sum(values[i] for i in rows))
    return [sorted(rows) for rows in parts]


def _swap_down(parts: list[list[int]], values: list[int], rounds: int = 64) -> None:
    """Swap one row of the heaviest part with one of the lightest while that narrows their gap
    (row counts unchanged; the spread never grows, so the bound of :func:`karmarkar_karp` holds)."""
    for _ in range(rounds):
        sums = [sum(values[i] for i in rows) for rows in parts]
        heavy = max(range(len(parts)), key=lambda j: sums[j])
        light = min(range(len(parts)), key=lambda j: sums[j])
        gap = sums[heavy] - sums[light]
        if gap <= 1 or not parts[light]:
            return
        lights = sorted(parts[light], key=lambda i: values[i])
        light_values = [values[i] for i in lights]
        best: tuple[int, int, int] | None = None  # (new gap, heavy row, light row)
        for a in parts[heavy]:
            want = values[a] - gap / 2  # the light row that halves the gap
            at = bisect.bisect_left(light_values, want)
            for k in (at - 1, at):
                if 0 <= k < len(lights):
                    moved = values[a] - light_values[k]
                    if 0 < moved < gap and (best is None or abs(gap - 2 * moved) < best[0]):
                        best = (abs(gap - 2 * moved), a, lights[k])
        if best is None or best[0] >= gap:
            return
        _, a, b = best
        parts[heavy][parts[heavy].index(a)] = b
        parts[light][parts[light].index(b)] = a


def _push(heap: list, state: list[tuple[int, list[int]]], tick: Iterator[int]) -> None:
    """Push a partial partition, its parts heaviest first, keyed by its spread (largest popped first)."""
    state.sort(key=lambda part: -part[0])
    heapq.heappush(heap, (state[-1][0] - state[0][0], next(tick), state))


def fill_capacities(lengths: Sequence[int] | torch.Tensor, capacities: Sequence[int]) -> list[list[int]]:
    """Rows into parts holding exactly ``capacities[j]`` rows each, longest row first into the
    lightest part that has room (``sum(capacities)`` must equal the rows).

    Returns the parts' row indices, each ascending, in the order of ``capacities``.
    """
    values = _as_list(lengths)
    caps = [int(c) for c in capacities]
    if any(c < 0 for c in caps) or sum(caps) != len(values):
        raise ValueError(f"capacities {caps} must be >= 0 and sum to the rows ({len(values)})")
    parts: list[list[int]] = [[] for _ in caps]
    sums = [0] * len(caps)
    for i in sorted(range(len(values)), key=lambda i: (-values[i], i)):
        j = min((j for j in range(len(caps)) if len(parts[j]) < caps[j]), key=lambda j: (sums[j], j))
        parts[j].append(i)
        sums[j] += values[i]
    return [sorted(p) for p in parts]


def split_row_counts(rows: int, parts: int) -> list[int]:
    """Real rows of each of ``Batch.split(parts)``'s parts for a batch of ``rows`` rows (no padding
    rows of its own): ``ceil(rows / parts)`` each, the last ones shorter (padding fills them)."""
    size = -(-rows // parts)
    return [max(0, min(size, rows - d * size)) for d in range(parts)]


def balanced_order(
    lengths: Sequence[int] | torch.Tensor, parts: int, mini_batch_rows: int = 0
) -> torch.Tensor:
    """``[B]`` int64 order of the rows so that ``batch.index(order).split(parts)`` gives every part
    about the same tokens, each row kept in its mini-batch.

    ``Batch.split`` gives part ``d`` the rows ``[d*s, (d+1)*s)`` (``s = ceil(B / parts)``), and each
    rank cuts its part into mini-batches of ``m = mini_batch_rows // parts`` consecutive rows (at
    least 1); mini-batch ``j`` of the whole batch is the ``j``-th slice of every part. Rows move only
    between the parts of one mini-batch, so each optimizer step sees the same rows as without
    balancing. Within a mini-batch with equal rows per part the parts come from
    :func:`karmarkar_karp` (``equal_size``); the heaviest goes to the rank with the fewest tokens so
    far, so the passes without mini-batches are balanced as a whole. Where ``Batch.split`` pads, the
    parts' row counts differ and :func:`fill_capacities` fills them. Within a part the rows keep
    their original order (a prompt's samples stay next to each other).

    Args:
        lengths: ``[B]`` tokens (cost) per row.
        parts: data-parallel ranks, >= 1.
        mini_batch_rows: rows per optimizer step over all ranks; 0: one mini-batch (no update).
    """
    values = _as_list(lengths)
    rows = len(values)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if rows == 0 or parts == 1:
        return torch.arange(rows, dtype=torch.long)
    size = -(-rows // parts)
    per_rank = size if mini_batch_rows <= 0 else max(1, mini_batch_rows // parts)
    # positions of each mini-batch, by part: position p is row p % size of part p // size
    slots: dict[int, list[list[int]]] = {}
    for p in range(rows):
        slots.setdefault((p % size) // per_rank, [[] for _ in range(parts)])[p // size].append(p)
    order = [0] * rows
    load = [0] * parts
    for mini in sorted(slots):
        by_part = slots[mini]
        members = [p for positions in by_part for p in positions]  # today's rows of this mini-batch
        counts = [len(positions) for positions in by_part]
        member_lengths = [values[p] for p in members]
        if len(set(counts)) == 1:
            groups = karmarkar_karp(member_lengths, parts, equal_size=True)  # heaviest first
            ranks = sorted(range(parts), key=lambda d: (load[d], d))  # lightest rank first
            assigned = dict(zip(ranks, groups, strict=True))
        else:
            assigned = dict(enumerate(fill_capacities(member_lengths, counts)))
        for d, group in assigned.items():
            for position, local in zip(by_part[d], group, strict=True):
                order[position] = members[local]
                load[d] += values[members[local]]
    return torch.tensor(order, dtype=torch.long)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[order[i]] = i``: ``reordered.index(inv)`` is the original order again."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), dtype=order.dtype)
    return inverse


def pack_micro_batches(
    lengths: Sequence[int] | torch.Tensor,
    max_tokens: int,
    max_rows: int,
    *,
    spans: torch.Tensor | None = None,
    groups: Sequence[int] | torch.Tensor | None = None,
    cost: MicroBatchCost = "tokens",
) -> list[list[int]]:
    """Rows into micro-batches longest first, each within ``max_tokens`` and ``max_rows``.

    Rows are taken longest first (a prompt group by its longest row, its rows together, longest
    first), and a micro-batch closes when the next row would break the budget or the row cap.
    A row over the budget on its own gets a micro-batch of its own.

    Args:
        lengths: ``[B]`` real tokens per row.
        max_tokens: budget per micro-batch; 0: none (rows only, in order).
        max_rows: most rows per micro-batch, >= 1.
        spans: ``[B, 2]`` each row's ``(first, end)`` columns of its padding-free window, for
            ``cost="window"``; None: ``(0, length)``.
        groups: ``[B]`` prompt-group id per row (rows sharing a prompt); None: each row alone.
        cost: ``"window"``: rows x the width of their common padding-free window (the padded
            layout's positions) | ``"tokens"``: the sum of the rows' real tokens (a packed layout).

    Returns:
        micro-batches of row indices; every row exactly once; with ``max_tokens == 0``
        consecutive runs of ``max_rows`` rows.
    """
    values = _as_list(lengths)
    rows = len(values)
    if max_rows < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {max_rows}")
    if max_tokens < 0:
        raise ValueError(f"micro_batch_tokens must be >= 0 (0: rows only), got {max_tokens}")
    if cost not in MICRO_BATCH_COSTS:
        raise ValueError(f"cost must be one of {MICRO_BATCH_COSTS}, got {cost!r}")
    if max_tokens == 0:
        return [list(range(s, min(s + max_rows, rows))) for s in range(0, rows, max_rows)]
    if spans is None:
        bounds = [(0, v) for v in values]
    else:
        bounds = [(int(a), int(b)) for a, b in spans.tolist()]
    width = [b - a for a, b in bounds] if cost == "window" else values
    group_ids = list(range(rows)) if groups is None else _as_list(groups)
    longest: dict[int, int] = {}
    for i, g in enumerate(group_ids):
        longest[g] = max(longest.get(g, 0), width[i])
    order = sorted(range(rows), key=lambda i: (-longest[group_ids[i]], group_ids[i], -width[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    lo = hi = total = 0
    for i in order:
        a, b = bounds[i]
        if current:
            if cost == "window":
                after = (len(current) + 1) * (max(hi, b) - min(lo, a))
            else:
                after = total + values[i]
            if len(current) >= max_rows or after > max_tokens:
                batches.append(current)
                current = []
        if not current:
            lo, hi, total = a, b, 0
        current.append(i)
        lo, hi, total = min(lo, a), max(hi, b), total + values[i]
    if current:
        batches.append(current)
    return batches
