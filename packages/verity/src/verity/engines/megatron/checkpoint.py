"""The Megatron engine's ``torch.distributed.checkpoint`` state, keyed by HF names.

Each rank's Megatron parameters (and their AdamW moments) are cut into pieces of the
full HF tensors (:func:`verity.engines.megatron.convert.local_pieces`) and saved as
``DTensor`` s over a ``(dp, tp)`` device mesh of the rank's pipeline stage:
``Shard(dim)`` along tensor parallelism, ``Replicate`` along data parallelism
(replicated tensors are plain tensors, which DCP also deduplicates). So the files
hold the model as HF names with full HF shapes:

    model.model.layers.0.self_attn.q_proj.weight       [H*D, hidden]
    optimizer.state.model.layers.0.self_attn.q_proj.weight.exp_avg
    optimizer.state.model.layers.0.self_attn.q_proj.weight.step
    optimizer.param_groups.0.lr ...                     (hyper-parameters, no param lists)
    lr_scheduler..., global_step

A mixture-of-experts layer's ``mlp.experts.gate_up_proj`` / ``down_proj`` ``[E, ...]`` is
saved as a ``DTensor`` over an ``(expert dp, ep)`` mesh, ``Shard(0)`` along expert
parallelism: each EP rank's piece is the stack of its ``E / EP`` experts (AdamW moments
likewise), so an EP=2 checkpoint loads at EP=1 and back.

Consequences: DCP reshards on load, so a checkpoint written at one TP/PP/DP layout
loads at another; ``verity.checkpoint.export.export_hf`` reads the ``model.*`` keys
as they are (no Megatron names ever reach the files).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from verity.engines.megatron.convert import ParamLayout, join_pieces, local_pieces
from verity.engines.megatron.model import Qwen2Shape
from verity.engines.megatron.parallel import ParallelLayout

MOMENTS = ("exp_avg", "exp_avg_sq")


class StageMesh:
    """The ``(dp, tp)`` device mesh of this rank's pipeline stage, built lazily (a collective)."""

    def __init__(self, layout: ParallelLayout, device_type: str) -> None:
        self.layout = layout
        self.device_type = device_type
        self._mesh: Any = None

    def get(self) -> Any:
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            lay = self.layout
            full = init_device_mesh(
                self.device_type, (lay.pp, lay.dp, lay.tp), mesh_dim_names=("pp", "dp", "tp")
            )
            self._mesh = full["dp", "tp"]
        return self._mesh


class ExpertMesh:
    """The ``(expert dp, ep)`` device mesh of this rank's pipeline stage, built lazily (a collective)."""

    def __init__(self, layout: ParallelLayout, device_type: str) -> None:
        self.layout = layout
        self.device_type = device_type
        self._mesh: Any = None

    def get(self) -> Any:
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            lay = self.layout
            full = init_device_mesh(
                self.device_type, (lay.pp, lay.dp // lay.ep, lay.ep), mesh_dim_names=("pp", "edp", "ep")
            )
            self._mesh = full["edp", "ep"]
        return self._mesh


def _experts_saved(stack: torch.Tensor, hf_shape: tuple[int, ...], layout: ParallelLayout, mesh: ExpertMesh) -> Any:
    """This EP rank's experts ``[E/EP, ...]`` as DCP should see them: a ``Shard(0)`` ``DTensor`` under EP."""
    stack = stack.detach().contiguous()
    if layout.ep == 1:
        return stack
    from torch.distributed.tensor import DTensor, Replicate, Shard

    stride = torch.empty(hf_shape, device="meta").stride()
    return DTensor.from_local(
        stack, mesh.get(), [Replicate(), Shard(0)], run_check=False, shape=torch.Size(hf_shape), stride=stride
    )


def expert_groups(layouts: list[ParamLayout]) -> dict[str, list[ParamLayout]]:
    """This rank's expert parameters by HF tensor, in expert order (empty for a dense model)."""
    out: dict[str, list[ParamLayout]] = {}
    for lay in sorted((lay for lay in layouts if lay.kind == "expert"), key=lambda lay: lay.expert or 0):
        out.setdefault(lay.hf_names[0], []).append(lay)
    return out


def _as_saved(
    piece: torch.Tensor, hf_shape: tuple[int, ...], dim: int | None, layout: ParallelLayout, mesh: StageMesh
) -> torch.Tensor:
    """A piece as DCP should see it: a ``DTensor`` when it is a TP shard, else a plain tensor."""
    piece = piece.detach().contiguous()
    if dim is None or layout.tp == 1:
        return piece
    from torch.distributed.tensor import DTensor, Replicate, Shard

    stride = torch.empty(hf_shape, device="meta").stride()
    return DTensor.from_local(
        piece,
        mesh.get(),
        [Replicate(), Shard(dim)],
        run_check=False,
        shape=torch.Size(hf_shape),
        stride=stride,
    )


def _local_of(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's per-parameter state (zeros, step 0) where it does not exist yet, as AdamW would."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if len(state) == 0:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def build_state(
    model: nn.Module,
    layouts: list[ParamLayout],
    shape: Qwen2Shape,
    hf_shapes: Mapping[str, tuple[int, ...]],
    layout: ParallelLayout,
    mesh: StageMesh,
    optimizer: torch.optim.Optimizer | None,
    expert_mesh: ExpertMesh | None = None,
) -> dict[str, Any]:
    """``{"model": {hf_name: tensor}, "optimizer": {...}}`` for this rank (see the module docstring)."""
    params = dict(model.named_parameters())
    model_sd: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    if optimizer is not None:
        ensure_adam_state(optimizer)
    for name, group in expert_groups(layouts).items():
        assert expert_mesh is not None, "a mixture-of-experts model needs an ExpertMesh"
        members = [params[lay.name] for lay in group]
        model_sd[name] = _experts_saved(torch.stack([p.detach() for p in members]), hf_shapes[name], layout, expert_mesh)
        if optimizer is not None:
            states = [optimizer.state[p] for p in members]
            entry = {
                m: _experts_saved(torch.stack([st[m] for st in states]), hf_shapes[name], layout, expert_mesh)
                for m in MOMENTS
            }
            entry["step"] = states[0]["step"].detach().clone()
            optim_state[name] = entry
    for lay in layouts:
        if lay.kind == "expert":
            continue
        param = params[lay.name]
        for name, piece in local_pieces(lay, param.detach(), shape, layout.tp, layout.tp_rank).items():
            model_sd[name] = _as_saved(piece, hf_shapes[name], lay.shard_dim, layout, mesh)
        if optimizer is None:
            continue
        state = optimizer.state[param]
        moments = {m: local_pieces(lay, state[m], shape, layout.tp, layout.tp_rank) for m in MOMENTS}
        for name in lay.hf_names:
            entry = {
                m: _as_saved(moments[m][name], hf_shapes[name], lay.shard_dim, layout, mesh) for m in MOMENTS
            }
            entry["step"] = state["step"].detach().clone()
            optim_state[name] = entry
    out: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        out["optimizer"] = {"state": optim_state, "param_groups": groups}
    return out


@torch.no_grad()
def restore_state(
    state: Mapping[str, Any],
    model: nn.Module,
    layouts: list[ParamLayout],
    shape: Qwen2Shape,
    layout: ParallelLayout,
    optimizer: torch.optim.Optimizer | None,
) -> None:
    """Copy a state filled by ``dcp.load`` back into the parameters (and AdamW state) of this rank."""
    params = dict(model.named_parameters())
    model_sd = state["model"]
    optim = state.get("optimizer") if optimizer is not None else None
    for name, group in expert_groups(layouts).items():
        stack = _local_of(model_sd[name])
        entry = optim["state"][name] if optim is not None else None
        for j, lay in enumerate(group):
            param = params[lay.name]
            param.copy_(stack[j])
            if entry is None:
                continue
            target = optimizer.state[param]
            for m in MOMENTS:
                target[m].copy_(_local_of(entry[m])[j])
            target["step"] = entry["step"].detach().clone().float()
    for lay in layouts:
        if lay.kind == "expert":
            continue
        param = params[lay.name]
        pieces = {n: _local_of(model_sd[n]) for n in lay.hf_names}
        param.copy_(join_pieces(lay, pieces, shape, layout.tp, param.shape))
        if optim is None:
            continue
        entries = [optim["state"][n] for n in lay.hf_names]
        target = optimizer.state[param]
        for m in MOMENTS:
            value = join_pieces(
                lay,
                {n: _local_of(e[m]) for n, e in zip(lay.hf_names, entries, strict=True)},
                shape,
                layout.tp,
                param.shape,
            )
            target[m].copy_(value)
        target["step"] = entries[0]["step"].detach().clone().float()
    if optim is not None:
        for group, saved in zip(optimizer.param_groups, optim["param_groups"], strict=True):
            for key, value in saved.items():
                group[key] = value
