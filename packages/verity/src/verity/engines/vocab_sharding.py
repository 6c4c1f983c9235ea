"""The input embedding and the output layer sharded by vocabulary rows under FSDP2 (``fsdp2.shard_vocab``).

Why: FSDP2 gathers a unit's whole parameters for its forward and backward and reduces its
whole gradients. For the embedding ``E [V, H]`` (tied or not to the output layer) that is
``V * H`` floats on every rank however many ranks there are, and the lookup's and the output
layer's dense gradients are ``V * H`` each. With a 150k-token vocabulary that floor is the
largest term of a small model's update (ci/reports/2026-12-06-memory-scaling.md).

Here each rank keeps only its ``torch.chunk`` rows ``E_r [V_r, H]`` (rows ``o_r .. o_r + V_r``;
the same ``Shard(0)`` layout FSDP2 gives every other parameter, so checkpoints, the weight
sync and the optimizer see no difference) and the tokens travel instead of the rows. With
``W`` ranks, ``n_j`` tokens on rank ``j`` and ``c = ceil(V / W)`` rows per chunk:

Lookup, ``x_t = E[id_t]``:
    forward   all-gather the ids of every rank; rank r writes ``E_r[id - o_r]`` for the ids it
              owns (zeros elsewhere) into ``[W, n, H]``; a reduce-scatter (sum) gives each rank
              the rows of its own tokens (exactly one rank contributes a non-zero row per token).
    backward  all-gather the output gradients ``g [W, n, H]``; rank r adds them into its rows:
              ``dE_r[id - o_r] += g_t`` for every token of every rank that it owns (the
              padding row, if the embedding has one, gets none, as in ``nn.Embedding``).

Output layer, ``z_t = h_t E^T`` (logits ``[n, V]``):
    forward   all-gather the hidden states ``h [W n, H]``; rank r computes its vocabulary
              columns for every rank's tokens, ``h E_r^T [W n, c]``; an all-to-all sends each
              rank its own tokens' columns, which are laid side by side into ``[n, V]``.
    backward  the reverse all-to-all gives rank r ``dz[:, o_r:o_r+V_r]`` for every rank's
              tokens; ``dE_r = dz_r^T h`` and ``dh = sum_r dz_r E_r`` (a reduce-scatter).

The gradients are sums over the ranks' tokens, which is what the engine's FSDP2 units
reduce to (``set_gradient_divide_factor(1)``), so a step's numbers are those of the
unsharded embedding up to float rounding. No rank ever holds more than its ``V_r`` rows
of ``E`` or of its gradient; the price is an all-to-all of the micro-batch's logits
(``n V`` values) instead of all-gathering ``E`` (``V H``), smaller while a micro-batch has
fewer tokens than the hidden size has features times the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["VocabShard", "ShardedEmbedding", "ShardedOutput", "shard_vocabulary", "vocab_unsupported_reason"]


@dataclass(frozen=True)
class VocabShard:
    """Which rows of a ``[V, H]`` weight this rank holds (``torch.chunk`` layout over the group)."""

    group: Any
    world: int
    rank: int
    rows: int  # V
    chunk: int  # c = ceil(V / W)

    @property
    def start(self) -> int:
        """First row this rank holds."""
        return min(self.rank * self.chunk, self.rows)

    @property
    def local_rows(self) -> int:
        """Rows this rank holds (the last ranks may hold fewer, or none)."""
        return max(0, min(self.chunk, self.rows - self.start))


# all_gather_single is the name torch >= 2.13 gives all_gather_into_tensor (deprecated there)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_padded(x: torch.Tensor, shard: VocabShard, fill: float = 0) -> tuple[torch.Tensor, list[int]]:
    """``x [n, ...]`` of every rank as ``[W, n_max, ...]`` (rows past a rank's ``n`` are ``fill``), and each ``n``."""
    count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    counts = torch.empty(shard.world, dtype=torch.int64, device=x.device)
    _all_gather_single(counts, count, group=shard.group)
    sizes = counts.tolist()
    n_max = max(sizes)
    padded = x.new_full((n_max, *x.shape[1:]), fill)
    padded[: x.shape[0]] = x
    out = x.new_empty((shard.world * n_max, *x.shape[1:]))
    _all_gather_single(out, padded, group=shard.group)
    return out.view(shard.world, n_max, *x.shape[1:]), sizes


def _reduce_scatter_rows(x: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """``sum over ranks of x [W, n_max, ...]``, this rank's block ``[n_max, ...]``."""
    out = x.new_empty(x.shape[1:])
    flat = x.contiguous().view(-1, *x.shape[2:])  # [W n_max, ...]: the layout gloo expects
    _reduce_scatter_single(out, flat, op=dist.ReduceOp.SUM, group=shard.group)
    return out


class _ShardedLookup(torch.autograd.Function):
    """``E[ids]`` with ``E`` sharded by rows: ``(ids [...], E_r [V_r, H]) -> [..., H]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        ids: torch.Tensor,
        weight: torch.Tensor,
        shard: VocabShard,
        dtype: torch.dtype,
        padding_idx: int | None,
    ) -> torch.Tensor:
        flat = ids.reshape(-1)
        all_ids, sizes = _gather_padded(flat, shard, fill=-1)  # [W, n_max]
        local = all_ids.reshape(-1) - shard.start
        owned = ((local >= 0) & (local < shard.local_rows)).nonzero().squeeze(1)
        rows = local[owned]
        partial = torch.zeros(all_ids.numel(), weight.shape[1], dtype=dtype, device=weight.device)
        partial[owned] = weight[rows].to(dtype)
        mine = _reduce_scatter_rows(partial.view(shard.world, -1, weight.shape[1]), shard)
        if padding_idx is not None:  # the padding row takes no gradient
            keep = all_ids.reshape(-1)[owned] != padding_idx
            owned, rows = owned[keep], rows[keep]
        ctx.save_for_backward(owned, rows)
        ctx.shard, ctx.n, ctx.weight_shape, ctx.weight_dtype = shard, flat.numel(), weight.shape, weight.dtype
        return mine[: flat.numel()].view(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        owned, rows = ctx.saved_tensors
        grads, _ = _gather_padded(grad.reshape(ctx.n, -1), ctx.shard)  # [W, n_max, H]
        d_weight = torch.zeros(ctx.weight_shape, dtype=ctx.weight_dtype, device=grad.device)
        d_weight.index_add_(0, rows, grads.reshape(-1, grads.shape[-1])[owned].to(ctx.weight_dtype))
        return None, d_weight, None, None, None


class _ShardedLogits(torch.autograd.Function):
    """``h E^T`` with ``E`` sharded by rows: ``(h [..., H], E_r [V_r, H]) -> [..., V]``."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, shard: VocabShard, dtype: torch.dtype
    ) -> torch.Tensor:
        lead, width = hidden.shape[:-1], hidden.shape[-1]
        flat = hidden.reshape(-1, width).to(dtype)
        h_all, _ = _gather_padded(flat, shard)  # [W, n_max, H]
        n_max = h_all.shape[1]
        h_all = h_all.view(-1, width)
        w = _padded_rows(weight.to(dtype), shard)  # [c, H]
        send = h_all @ w.T  # [W n_max, c]: this rank's columns for every rank's tokens
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=shard.group)
        del send
        # received[j]: this rank's tokens against rank j's columns, laid side by side into [..., V]
        blocks = received.view(shard.world, n_max, shard.chunk)
        n = flat.shape[0]
        logits = blocks.new_empty((*lead, shard.rows))  # a fresh tensor, not a view (FSDP2 hooks it)
        columns = logits.view(n, shard.rows)
        for j in range(shard.world):
            start = min(j * shard.chunk, shard.rows)
            end = min(start + shard.chunk, shard.rows)
            columns[:, start:end] = blocks[j, :n, : end - start]
        ctx.save_for_backward(h_all, weight)
        ctx.shard, ctx.dtype, ctx.n_max, ctx.hidden_dtype = shard, dtype, n_max, hidden.dtype
        return logits

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        h_all, weight = ctx.saved_tensors
        shard, n_max = ctx.shard, ctx.n_max
        lead, width = grad.shape[:-1], h_all.shape[-1]
        d_logits = grad.reshape(-1, shard.rows).to(ctx.dtype)
        n = d_logits.shape[0]
        padded = d_logits.new_zeros((n_max, shard.world * shard.chunk))
        padded[:n, : shard.rows] = d_logits
        send = padded.view(n_max, shard.world, shard.chunk).transpose(0, 1).contiguous()
        del padded
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=shard.group)  # [W, n_max, c]: every rank's tokens
        del send
        d_part = received.view(-1, shard.chunk)
        d_weight = (d_part.T @ h_all)[: shard.local_rows].to(weight.dtype)
        d_hidden_all = d_part @ _padded_rows(weight.to(ctx.dtype), shard)  # [W n_max, H]
        d_hidden = _reduce_scatter_rows(d_hidden_all.view(shard.world, n_max, width), shard)
        return d_hidden[:n].view(*lead, width).to(ctx.hidden_dtype), d_weight, None, None


def _padded_rows(weight: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """``weight [V_r, H]`` with zero rows appended up to the chunk size ``c``."""
    missing = shard.chunk - weight.shape[0]
    if missing == 0:
        return weight
    return torch.cat([weight, weight.new_zeros((missing, weight.shape[1]))])


class ShardedEmbedding(nn.Module):
    """An ``nn.Embedding`` whose ``weight`` is a ``DTensor`` sharded by rows; forward ``ids [...] -> [..., H]``."""

    def __init__(self, weight: nn.Parameter, shard: VocabShard, padding_idx: int | None) -> None:
        super().__init__()
        self.weight = weight
        self.shard = shard
        self.padding_idx = padding_idx
        self.compute_dtype: torch.dtype | None = None  # None: the weight's own

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = self.weight.to_local()
        dtype = self.compute_dtype or local.dtype
        return _ShardedLookup.apply(input_ids, local, self.shard, dtype, self.padding_idx)


class ShardedOutput(nn.Module):
    """A bias-free output ``nn.Linear`` ``[V, H]`` sharded by rows; forward ``h [..., H] -> logits [..., V]``."""

    def __init__(self, weight: nn.Parameter, shard: VocabShard) -> None:
        super().__init__()
        self.weight = weight
        self.shard = shard
        self.compute_dtype: torch.dtype | None = None
        self.bias = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.weight.to_local()
        dtype = self.compute_dtype or local.dtype
        return _ShardedLogits.apply(hidden, local, self.shard, dtype)


def vocab_unsupported_reason(model: nn.Module) -> str | None:
    """Why ``model``'s vocabulary layers cannot be sharded here (None: they can).

    Needs HF's ``get_input_embeddings`` returning a plain ``nn.Embedding`` (no ``max_norm``,
    ``scale_grad_by_freq`` or sparse gradients) and an output layer that is absent (a value
    model's head) or a bias-free ``nn.Linear`` of the vocabulary's size.
    """
    get_in = getattr(model, "get_input_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    if type(embedding) is not nn.Embedding:
        return f"its input embedding is a {type(embedding).__name__}, not a plain nn.Embedding"
    if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
        return "its nn.Embedding uses max_norm, scale_grad_by_freq or sparse gradients"
    get_out = getattr(model, "get_output_embeddings", None)
    output = get_out() if callable(get_out) else None
    if output is not None:
        if type(output) is not nn.Linear or output.bias is not None:
            return f"its output layer is a {type(output).__name__} with a bias or not an nn.Linear"
        if output.weight.shape[0] != embedding.weight.shape[0]:
            return "its output layer's rows differ from the vocabulary's"
    return None


def _rows_of(weight: torch.Tensor, shard: VocabShard, mesh: Any) -> nn.Parameter:
    """This rank's rows of a whole (or ``meta``) ``weight [V, H]`` as a ``Shard(0)`` ``DTensor`` parameter."""
    from torch.distributed.tensor import DTensor, Shard

    with torch.no_grad():
        if weight.is_meta:
            local = torch.empty((shard.local_rows, weight.shape[1]), dtype=weight.dtype, device="meta")
        else:
            local = weight[shard.start : shard.start + shard.local_rows].detach().clone()
    sharded = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride()
    )
    return nn.Parameter(sharded, requires_grad=weight.requires_grad)


def shard_vocabulary(model: nn.Module, mesh: Any, compute_dtype: torch.dtype | None) -> set[nn.Parameter]:
    """Replace ``model``'s input embedding and output layer by their row-sharded versions.

    Call before ``fully_shard`` and pass the returned parameters as its ``ignored_params``.
    Tied weights stay one parameter. ``compute_dtype``: what the lookups and logits are
    computed in (bfloat16 under mixed precision; None keeps the weights' float32).
    ``ValueError`` when :func:`vocab_unsupported_reason` names a reason.
    """
    reason = vocab_unsupported_reason(model)
    if reason is not None:
        raise ValueError(f"fsdp2.shard_vocab=true cannot shard {type(model).__name__}: {reason}")
    group = mesh.get_group()
    embedding: nn.Embedding = model.get_input_embeddings()
    output = model.get_output_embeddings()
    rows, world = int(embedding.weight.shape[0]), dist.get_world_size(group)
    shard = VocabShard(group, world, dist.get_rank(group), rows, -(-rows // world))
    tied = output is not None and output.weight is embedding.weight
    weight = _rows_of(embedding.weight, shard, mesh)
    new_in = ShardedEmbedding(weight, shard, embedding.padding_idx)
    new_in.compute_dtype = compute_dtype
    model.set_input_embeddings(new_in)
    params = {weight}
    if output is not None:
        out_weight = weight if tied else _rows_of(output.weight, shard, mesh)
        new_out = ShardedOutput(out_weight, shard)
        new_out.compute_dtype = compute_dtype
        model.set_output_embeddings(new_out)
        params.add(out_weight)
    return params
