"""Load-balanced calls: a batch cut into chunks that replicas take as they finish (the pure part).

A ``DP_SPLIT`` call whose batch carries a :class:`LoadBalanceRequest` in
``meta[LOAD_BALANCE_META]`` is not split into one equal part per data-parallel replica: the
driver cuts it into contiguous chunks of whole groups (the rows that share a ``group`` id, a
prompt's ``n`` samples, stay in one chunk), hands each replica ``in_flight`` chunks, and hands
the next chunk to whichever replica answers first, until every chunk is answered
(:mod:`verity.controller.balanced_call`). The answers are joined in chunk order, which is the
batch's order. A replica that runs slower (longer responses, a slower device) takes fewer chunks.

Randomness must not depend on which replica ran a chunk: each chunk's meta carries
``meta[CHUNK_SEED_META]``, derived from the batch's ``meta["seed"]`` and the chunk's index
(:func:`chunk_seed`), which the worker seeds its engine with in place of its replica offset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = [
    "CHUNK_INDEX_META",
    "CHUNK_SEED_META",
    "LOAD_BALANCE_META",
    "LoadBalanceRequest",
    "chunk_bounds",
    "chunk_seed",
    "replica_ranks",
]

LOAD_BALANCE_META = "load_balance"  # meta key of a batch's LoadBalanceRequest (stays on the driver)
CHUNK_SEED_META = "chunk_seed"  # meta key of a chunk's seed (replaces the replica's seed offset)
CHUNK_INDEX_META = "chunk_index"  # meta key of a chunk's index: the worker knows it runs one chunk of many


@dataclass(frozen=True)
class LoadBalanceRequest:
    """How to cut a batch for a load-balanced call.

    ``chunk_rows``: rows per chunk, rounded up to whole groups (None: the batch over
    ``chunks_per_replica`` x replicas chunks); ``group_key``: the ``[B]`` tensor whose equal,
    consecutive values are kept in one chunk (absent from the batch: every row is its own group);
    ``in_flight``: chunks queued on each replica at once (2: the next is already there when one
    ends); ``before`` / ``after``: methods of the role broadcast to every rank before the first
    chunk and after the last (skipped where the role has no such method), e.g. to wake and put
    to sleep an engine that a per-chunk call must not toggle.
    """

    chunk_rows: int | None = None
    group_key: str = "group"
    in_flight: int = 2
    chunks_per_replica: int = 8
    before: str | None = "prepare_generate"
    after: str | None = "release_generate"

    def __post_init__(self) -> None:
        if self.chunk_rows is not None and self.chunk_rows < 1:
            raise ValueError(f"LoadBalanceRequest.chunk_rows: expected >= 1 or None, got {self.chunk_rows}")
        if self.in_flight < 1 or self.chunks_per_replica < 1:
            raise ValueError("LoadBalanceRequest: in_flight and chunks_per_replica must be >= 1")

    def rows_per_chunk(self, rows: int, replicas: int) -> int:
        """Rows per chunk for a batch of ``rows`` over ``replicas`` (before rounding to whole groups)."""
        if self.chunk_rows is not None:
            return self.chunk_rows
        return max(1, math.ceil(rows / (replicas * self.chunks_per_replica)))


def chunk_bounds(groups: torch.Tensor | None, rows: int, chunk_rows: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: consecutive row ranges covering ``0..rows``, each of whole groups.

    ``groups``: ``[rows]`` group ids, a group's rows consecutive (None: each row its own group).
    A chunk takes whole groups until it holds at least ``chunk_rows`` rows, so a chunk is never
    cut inside a group and holds at most ``chunk_rows`` + one group's rows - 1. Raises ValueError
    when a group's rows are not consecutive.
    """
    if rows == 0:
        return []
    if groups is None:
        starts = list(range(rows))
    else:
        if groups.shape != (rows,):
            raise ValueError(f"chunk_bounds: group ids have shape {tuple(groups.shape)}, expected ({rows},)")
        change = torch.nonzero(groups[1:] != groups[:-1]).flatten() + 1
        starts = [0, *change.tolist()]
        if len(set(groups[starts].tolist())) != len(starts):
            raise ValueError(
                "chunk_bounds: the rows of a group are not consecutive; cannot keep groups whole"
            )
    bounds, begin = [], 0
    for start in [*starts[1:], rows]:
        if start - begin >= chunk_rows or start == rows:
            bounds.append((begin, start))
            begin = start
    return bounds


def chunk_seed(seed: int, index: int) -> int:
    """The seed of chunk ``index`` of a call seeded ``seed`` (the same on whichever replica runs it)."""
    return int(seed) * 1_000_003 + int(index)


def replica_ranks(dp_ranks: list[int], collectors: list[bool]) -> list[tuple[list[int], int]]:
    """Per replica (data-parallel rank ``0..``): ``(its ranks, its collector rank)``.

    ``dp_ranks[r]`` / ``collectors[r]``: rank ``r``'s data-parallel rank and whether it answers.
    Every rank of a replica gets the same chunk (tensor-parallel peers decode together).
    """
    replicas: dict[int, list[int]] = {}
    for rank, dp in enumerate(dp_ranks):
        replicas.setdefault(dp, []).append(rank)
    out = []
    for dp in sorted(replicas):
        ranks = replicas[dp]
        answering = [r for r in ranks if collectors[r]]
        if len(answering) != 1:
            raise ValueError(f"replica {dp}: expected one collector rank among {ranks}, got {answering}")
        out.append((ranks, answering[0]))
    return out
