"""The HF rollout with its model split over a tensor-parallel (TP) group of ranks.

:class:`TensorParallelHFRollout` is :class:`~verity.rollout.hf_rollout.HFRollout`'s decode
loop over a Qwen2/Llama-style causal LM whose linear layers are split over the ranks of a
1-D :class:`~torch.distributed.device_mesh.DeviceMesh` with PyTorch's tensor-parallel API
(:func:`~torch.distributed.tensor.parallel.parallelize_module`): gloo on CPU, NCCL on GPUs,
the same code. What is split how (:func:`tensor_parallel_plan`; weight ``[out, in]``)::

    self_attn.q_proj/k_proj/v_proj   ColwiseParallel   W, b: Shard(0)   each rank: H/T query, H_kv/T key/value heads
    self_attn.o_proj                 RowwiseParallel   W: Shard(1)      partial sums, all-reduced
    mlp.gate_proj/up_proj            ColwiseParallel   W: Shard(0)      I/T of the MLP width
    mlp.down_proj                    RowwiseParallel   W: Shard(1)      partial sums, all-reduced
    model.embed_tokens               RowwiseParallel   W: Shard(0)      vocabulary-parallel, all-reduced
    lm_head                          ColwiseParallel   W: Shard(0)      all-gathered: whole logits [B, V] everywhere
    norms, rotary frequencies        not split (every rank holds them whole)

This is the rule of :func:`verity.resharding.tp_slice.tp_split_dim` (checked for every
parameter when the model is built), with ``torch.chunk`` parts along the split dimension
(DTensor's ``Shard``): equal parts when the size divides, else the last ranks get fewer
rows (a vocabulary of 101 over 2 ranks: 51 + 50 rows). Query and key/value heads must
divide over the ranks (:func:`check_tensor_parallel_size`). The attention reshapes its
projections with ``-1`` heads, so it runs on the local heads unchanged, the grouped CPU
attention (:mod:`verity.rollout.gqa_attention`) included: both read the group size ``H/H_kv``,
which is the same locally.

Lockstep: every rank of the group is called with the same prompts, sampling parameters and
seed. The logits come out of the last all-gather as the same bytes on every rank (the
all-reduces also hand every rank the same sums), so the same generator state draws the same
tokens everywhere, and the decode loop's data-dependent steps (a row finishing at EOS, the
compaction of finished rows, the early stop) happen at the same step on every rank: each
rank issues the same collectives in the same order. :meth:`TensorParallelHFRollout.generate`
checks the prompts, parameters and generator state agree across the group first (one small
all-gather) and raises rather than hang.

Memory: :func:`build_tensor_parallel_model` builds the model on the ``meta`` device,
parallelizes it there and gives each rank storage for its shards only, so no rank ever holds
the whole model: a rank holds ``1/T`` of the split weights plus the (small) norms. Weights
arrive through :meth:`~TensorParallelHFRollout.load_weights`, full or already sliced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from os import PathLike
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from verity.resharding.tp_slice import tp_split_dim
from verity.rollout.hf_rollout import HFRollout
from verity.rollout.replica_lockstep import check_replica_lockstep
from verity.rollout.sampling import SamplingParams

__all__ = [
    "TensorParallelHFRollout",
    "build_tensor_parallel_model",
    "check_tensor_parallel_size",
    "local_shard",
    "tensor_parallel_plan",
]

_ATTENTION = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
_MLP = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The TP plan of a Qwen2/Llama-style causal LM: module name -> parallel style (module docstring).

    Raises ValueError when a decoder layer lacks one of the projections the plan splits, or the
    embeddings are not named ``embed_tokens`` / ``lm_head`` (the names the slicing rule knows).
    """
    names = {id(module): name for name, module in model.named_modules()}
    block_types = set(getattr(model, "_no_split_modules", None) or [])  # HF names its decoder layers here
    layers = [m for m in model.modules() if type(m).__name__ in block_types]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found to split for tensor parallelism")
    plan: dict[str, ParallelStyle] = {}
    for layer in layers:
        prefix = names[id(layer)]
        for block, styles in (("self_attn", _ATTENTION), ("mlp", _MLP)):
            for leaf, style in styles.items():
                name = f"{prefix}.{block}.{leaf}"
                if not isinstance(_submodule(model, name), nn.Linear):
                    raise ValueError(
                        f"{type(model).__name__}: tensor parallelism needs Qwen2/Llama-style layers, "
                        f"and {name} is not an nn.Linear"
                    )
                plan[name] = ColwiseParallel() if style == "colwise" else RowwiseParallel()
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    embed_name, head_name = names.get(id(embed), ""), names.get(id(head), "")
    if not embed_name.endswith("embed_tokens") or not head_name.endswith("lm_head"):
        raise ValueError(
            f"{type(model).__name__}: expected embeddings named *embed_tokens and *lm_head, "
            f"got {embed_name!r} and {head_name!r}"
        )
    plan[embed_name] = RowwiseParallel(input_layouts=Replicate())  # vocabulary-parallel, weight Shard(0)
    plan[head_name] = ColwiseParallel(output_layouts=Replicate())  # every rank gets the whole logits
    return plan


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def check_tensor_parallel_size(config: Any, tp_size: int) -> None:
    """Raise ValueError unless ``tp_size`` divides the model's query heads and key/value heads."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    if tp_size < 1 or heads % tp_size or kv_heads % tp_size:
        raise ValueError(
            f"tensor-parallel size {tp_size} must divide the model's {heads} attention heads and "
            f"{kv_heads} key/value heads"
        )


def build_tensor_parallel_model(
    source: Any | str | PathLike,
    tp_mesh: DeviceMesh,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    attn_implementation: str | None = "sdpa",
) -> PreTrainedModel:
    """An ``AutoModelForCausalLM`` of ``source`` split over ``tp_mesh``, its weights uninitialised.

    ``source``: an HF config, or a model folder (its ``config.json`` is read, no weights).
    ``tp_mesh``: the 1-D mesh of the TP group. ``device``: where this rank's shards live
    (default: the mesh's device type, the current accelerator). The model is built on ``meta``,
    parallelized there (:func:`tensor_parallel_plan`), then each rank's local shards and the
    unsplit parameters get storage of ``dtype`` on ``device``: at no point does a rank allocate
    a whole split weight. The rotary frequencies (non-persistent buffers) are computed from the
    config. Fill the weights with :meth:`TensorParallelHFRollout.load_weights`; the model is in
    eval mode with ``requires_grad`` off.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if tp_mesh.ndim != 1:
        raise ValueError(f"the tensor-parallel mesh must be 1-D, got a {tp_mesh.ndim}-D mesh")
    config = source
    if isinstance(source, str | PathLike):
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    check_tensor_parallel_size(config, tp_mesh.size())
    device = torch.device(device) if device is not None else _mesh_device(tp_mesh)
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model))
    if tied:  # parallelize_module split the shared weight twice: share the embedding's split again
        embed, head = model.get_input_embeddings().weight, model.get_output_embeddings()
        assert embed.placements == head.weight.placements and embed.shape == head.weight.shape
        head.weight = embed
    _check_matches_slicing_rule(model)
    _materialize(model, device)
    return model.eval()


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, getattr(torch, mesh.device_type).current_device())


def _check_matches_slicing_rule(model: nn.Module) -> None:
    """Every parameter is split the way :func:`~verity.resharding.tp_slice.tp_split_dim` slices it."""
    for name, param in model.named_parameters(remove_duplicate=False):
        placement = param.placements[0] if isinstance(param, DTensor) else Replicate()
        dim = placement.dim % param.dim() if isinstance(placement, Shard) else None
        if dim != tp_split_dim(name):
            raise ValueError(
                f"{name}: the TP plan splits it along {dim}, the slicing rule along {tp_split_dim(name)}"
            )


@torch.no_grad()
def _materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter (a DTensor's local shard, or a whole unsplit one) empty storage on
    ``device``, keeping shared parameters shared, and compute the rotary buffers."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                if isinstance(param, DTensor):
                    local = torch.empty(param.to_local().shape, dtype=param.dtype, device=device)
                    value = DTensor.from_local(
                        local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                    )
                else:
                    value = torch.empty(param.shape, dtype=param.dtype, device=device)
                done[id(param)] = nn.Parameter(value, requires_grad=False)
            module._parameters[name] = done[id(param)]
    for module_name, module in model.named_modules():
        rotary = "RotaryEmbedding" in type(module).__name__ and hasattr(module, "original_inv_freq")
        if rotary:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            rope = getattr(module, "compute_default_rope_parameters", None)
            rope = rope if module.rope_type == "default" else ROPE_INIT_FUNCTIONS[module.rope_type]
            inv_freq, _ = rope(module.config)  # as transformers' _init_weights computes them
            module._buffers["inv_freq"] = inv_freq.to(device)
            module._buffers["original_inv_freq"] = inv_freq.clone().to(device)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                raise ValueError(f"{module_name}.{name}: a buffer this builder cannot compute on its own")


def local_shard(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` (the whole tensor) for parameter ``like`` (a DTensor or a plain tensor).

    ``Shard(d)`` over ``T`` ranks: rank ``r`` gets rows ``[r*c, min((r+1)*c, n))`` of dimension ``d``
    (``n`` rows, ``c = ceil(n/T)``), ``torch.chunk``'s parts and DTensor's; anything else: ``full``.
    Returns a view of ``full``.
    """
    if not isinstance(like, DTensor) or not isinstance(like.placements[0], Shard):
        return full
    dim = like.placements[0].dim % full.dim()
    size, ranks, rank = full.shape[dim], like.device_mesh.size(), like.device_mesh.get_local_rank()
    chunk = -(-size // ranks)
    start = min(rank * chunk, size)
    return full.narrow(dim, start, min(size, start + chunk) - start)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


class TensorParallelHFRollout(HFRollout):
    """:class:`HFRollout` over a model split across ``tp_mesh`` (see the module docstring).

    ``model``: built by :func:`build_tensor_parallel_model` over the same ``tp_mesh`` (or
    parallelized likewise), its weights taken as filled; :meth:`from_config` builds one and
    marks every weight unfilled until :meth:`load_weights`. Every rank of the group constructs the
    engine with the same arguments (the same ``seed``) and calls :meth:`generate` with the same
    batch; each returns the same tokens. ``name`` stays ``hf``: the engine that ran is HF's.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        tp_mesh: DeviceMesh,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        pad_token_id: int | None = None,
        eos_token_ids: int | Sequence[int] | None = None,
    ) -> None:
        meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
        if meshes != {tp_mesh}:
            raise ValueError(
                "TensorParallelHFRollout: the model's weights must be split over tp_mesh "
                "(build it with build_tensor_parallel_model)"
            )
        super().__init__(
            model,
            tokenizer,
            sampling=sampling,
            seed=seed,
            pad_token_id=pad_token_id,
            eos_token_ids=eos_token_ids,
        )
        self.tp_mesh = tp_mesh
        self.tensor_parallel_size = tp_mesh.size()
        self.tensor_parallel_rank = tp_mesh.get_local_rank()
        self._host: dict[int, torch.Tensor] = {}  # id(parameter): its local shard, offloaded while asleep

    @classmethod
    def from_config(
        cls,
        source: Any | str | PathLike,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        tp_mesh: DeviceMesh,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> TensorParallelHFRollout:
        """The engine over :func:`build_tensor_parallel_model` of ``source`` (a config or a model folder).

        ``kwargs``: the constructor's (``sampling``, ``seed``, ``pad_token_id``, ``eos_token_ids``).
        Its weights are unfilled: :attr:`needs_weight_sync` is True until :meth:`load_weights`
        has filled every one.
        """
        model = build_tensor_parallel_model(source, tp_mesh, dtype=dtype, device=device)
        engine = cls(model, tokenizer, tp_mesh=tp_mesh, **kwargs)
        engine._stale = {id(p) for p in engine._parameters()}
        return engine

    # ------------------------------------------------------------------ generate

    def _decode(self, prompt_ids, prompt_mask, params, images=None, recorder=None):  # type: ignore[override]
        """:meth:`HFRollout._decode` after checking that the group's ranks agree on what to decode."""
        if images is not None:
            raise NotImplementedError("the tensor-parallel HF rollout takes text prompts only")
        self._check_lockstep(prompt_ids, prompt_mask, params)
        return super()._decode(prompt_ids, prompt_mask, params, images, recorder)

    def check_prefill_lockstep(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> None:
        """Before a request scheduler's prefill (:mod:`verity.rollout.hf_requests`): raise on every
        rank unless the ranks admit the same contexts with the same parameters and generator state."""
        self._check_lockstep(prompt_ids, prompt_mask, params)

    def _check_lockstep(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> None:
        """Raise on every rank when the ranks' prompts, sampling parameters or generator states differ."""
        parts = (
            repr(tuple(prompt_ids.shape)).encode(),
            prompt_ids.long().cpu().numpy().tobytes(),
            prompt_mask.long().cpu().numpy().tobytes(),
            repr(sorted(params.to_dict().items())).encode(),
            self._generator.get_state().cpu().numpy().tobytes(),
        )
        check_replica_lockstep(self.tp_mesh, self.device, parts, "tensor-parallel HF rollout")

    # ------------------------------------------------------------------ weights and memory

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy ``(name, tensor)`` pairs into this rank's shards; returns the number copied.

        ``name``: an HF state-dict name. ``tensor``: this rank's slice (the local shard's shape,
        as :func:`verity.resharding.slice_for_tp` cuts it) or the whole tensor (the parameter's
        full shape; this rank's part is taken, :func:`local_shard`); dtype and device converted.
        A tied ``lm_head`` is filled with ``model.embed_tokens.weight``. Raises KeyError for an
        unknown name, ValueError for a tensor of neither shape.
        """
        targets = self.model.state_dict(keep_vars=True)
        head, embed = self.model.get_output_embeddings(), self.model.get_input_embeddings()
        tied_apart = (
            bool(getattr(self.model.config, "tie_word_embeddings", False)) and head.weight is not embed.weight
        )
        loaded = 0
        for name, tensor in named_tensors:
            target = targets.get(name)
            if target is None:
                raise KeyError(f"load_weights: the rollout model has no parameter named {name!r}")
            local = _local(target)
            if tuple(tensor.shape) == tuple(target.shape):
                tensor = local_shard(tensor, target)
            elif tuple(tensor.shape) != tuple(local.shape):
                raise ValueError(
                    f"load_weights[{name!r}]: expected shape {tuple(target.shape)} (whole) or "
                    f"{tuple(local.shape)} (this rank's slice), got {tuple(tensor.shape)}"
                )
            copies = [target, head.weight] if tied_apart and target is embed.weight else [target]
            for param in copies:
                _local(param).copy_(tensor.detach().to(device=local.device, dtype=local.dtype))
                self._stale.discard(id(param))
            loaded += 1
            del tensor
        return loaded

    def weight_bytes(self) -> int:
        """Bytes of weight storage this rank holds now: its shards plus the unsplit parameters (0 asleep)."""
        return sum(_local(p).untyped_storage().nbytes() for p in self._parameters())

    def sleep(self) -> None:
        """Give the local shards' memory back until the next weight sync.

        On a CPU each local shard's storage is released (shape and dtype kept): :meth:`wake`
        gives it storage again and :attr:`needs_weight_sync` stays True until :meth:`load_weights`
        has filled every parameter. On an accelerator each shard is copied to host memory first
        and :meth:`wake` copies it back. Buffers (rotary frequencies) are kept.
        """
        if self._released or self._host:
            return
        offload = self.device.type != "cpu"
        for param in self._parameters():
            local = _local(param)
            if offload:
                self._host[id(param)] = local.to("cpu", copy=True)
            else:
                self._released[id(param)] = (local.shape, local.dtype)
            local.untyped_storage().resize_(0)
        accelerator = getattr(torch, self.device.type, None) if offload else None
        if accelerator is not None and hasattr(accelerator, "empty_cache"):
            accelerator.empty_cache()

    def wake(self) -> None:
        """Undo :meth:`sleep`: shards copied back to the device, or released ones given storage (unfilled)."""
        for param in self._parameters():
            local = _local(param)
            if id(param) in self._released or id(param) in self._host:
                local.untyped_storage().resize_(local.numel() * local.element_size())
            if id(param) in self._host:
                local.copy_(self._host[id(param)])
            elif id(param) in self._released:
                self._stale.add(id(param))
        self._released, self._host = {}, {}
