"""Exact conversion between HF Qwen2 weights and one rank's Megatron-core parameters.

Every parameter of a rank's ``GPTModel`` stage is described by a :class:`ParamLayout`:
its Megatron name, the HF tensors it holds a piece of, and how. Each HF tensor is cut
over the ``T`` tensor-parallel ranks along one dimension (or replicated), in
contiguous chunks as ``torch.chunk`` cuts them, and rank ``r`` holds chunk ``r`` of
each of its HF tensors, rearranged into Megatron's layout:

==================================  =================================  ==========  ===========================
Megatron parameter                  HF tensors                         HF dim cut  rank-local layout
==================================  =================================  ==========  ===========================
``embedding.word_embeddings``       ``model.embed_tokens``             0 (vocab)   rows ``[rV', (r+1)V')``
``output_layer`` (untied)           ``lm_head``                        0 (vocab)   same
``...linear_qkv.weight``/``.bias``  ``q_proj``, ``k_proj``, ``v_proj``  0           per KV group ``g``: ``[q_g; k_g; v_g]``
``...linear_proj.weight``           ``o_proj``                         1           as is
``...linear_fc1.weight``            ``gate_proj``, ``up_proj``         0           ``[gate_r; up_r]``
``...linear_fc2.weight``            ``down_proj``                      1           as is
norms                               ``*layernorm``, ``model.norm``     --          replicated
``...q_layernorm``/``k_layernorm``  ``q_norm``, ``k_norm`` (Qwen3)     --          replicated
``...mlp.router.weight``            ``mlp.gate`` ``[E, H]``            --          replicated
``...local_experts.j.linear_fc1``   ``mlp.experts.gate_up_proj[e]``    --          ``[gate_e; up_e]`` as is
``...local_experts.j.linear_fc2``   ``mlp.experts.down_proj[e]``       --          as is
==================================  =================================  ==========  ===========================

Mixture-of-experts layers (Qwen3-MoE; tensor parallelism 1): HF keeps every expert of a
layer in two 3-D tensors, ``gate_up_proj [E, 2I, H]`` (gate rows first) and
``down_proj [E, H, I]``; Megatron's local expert ``j`` on expert-parallel rank ``q`` is
global expert ``e = q E/EP + j`` (the layer's ``local_expert_indices``) and holds
``gate_up_proj[e]`` as its ``linear_fc1`` and ``down_proj[e]`` as its ``linear_fc2``
unchanged. Its :class:`ParamLayout` has kind ``expert`` and that ``e``; the EP rank's
experts together are the contiguous rows ``[q E/EP, (q+1) E/EP)`` of the HF tensor.

``q_g`` is the ``H/G`` query heads that share key/value head ``g`` (``G`` KV heads);
rank ``r`` holds the groups ``[rG/T, (r+1)G/T)``. The vocabulary is padded to
``V' * T`` rows (``V' = ceil(V / T)``); the padding rows are zero, exist only on the
Megatron side, and are dropped on the way back. Layer ``j`` of stage ``p`` is HF
layer ``layer_number - 1`` (Megatron numbers layers globally from 1).

With tied embeddings the HF checkpoint has no ``lm_head``; under pipeline parallelism
the last stage's ``output_layer.weight`` is a copy of ``model.embed_tokens`` marked
``duplicate`` (left out of weight sync, gradient norms and full gradients).

The per-rank pieces returned by :func:`local_pieces` are exactly ``torch.chunk``
pieces of the full HF tensors, so they are what a ``DTensor`` with ``Shard(dim)``
holds; :func:`join_pieces` is its exact inverse.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from verity.engines.megatron.model import Qwen2Shape

#: HF dimension each kind is cut along over TP ranks (``None``: replicated)
SHARD_DIM = {"qkv": 0, "fc1": 0, "column": 0, "vocab": 0, "row": 1, "replicated": None, "expert": None}

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.linear_fc([12])\.weight$")
_EXPERT_HF = {"1": "mlp.experts.gate_up_proj", "2": "mlp.experts.down_proj"}
_LAYER_PARAMS = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ),
    "self_attention.linear_qkv.bias": (
        "qkv",
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    ),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("fc1", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "mlp.router.weight": ("replicated", ("mlp.gate.weight",)),
}


@dataclass(frozen=True)
class ParamLayout:
    """How one Megatron parameter of this rank maps onto HF tensors (see the module docstring)."""

    name: str
    kind: str
    hf_names: tuple[str, ...]
    duplicate: bool = False
    #: kind ``expert``: the global expert index ``e`` whose slice ``hf[e]`` this parameter is
    expert: int | None = None

    @property
    def shard_dim(self) -> int | None:
        """HF dimension cut over TP ranks, ``None`` when every TP rank holds the whole tensor."""
        return SHARD_DIM[self.kind]


def param_layouts(model: nn.Module, shape: Qwen2Shape) -> list[ParamLayout]:
    """The :class:`ParamLayout` of every parameter of this rank's stage, in ``named_parameters`` order.

    ``ValueError`` for a parameter the conversion does not know (a model this engine did not build).
    """
    layer_numbers = {i: int(layer.layer_number) for i, layer in enumerate(model.decoder.layers)}
    out = []
    for name, _ in model.named_parameters():
        match = _LAYER.match(name)
        if match:
            local, rest = int(match.group(1)), match.group(2)
            prefix = f"model.layers.{layer_numbers[local] - 1}."
            expert = _EXPERT.match(rest)
            if expert:
                index = int(model.decoder.layers[local].mlp.local_expert_indices[int(expert.group(1))])
                out.append(ParamLayout(name, "expert", (prefix + _EXPERT_HF[expert.group(2)],), expert=index))
                continue
            if rest not in _LAYER_PARAMS:
                raise ValueError(f"megatron engine: no HF name for parameter {name!r}")
            kind, suffixes = _LAYER_PARAMS[rest]
            out.append(ParamLayout(name, kind, tuple(prefix + s for s in suffixes)))
        elif name == "embedding.word_embeddings.weight":
            out.append(ParamLayout(name, "vocab", ("model.embed_tokens.weight",)))
        elif name == "output_layer.weight":
            tied = shape.tie_word_embeddings
            hf = "model.embed_tokens.weight" if tied else "lm_head.weight"
            out.append(ParamLayout(name, "vocab", (hf,), duplicate=tied))
        elif name == "decoder.final_layernorm.weight":
            out.append(ParamLayout(name, "replicated", ("model.norm.weight",)))
        else:
            raise ValueError(f"megatron engine: no HF name for parameter {name!r}")
    return out


def hf_shapes(shape: Qwen2Shape) -> dict[str, tuple[int, ...]]:
    """Full shape of every HF tensor of the model, in HF's order (``lm_head`` only when untied)."""
    h, d = shape.hidden_size, shape.head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h)}
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (shape.num_heads * d, h)
        if shape.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (shape.num_heads * d,)
        out[p + "self_attn.k_proj.weight"] = (shape.num_kv_heads * d, h)
        if shape.qkv_bias:
            out[p + "self_attn.k_proj.bias"] = (shape.num_kv_heads * d,)
        out[p + "self_attn.v_proj.weight"] = (shape.num_kv_heads * d, h)
        if shape.qkv_bias:
            out[p + "self_attn.v_proj.bias"] = (shape.num_kv_heads * d,)
        out[p + "self_attn.o_proj.weight"] = (h, shape.num_heads * d)
        if shape.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (d,)
            out[p + "self_attn.k_norm.weight"] = (d,)
        if shape.is_moe:
            e, f = shape.num_experts, shape.moe_ffn_hidden_size
            out[p + "mlp.gate.weight"] = (e, h)
            out[p + "mlp.experts.gate_up_proj"] = (e, 2 * f, h)
            out[p + "mlp.experts.down_proj"] = (e, h, f)
        else:
            out[p + "mlp.gate_proj.weight"] = (shape.ffn_hidden_size, h)
            out[p + "mlp.up_proj.weight"] = (shape.ffn_hidden_size, h)
            out[p + "mlp.down_proj.weight"] = (h, shape.ffn_hidden_size)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    return out


def _chunk_bounds(size: int, tp: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``torch.chunk(size, tp)``'s piece ``rank`` (empty past the end)."""
    step = -(-size // tp)
    start = min(size, rank * step)
    return start, min(size, start + step)


def hf_chunk(tensor: torch.Tensor, dim: int | None, tp: int, rank: int) -> torch.Tensor:
    """TP rank ``rank``'s piece of a full HF tensor (the tensor itself when ``dim`` is ``None``)."""
    if dim is None:
        return tensor
    start, end = _chunk_bounds(tensor.shape[dim], tp, rank)
    return tensor.narrow(dim, start, end - start)


def local_pieces(
    layout: ParamLayout, local: torch.Tensor, shape: Qwen2Shape, tp: int, tp_rank: int
) -> dict[str, torch.Tensor]:
    """Split a rank-local Megatron tensor (a parameter, its gradient or optimizer state) into HF pieces.

    Returns ``{hf_name: piece}`` where each piece is TP rank ``tp_rank``'s
    :func:`hf_chunk` of that HF tensor (views where the layout allows, else copies).
    """
    kind = layout.kind
    if kind in ("replicated", "column", "row", "expert"):
        return {layout.hf_names[0]: local}
    if kind == "vocab":
        start, end = _chunk_bounds(shape.vocab_size, tp, tp_rank)
        return {layout.hf_names[0]: local[: end - start]}
    if kind == "fc1":
        gate, up = local.chunk(2, dim=0)
        return dict(zip(layout.hf_names, (gate, up), strict=True))
    if kind == "qkv":
        groups = shape.num_kv_heads // tp
        per_group = shape.heads_per_group + 2
        grouped = local.reshape(groups, per_group, shape.head_dim, *local.shape[1:])
        q = grouped[:, : shape.heads_per_group].reshape(-1, *local.shape[1:])
        k = grouped[:, -2].reshape(-1, *local.shape[1:])
        v = grouped[:, -1].reshape(-1, *local.shape[1:])
        return dict(zip(layout.hf_names, (q, k, v), strict=True))
    raise ValueError(f"unknown parameter kind {kind!r}")


def join_pieces(
    layout: ParamLayout,
    pieces: Mapping[str, torch.Tensor],
    shape: Qwen2Shape,
    tp: int,
    local_shape: torch.Size | tuple[int, ...],
) -> torch.Tensor:
    """The rank-local Megatron tensor from this rank's HF pieces (inverse of :func:`local_pieces`)."""
    kind = layout.kind
    if kind in ("replicated", "column", "row", "expert"):
        return pieces[layout.hf_names[0]]
    if kind == "vocab":
        piece = pieces[layout.hf_names[0]]
        pad = local_shape[0] - piece.shape[0]
        if pad == 0:
            return piece
        return torch.cat([piece, piece.new_zeros(pad, *piece.shape[1:])])
    if kind == "fc1":
        return torch.cat([pieces[n] for n in layout.hf_names], dim=0)
    if kind == "qkv":
        groups = shape.num_kv_heads // tp
        q, k, v = (pieces[n] for n in layout.hf_names)
        tail = q.shape[1:]
        q = q.reshape(groups, shape.heads_per_group * shape.head_dim, *tail)
        k = k.reshape(groups, shape.head_dim, *tail)
        v = v.reshape(groups, shape.head_dim, *tail)
        return torch.cat([q, k, v], dim=1).reshape(local_shape)
    raise ValueError(f"unknown parameter kind {kind!r}")


def local_from_full(
    layout: ParamLayout,
    full: Mapping[str, torch.Tensor],
    shape: Qwen2Shape,
    tp: int,
    tp_rank: int,
    local_shape: torch.Size | tuple[int, ...],
) -> torch.Tensor:
    """TP rank ``tp_rank``'s Megatron tensor for ``layout`` from full HF tensors ``full``."""
    missing = [n for n in layout.hf_names if n not in full]
    if missing:
        raise KeyError(f"HF state dict has no {missing} (needed for Megatron parameter {layout.name!r})")
    if layout.kind == "expert":
        expert_slice = getattr(full, "expert_slice", None)  # files that hold experts one by one: moe_files
        if expert_slice is not None:
            return expert_slice(layout.hf_names[0], layout.expert)
        return full[layout.hf_names[0]][layout.expert]
    pieces = {n: hf_chunk(full[n], layout.shard_dim, tp, tp_rank) for n in layout.hf_names}
    return join_pieces(layout, pieces, shape, tp, local_shape)


def full_from_locals(
    layout: ParamLayout, locals_by_rank: list[torch.Tensor], shape: Qwen2Shape
) -> dict[str, torch.Tensor]:
    """Full HF tensors from the Megatron tensors of all ``len(locals_by_rank)`` TP ranks, in rank order
    (an ``expert`` parameter: its one expert's slice, ``[1, ...]``)."""
    if layout.kind == "expert":
        return {layout.hf_names[0]: locals_by_rank[0].unsqueeze(0)}
    tp = len(locals_by_rank)
    per_rank = [local_pieces(layout, t, shape, tp, r) for r, t in enumerate(locals_by_rank)]
    dim = layout.shard_dim
    out = {}
    for name in layout.hf_names:
        if dim is None:
            out[name] = per_rank[0][name]
        else:
            out[name] = torch.cat([p[name] for p in per_rank], dim=dim)
    return out


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """An HF model's parameters by name; a tied ``lm_head`` (an alias of the embedding) appears once,
    as ``model.embed_tokens.weight``."""
    return {n: p.detach() for n, p in model.named_parameters()}


@torch.no_grad()
def load_hf_into_stage(
    model: nn.Module,
    layouts: list[ParamLayout],
    full: Mapping[str, torch.Tensor],
    shape: Qwen2Shape,
    tp: int,
    tp_rank: int,
) -> None:
    """Copy full HF tensors into this rank's Megatron parameters (every parameter must be covered)."""
    params = dict(model.named_parameters())
    for layout in layouts:
        target = params[layout.name]
        value = local_from_full(layout, full, shape, tp, tp_rank, target.shape)
        if value.shape != target.shape:
            raise ValueError(
                f"{layout.name}: converted shape {tuple(value.shape)} != parameter shape {tuple(target.shape)}"
            )
        target.copy_(value)
