"""Full HF-named tensors from a TP/PP-split Megatron model, in bounded buckets, on every rank.

Used for weight sync to an HF rollout (:meth:`MegatronEngine.iter_full_weights`) and
for full gradients in checks. The order is a global plan every rank computes from the
model's shape alone: the embedding, then each layer's Megatron parameters (as groups of
HF tensors: ``[q, k, v]``, ``[gate, up]``, ...), the final norm and the untied
``lm_head``. The plan is cut into buckets of at most ``bucket_bytes`` (a group larger
than that is a bucket alone). For each bucket:

1. the stage owning a group all-gathers its TP pieces (``full_from_locals``); a
   mixture-of-experts layer's ``gate_up_proj`` / ``down_proj`` ``[E, ...]`` is the stack
   of this rank's experts all-gathered over the expert-parallel group (rank order is
   expert order);
2. with pipeline parallelism, each owning stage broadcasts its part of the bucket,
   flattened into one buffer, to the other stages of the same TP/DP coordinates;
3. the bucket is yielded; peak extra memory is about one bucket of full tensors.

Every rank of the world must consume the generator to the end (collectives).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from verity.engines.megatron.convert import ParamLayout, full_from_locals, hf_shapes
from verity.engines.megatron.model import Qwen2Shape
from verity.engines.megatron.parallel import ParallelLayout
from verity.resharding.gather import plan_buckets


@dataclass(frozen=True)
class Unit:
    """One Megatron parameter's HF tensors and the pipeline stage that holds them."""

    key: str
    hf_names: tuple[str, ...]
    stage: int


def global_plan(shape: Qwen2Shape, pp: int) -> list[Unit]:
    """Every non-duplicate parameter group of the whole model, in a fixed order (same on all ranks)."""
    per_stage = shape.num_layers // pp
    units = [Unit("embed", ("model.embed_tokens.weight",), 0)]
    groups = [
        ("input_layernorm.weight",),
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    ]
    if shape.qkv_bias:
        groups.append(("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"))
    groups.append(("self_attn.o_proj.weight",))
    if shape.qk_norm:
        groups.extend([("self_attn.q_norm.weight",), ("self_attn.k_norm.weight",)])
    groups.append(("post_attention_layernorm.weight",))
    if shape.is_moe:
        groups.extend([("mlp.gate.weight",), ("mlp.experts.gate_up_proj",), ("mlp.experts.down_proj",)])
    else:
        groups.extend([("mlp.gate_proj.weight", "mlp.up_proj.weight"), ("mlp.down_proj.weight",)])
    for i in range(shape.num_layers):
        for names in groups:
            hf = tuple(f"model.layers.{i}.{n}" for n in names)
            units.append(Unit(hf[0], hf, i // per_stage))
    units.append(Unit("norm", ("model.norm.weight",), pp - 1))
    if not shape.tie_word_embeddings:
        units.append(Unit("lm_head", ("lm_head.weight",), pp - 1))
    return units


def iter_full_tensor_buckets(
    model: nn.Module,
    layouts: list[ParamLayout],
    shape: Qwen2Shape,
    layout: ParallelLayout,
    select: Callable[[nn.Parameter], torch.Tensor],
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield buckets of ``(hf_name, full tensor)`` of ``select(param)`` for every parameter (collective).

    Args:
        select: which tensor of a parameter to gather (the parameter, its gradient ...).
        dtype: cast floating-point tensors to it after gathering (sizes are planned in it).
        device: where the yielded tensors go (default: the compute device).
    """
    params = dict(model.named_parameters())
    mine = {lay.hf_names[0]: lay for lay in layouts if not lay.duplicate and lay.kind != "expert"}
    experts: dict[str, list[ParamLayout]] = {}
    for lay in sorted((lay for lay in layouts if lay.kind == "expert"), key=lambda lay: lay.expert or 0):
        experts.setdefault(lay.hf_names[0], []).append(lay)
    shapes = hf_shapes(shape)
    compute_device = next(iter(params.values())).device
    param_dtype = next(iter(params.values())).dtype
    out_dtype = dtype or param_dtype
    element = torch.empty((), dtype=out_dtype).element_size()
    units = global_plan(shape, layout.pp)
    sizes = [(u.key, sum(_numel(shapes[n]) for n in u.hf_names) * element) for u in units]
    by_key = {u.key: u for u in units}
    for keys in plan_buckets(sizes, bucket_bytes):
        bucket_units = [by_key[k] for k in keys]
        full: dict[str, torch.Tensor] = {}
        for unit in bucket_units:
            if unit.stage != layout.pp_rank:
                continue
            if unit.hf_names[0] in experts:
                local = torch.stack([select(params[lay.name]).detach() for lay in experts[unit.hf_names[0]]])
                full[unit.hf_names[0]] = _gather_experts(local, layout)
                continue
            lay = mine[unit.hf_names[0]]
            local = select(params[lay.name]).detach()
            full.update(_gather_tp(lay, local, shape, layout))
        if layout.pp > 1:
            _exchange_stages(bucket_units, full, shapes, layout, compute_device, param_dtype)
        bucket = []
        for unit in bucket_units:
            for name in unit.hf_names:
                tensor = full.pop(name)
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                bucket.append((name, tensor.to(device) if device is not None else tensor))
        yield bucket
        del bucket


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _gather_tp(
    lay: ParamLayout, local: torch.Tensor, shape: Qwen2Shape, layout: ParallelLayout
) -> dict[str, torch.Tensor]:
    if layout.tp == 1 or lay.shard_dim is None:
        return full_from_locals(lay, [local], shape) if layout.tp == 1 else {lay.hf_names[0]: local.clone()}
    parts = [torch.empty_like(local) for _ in range(layout.tp)]
    dist.all_gather(parts, local.contiguous(), group=layout.tp_group)
    return full_from_locals(lay, parts, shape)


def _gather_experts(local: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """``[E/EP, ...]`` experts of this EP rank joined over the EP group to ``[E, ...]`` (rank order)."""
    if layout.ep == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(layout.ep)]
    dist.all_gather(parts, local.contiguous(), group=layout.ep_group)
    return torch.cat(parts)


def _exchange_stages(
    units: list[Unit],
    full: dict[str, torch.Tensor],
    shapes: dict[str, tuple[int, ...]],
    layout: ParallelLayout,
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Broadcast each stage's part of the bucket to the other stages (fills ``full`` in place)."""
    for stage in range(layout.pp):
        names = [n for u in units if u.stage == stage for n in u.hf_names]
        if not names:
            continue
        if stage == layout.pp_rank:
            flat = torch.cat([full[n].reshape(-1).to(dtype) for n in names])
        else:
            flat = torch.empty(sum(_numel(shapes[n]) for n in names), dtype=dtype, device=device)
        dist.broadcast(flat, src=layout.pp_global_rank(stage), group=layout.pp_group)
        if stage != layout.pp_rank:
            offset = 0
            for n in names:
                count = _numel(shapes[n])
                full[n] = flat[offset : offset + count].view(shapes[n])
                offset += count
