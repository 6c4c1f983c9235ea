"""Ulysses sequence parallelism (DeepSpeed-Ulysses style): one packed sequence split over ``s`` ranks.

With SP size ``s``, a micro-batch's rows are packed into one sequence of ``T`` tokens (padded to a
multiple of ``s``, :mod:`verity.engines.ulysses_scoring`) and rank ``j`` of an SP group keeps the
contiguous chunk ``[j T/s, (j+1) T/s)``. Every layer runs on the local chunk except attention,
which needs all tokens of a row. Around it, :func:`ulysses_attention` exchanges heads for tokens::

    q [1, H, T/s, D], k/v [1, KV, T/s, D]   --all_to_all-->   [1, H/s, T, D], [1, KV/s, T, D]
    attention within each row over all T tokens (cu_seqlens of the whole packed sequence),
    by the packed layout's kernel (verity_packed_sdpa, or flash-attn's variable-length one)
    out [1, T, H/s, D]                      --all_to_all-->   [1, T/s, H, D]

so each rank attends with ``H/s`` heads over the whole sequence. Both exchanges are
:class:`_AllToAll` (``torch.distributed.all_to_all_single``; gloo implements it on CPU, NCCL on
GPUs), whose backward is the inverse exchange. Query head ``h`` reads key/value head
``h // (H/KV)``; with ``H`` and ``KV`` both divisible by ``s`` rank ``j``'s query heads
``j H/s ..`` read exactly its key/value heads ``j KV/s ..``, so grouped-query attention needs no
extra exchange.

Groups: ``s`` consecutive ranks form an SP group (inside a node when ``s`` divides the workers
per node); data parallelism runs across groups, and FSDP2 still shards over every rank.
Per-token results (log-probs, entropy, values) are gathered back to the whole sequence on every
SP rank by :func:`gather_sequence`, whose backward returns this rank's slice of the gradient (not
a sum): each SP rank computes the same full loss, each back-propagates only through its own
tokens, and the parameter gradients summed over the ranks are the group's exact gradient.

The attention function is registered with ``transformers.AttentionInterface`` as
:data:`ULYSSES_ATTENTION`; the SP group it exchanges over is the one attached to the model
(:func:`attach_sequence_parallel`, what the engine does) or else the one set for the duration of a
forward by :func:`sequence_parallel` (neither: ``s = 1``, plain attention within rows). Within
rows it attends with the packed layout's kernel (:mod:`verity.engines.packed_attention`): the
same tiles, masks and grouped key/value heads as a packed pass at ``s = 1``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from verity.engines.packed_attention import PACKED_SDPA, packed_sdpa_attention, register_packed_attention

__all__ = [
    "ULYSSES_ATTENTION",
    "SequenceParallelGroup",
    "all_to_all",
    "attach_sequence_parallel",
    "gather_sequence",
    "new_sequence_parallel_group",
    "sequence_parallel",
    "split_sequence",
    "ulysses_attention",
]

#: the name :func:`ulysses_attention` is registered under (``model.set_attn_implementation`` takes it)
ULYSSES_ATTENTION = "verity_ulysses"


@dataclass(frozen=True)
class SequenceParallelGroup:
    """This rank's SP group: ``size`` consecutive ranks; ``rank`` is its place in them.

    ``index`` / ``count``: which of the ``world / size`` groups (the data-parallel rank and size).
    ``group``: the ``torch.distributed`` process group of the ``size`` ranks (None when ``size == 1``).
    ``inner``: the attention kernel run over the exchanged heads (a registered name, e.g.
    ``flash_attention_2``; None: :data:`~verity.engines.packed_attention.PACKED_SDPA`).
    """

    size: int
    rank: int
    index: int
    count: int
    group: Any = None
    inner: str | None = None


def new_sequence_parallel_group(size: int, inner: str | None = None) -> SequenceParallelGroup:
    """Cut the default process group into SP groups of ``size`` consecutive ranks; this rank's.

    A collective: every rank calls ``torch.distributed.new_group`` for every group, in order.
    ``ValueError`` when ``size`` does not divide the world size, or when several ranks are
    wanted without a process group.
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"ulysses_sequence_parallel_size must be an int >= 1, got {size!r}")
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if size == 1:
        return SequenceParallelGroup(1, 0, rank, world, None, inner)
    if world % size != 0:
        raise ValueError(
            f"ulysses_sequence_parallel_size={size} must divide the {world} ranks of the process group"
        )
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= rank < first + size:
            mine = group
    return SequenceParallelGroup(size, rank % size, rank // size, world // size, mine, inner)


# ------------------------------------------------------------------------------- the exchanges
def _exchange(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Cut ``x`` into ``s`` chunks on ``scatter_dim``, send chunk ``j`` to rank ``j``, and lay the
    chunks received (rank 0's first) side by side on ``gather_dim``."""
    size = dist.get_world_size(group)
    if x.shape[scatter_dim] % size != 0:
        raise ValueError(f"dim {scatter_dim} of {tuple(x.shape)} must divide by the {size} SP ranks")
    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()  # [s, ...]: chunk j goes to rank j
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """:func:`_exchange` with the inverse exchange as its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _exchange(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Differentiable all-to-all over ``group``: ``x``'s ``scatter_dim`` shrinks ``s``-fold, ``gather_dim``
    grows ``s``-fold (e.g. ``[1, H, T/s, D]`` -> ``[1, H/s, T, D]`` with ``scatter_dim=1, gather_dim=2``).

    ``group`` None or of one rank: ``x`` itself.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


class _GatherSequence(torch.autograd.Function):
    """All-gather of equal chunks on ``dim``; backward: this rank's slice of the gradient (no sum)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Every SP rank's chunk of ``x`` laid side by side on ``dim`` (``[.., T/s, ..]`` -> ``[.., T, ..]``).

    Differentiable: the backward keeps this rank's slice of the incoming gradient and does not sum
    over ranks. That is exact when every SP rank computes the same loss from the gathered tensor
    (their gradients of it are equal): rank ``j`` then back-propagates ``dL/dx_j`` through the
    computation that made ``x_j``, and the sum over ranks of the parameter gradients is ``dL/dθ``.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    return _GatherSequence.apply(x, group, dim)


def split_sequence(x: torch.Tensor, rank: int, size: int, dim: int = -1) -> torch.Tensor:
    """Rank ``rank``'s contiguous chunk of ``size`` equal chunks of ``x`` on ``dim`` (no gradient bookkeeping:
    for inputs such as token ids, positions and labels). ``ValueError`` when the length does not divide."""
    if x.shape[dim] % size != 0:
        raise ValueError(f"length {x.shape[dim]} on dim {dim} must divide by the {size} SP ranks")
    return x.chunk(size, dim=dim)[rank]


# ------------------------------------------------------------------------------- the attention
_ACTIVE: list[SequenceParallelGroup] = []


def attach_sequence_parallel(model: torch.nn.Module, sp: SequenceParallelGroup) -> None:
    """Make ``sp`` the group :func:`ulysses_attention` exchanges over inside ``model``, at any time.

    Set on every submodule (the attention function is handed its attention layer): a backward that
    recomputes the forward (gradient checkpointing) runs after :func:`sequence_parallel`'s block
    has ended and still finds the group.
    """
    for sub in model.modules():
        sub._verity_sp = sp


@contextlib.contextmanager
def sequence_parallel(sp: SequenceParallelGroup) -> Iterator[None]:
    """:func:`ulysses_attention` exchanges over ``sp`` inside this block, in a model with no group
    attached (:func:`attach_sequence_parallel`); a checkpointed layer's recomputation in backward
    runs outside the block, so a model trained with gradient checkpointing needs the attachment."""
    _ACTIVE.append(sp)
    try:
        yield
    finally:
        _ACTIVE.pop()


def _inner_attention(name: str | None) -> Callable[..., Any]:
    """The registered attention function ``name``, or the packed layout's :data:`PACKED_SDPA` (None)."""
    from transformers import AttentionInterface

    if name is None or name in (ULYSSES_ATTENTION, PACKED_SDPA):
        register_packed_attention()
        return packed_sdpa_attention
    return AttentionInterface._global_mapping[name]


def ulysses_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """An HF attention function: exchange heads for tokens, attend within rows, exchange back.

    Args:
        query: ``[1, H, T/s, D]`` (this rank's tokens, every head); key/value ``[1, KV, T/s, D]``.
        attention_mask: must be None (rows are told apart by ``cu_seq_lens_q`` in ``kwargs``, the
            whole packed sequence's ``[n+1]`` boundaries; absent: the sequence is one row).

    Returns:
        ``([1, T/s, H, D], None)``.
    """
    if attention_mask is not None:
        raise ValueError(
            f"{ULYSSES_ATTENTION} attends within rows by cu_seq_lens_q, not by an attention mask"
        )
    if sliding_window is not None:
        raise NotImplementedError(f"{ULYSSES_ATTENTION}: sliding-window attention is not supported")
    if query.shape[0] != 1:
        raise ValueError(f"{ULYSSES_ATTENTION} takes one packed sequence, got a batch of {query.shape[0]}")
    sp = getattr(module, "_verity_sp", None) or (
        _ACTIVE[-1] if _ACTIVE else SequenceParallelGroup(1, 0, 0, 1)
    )
    q = all_to_all(query, sp.group, scatter_dim=1, gather_dim=2)  # [1, H/s, T, D]
    k = all_to_all(key, sp.group, scatter_dim=1, gather_dim=2)
    v = all_to_all(value, sp.group, scatter_dim=1, gather_dim=2)
    dropout = dropout if module.training else 0.0
    inner = _inner_attention(sp.inner)
    out, _ = inner(module, q, k, v, None, dropout=dropout, scaling=scaling, **kwargs)
    return all_to_all(out, sp.group, scatter_dim=1, gather_dim=2), None  # [1, T, H/s, D] -> [1, T/s, H, D]


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)


_register()
