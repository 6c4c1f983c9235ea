r"""Merged weights of a model with LoRA adapters, gathered bucket by bucket under the plain HF names.

A rollout engine serves the plain HF model. A model trained with LoRA holds, for each
adapted linear layer ``X``, the frozen ``X.base_layer.weight`` :math:`W` and the adapters
``X.lora_A.<adapter>.weight`` :math:`A`, ``X.lora_B.<adapter>.weight`` :math:`B` with scale
:math:`s`. What the rollout needs is ``X.weight`` :math:`= W + s\,BA` (and ``X.bias`` from
``X.base_layer.bias``); every other weight passes under its own name. So the stream here
has exactly the names and shapes of the base model: a rollout that took full weights
before takes these unchanged.

Like :func:`~verity.resharding.gather.iter_full_state_dict_buckets` this is a collective on
an FSDP2-sharded module (every rank consumes every bucket); ``A`` and ``B`` are gathered
beside their base weight, and the merge runs on the gathered tensors
(:func:`merge_lora_weight`, peft's operations in peft's order). Peak extra memory: one
bucket of merged weights plus one layer's adapters.

Layers are recognised by their structure (``base_layer``, ``lora_A``, ``lora_B``,
``scaling``), not by importing ``peft``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from verity.resharding.gather import DEFAULT_BUCKET_BYTES, _full_bytes, _to_full, named_weights, plan_buckets

__all__ = ["LoRASource", "iter_merged_weight_buckets", "lora_sources", "merge_lora_weight"]

BASE = ".base_layer."


@torch.no_grad()
def merge_lora_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float
) -> torch.Tensor:
    """``W + scale * (B @ A)`` in ``weight``'s dtype (computed in float32 when that dtype is lower).

    Args:
        weight: the base weight ``[out, in]``.
        lora_a: ``A`` ``[r, in]``.
        lora_b: ``B`` ``[out, r]``.
        scale: ``alpha / r``.

    The operations, in their order, are those of ``peft``'s own merge (``(B @ A) * s``, then
    added to ``W``), so in float32 the result is bit-identical to ``merge_and_unload``.
    """
    fits = lora_a.shape[1] == weight.shape[1] and lora_b.shape[0] == weight.shape[0]
    if not fits or lora_a.shape[0] != lora_b.shape[1]:
        raise ValueError(
            f"LoRA shapes A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)} do not fit weight {tuple(weight.shape)}"
        )
    compute = torch.float32 if weight.dtype in (torch.float16, torch.bfloat16) else weight.dtype
    delta = (lora_b.to(compute) @ lora_a.to(compute)) * scale
    return (weight.to(compute) + delta).to(weight.dtype)


@dataclass(frozen=True)
class LoRASource:
    """Where the merged weight of one adapted layer comes from (names relative to the module)."""

    layer: str  # the adapted layer, e.g. model.layers.0.self_attn.q_proj
    base: str  # {layer}.base_layer.weight
    lora_a: str  # {layer}.lora_A.{adapter}.weight
    lora_b: str  # {layer}.lora_B.{adapter}.weight
    scale: float  # alpha / r


def lora_sources(module: nn.Module, adapter: str = "default") -> dict[str, LoRASource]:
    """``{merged weight name: LoRASource}`` for every LoRA layer of ``module`` (e.g.
    ``model.layers.0.self_attn.q_proj.weight``). Empty for a model without adapters."""
    out: dict[str, LoRASource] = {}
    for name, sub in module.named_modules():
        if not (hasattr(sub, "base_layer") and hasattr(sub, "lora_A") and hasattr(sub, "lora_B")):
            continue
        if adapter not in sub.lora_A:
            raise KeyError(f"LoRA layer {name!r} has no adapter {adapter!r} (has {sorted(sub.lora_A)})")
        if getattr(sub, "merged", False):
            raise RuntimeError(f"LoRA layer {name!r} is merged in place; merged weights would count it twice")
        if getattr(sub, "fan_in_fan_out", False):
            raise NotImplementedError(
                f"LoRA layer {name!r}: fan_in_fan_out (Conv1D) weights are not supported"
            )
        out[f"{name}.weight"] = LoRASource(
            layer=name,
            base=f"{name}.base_layer.weight",
            lora_a=f"{name}.lora_A.{adapter}.weight",
            lora_b=f"{name}.lora_B.{adapter}.weight",
            scale=float(sub.scaling[adapter]),
        )
    return out


def plain_name(name: str) -> str | None:
    """The base model's name of a weight of the adapted model (``None`` for an adapter weight)."""
    if any(part.startswith("lora_") for part in name.split(".")):
        return None
    return name.replace(BASE, ".")


def iter_merged_weight_buckets(
    module: nn.Module,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    adapter: str = "default",
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield the merged model's full weights, one bucket (a list of ``(plain HF name, tensor)``) at a time.

    Args:
        module: an HF model with ``peft`` LoRA layers injected (plain or FSDP2-sharded).
        bucket_bytes: bucket capacity in bytes of the output dtype.
        dtype: cast floating-point tensors to it after merging (e.g. bfloat16 for the rollout).
        device: where the full tensors go (default: where they were gathered).
        adapter: the adapter merged.

    Collective on sharded modules: every rank must consume every bucket.
    """
    target_device = torch.device(device) if device is not None else None
    sources = lora_sources(module, adapter)
    weights = dict(named_weights(module))
    plan_sizes: list[tuple[str, int]] = []
    origin: dict[str, str] = {}
    for name, tensor in weights.items():
        plain = plain_name(name)
        if plain is None:
            continue
        origin[plain] = name
        plan_sizes.append((plain, _full_bytes(tensor, dtype)))
    for names in plan_buckets(plan_sizes, bucket_bytes):
        bucket = []
        for plain in names:
            source = sources.get(plain)
            if source is None:
                full = _to_full(weights[origin[plain]], dtype, target_device)
            else:
                merged = merge_lora_weight(
                    _to_full(weights[source.base], None, None),
                    _to_full(weights[source.lora_a], None, None),
                    _to_full(weights[source.lora_b], None, None),
                    source.scale,
                )
                full = _to_full(merged, dtype, target_device)
            bucket.append((plain, full))
        yield bucket
        del bucket
