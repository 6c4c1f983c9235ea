"""How :class:`~verity.engines.fsdp2.FSDP2Engine` picks its scoring functions: padded, packed or sequence-parallel.

:func:`sequence_parallel_scoring` returns the functions the engine's passes call. At ``s = 1``:
:func:`~verity.engines.packed.micro_batch_logprobs` / :func:`~verity.engines.packed.micro_batch_values`,
each micro-batch padded or packed (``fsdp2.packed``, :func:`~verity.engines.packed.prefer_packed`).
At ``s > 1`` it checks the model's heads, forms the SP groups
(:func:`verity.engines.ulysses.new_sequence_parallel_group`), switches the model's attention to
:data:`verity.engines.ulysses.ULYSSES_ATTENTION` around the packed layout's kernel and returns the
sequence-parallel forms (:mod:`verity.engines.ulysses_scoring`), which always pack: SP implies
the packed layout (:func:`sequence_parallel_packed`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from verity.engines.hf_loading import use_attention_kernel
from verity.engines.packed import micro_batch_logprobs, micro_batch_values, supports_packing
from verity.engines.packed_attention import packed_kernel
from verity.engines.ulysses import (
    ULYSSES_ATTENTION,
    SequenceParallelGroup,
    attach_sequence_parallel,
    new_sequence_parallel_group,
)
from verity.engines.ulysses_scoring import sp_response_logprobs, sp_response_values

__all__ = ["check_heads", "sequence_parallel_packed", "sequence_parallel_scoring"]


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """``ValueError`` (one sentence) unless ``size`` divides both the attention heads and the key/value heads."""
    if num_heads % size or num_kv_heads % size:
        raise ValueError(
            f"ulysses_sequence_parallel_size={size} must divide the model's {num_heads} attention heads and "
            f"its {num_kv_heads} key/value heads (each SP rank attends with heads/{size} of each)"
        )


def sequence_parallel_packed(packed: bool | None, size: int, module: nn.Module) -> bool | None:
    """The engine's ``packed`` setting under SP size ``size``: SP runs on the packed layout only.

    ``size`` 1: ``packed`` as given. Otherwise True; ``ValueError`` for ``packed=False`` or a
    ``module`` the packed layout does not take (a vision-language model, a non-HF model).
    """
    if size == 1:
        return packed
    if packed is False:
        raise ValueError(
            f"ulysses_sequence_parallel_size={size} splits the packed layout, so packed=false cannot be kept; "
            "unset packed or set the SP size to 1"
        )
    if not supports_packing(module):
        raise ValueError(
            f"ulysses_sequence_parallel_size={size} runs on the packed layout, which {type(module).__name__} "
            "does not take (a vision-language model, or not an HF model that dispatches attention by name)"
        )
    return True


def sequence_parallel_scoring(
    module: nn.Module, size: int, packed: bool, device: torch.device
) -> tuple[SequenceParallelGroup, Callable[..., Any], Callable[..., Any]]:
    """``(sp group, logprobs function, values function)`` for an engine's ``module``.

    ``size`` 1: no group; each micro-batch padded, or packed where ``packed`` and
    :func:`~verity.engines.packed.prefer_packed` say so. Otherwise a collective (every rank of the
    default process group forms the SP groups): ``ValueError`` when ``size`` does not divide the
    ranks, the heads or the key/value heads, or for a model the packed layout does not take (a
    vision-language model). The within-row attention run over the exchanged heads is the packed
    layout's kernel on ``device`` (:func:`~verity.engines.packed_attention.packed_kernel`:
    ``verity_packed_sdpa``, or flash-attn's variable-length kernel).
    """
    if size == 1:
        return (
            new_sequence_parallel_group(1),
            functools.partial(micro_batch_logprobs, packed=packed),
            functools.partial(micro_batch_values, packed=packed),
        )
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "num_attention_heads"):
        raise ValueError(
            f"ulysses_sequence_parallel_size={size} needs an HF transformer with attention heads"
        )
    if getattr(config, "vision_config", None) is not None:
        raise ValueError(
            f"ulysses_sequence_parallel_size={size}: vision-language models are not split by sequence yet"
        )
    heads = int(config.num_attention_heads)
    check_heads(heads, int(getattr(config, "num_key_value_heads", None) or heads), size)
    sequence_parallel_packed(packed, size, module)
    inner = packed_kernel(module, device)  # before the switch: the model's flash kernel, if it has one
    sp = new_sequence_parallel_group(size, inner)
    use_attention_kernel(module, ULYSSES_ATTENTION)
    attach_sequence_parallel(module, sp)  # also for a checkpointed layer's recomputation in backward
    return (
        sp,
        functools.partial(sp_response_logprobs, sp=sp),
        functools.partial(sp_response_values, sp=sp),
    )
