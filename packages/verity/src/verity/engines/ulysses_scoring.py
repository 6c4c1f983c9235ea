"""Log-probs, entropy and values of a micro-batch under Ulysses sequence parallelism.

:func:`sp_response_logprobs` and :func:`sp_response_values` take the arguments of
:func:`verity.engines.packed.packed_response_logprobs` and
:func:`verity.engines.packed.packed_response_values` and return the same ``[B, R]`` tensors, on
every rank of the SP group. They run on the packed layout (:mod:`verity.engines.packed`):

1. pack: :func:`~verity.engines.packed.pack_rows` (each row's real tokens back to back,
   ``[1, T]``, the row's own positions, labels the next token within the row);
2. :func:`split_for_sp`: pad ``T`` to a multiple of ``s`` with one extra row of padding tokens
   (attending to themselves only, scored and dropped) and keep this rank's contiguous chunk of
   ids, positions and labels, ``[1, T/s]`` (a chunk's last label is the next chunk's first token,
   taken from the whole packed sequence);
3. rank ``j`` runs the model on its chunk with the attention kernel
   :data:`verity.engines.ulysses.ULYSSES_ATTENTION` and the whole sequence's ``cu_seqlens`` (the
   attention exchanges heads for tokens, then attends within rows with the packed layout's kernel);
4. score its chunk's tokens, :func:`~verity.engines.ulysses.gather_sequence` them to ``[T]`` and
   read each response token's entry back into ``[B, R]`` with
   :func:`~verity.engines.packed.unpack_responses` (0 on padding).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from verity.data.vision_inputs import has_images
from verity.engines.logprobs import DEFAULT_CHUNK_TOKENS, logprobs_and_entropy_from_logits
from verity.engines.packed import PackedRows, pack_rows, unpack_responses, varlen_attention_kwargs
from verity.engines.ulysses import SequenceParallelGroup, gather_sequence, sequence_parallel, split_sequence

__all__ = ["SPChunk", "split_for_sp", "sp_response_logprobs", "sp_response_values"]


@dataclass(frozen=True)
class SPChunk:
    """This SP rank's share of a packed micro-batch.

    ``packed``: the whole micro-batch (:class:`~verity.engines.packed.PackedRows`, ``T`` tokens).
    ``input_ids``, ``position_ids``, ``labels``: ``[1, (T + pad) / s]`` int64, this rank's chunk of
    the sequence padded to a multiple of ``s``. ``cu_seqlens``: ``[n+1]`` int32 boundaries of the
    whole padded sequence (the padding, if any, is one more row). ``max_seqlen``: the longest row.
    """

    packed: PackedRows
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    pad: int

    def attention_kwargs(self) -> dict[str, Any]:
        """The forward kwargs every layer's attention reads: the whole sequence's row boundaries."""
        return varlen_attention_kwargs(self.cu_seqlens, self.max_seqlen)


def split_for_sp(packed: PackedRows, rank: int, size: int) -> SPChunk:
    """Pad ``packed`` to a multiple of ``size`` tokens and keep rank ``rank``'s contiguous chunk."""
    total = packed.total_tokens
    pad = (-total) % size
    ids, positions, labels, bounds = packed.input_ids, packed.position_ids, packed.labels, packed.cu_seqlens
    if pad:
        ids, labels = F.pad(ids, (0, pad)), F.pad(labels, (0, pad))
        extra = torch.arange(pad, device=positions.device, dtype=positions.dtype)[None]
        positions = torch.cat([positions, extra], dim=1)
        bounds = torch.cat([bounds, bounds.new_tensor([total + pad])])
    return SPChunk(
        packed=packed,
        input_ids=split_sequence(ids, rank, size),
        position_ids=split_sequence(positions, rank, size),
        labels=split_sequence(labels, rank, size),
        cu_seqlens=bounds,
        max_seqlen=max(packed.max_seqlen, pad),
        pad=pad,
    )


def _local_forward(
    model: nn.Module,
    micro_batch: Mapping[str, Any],
    sp: SequenceParallelGroup,
    layout: Mapping[str, torch.Tensor] | None,
) -> tuple[Any, SPChunk]:
    """Pack, split and run ``model`` on this rank's chunk: ``(output, chunk)``."""
    if has_images(micro_batch) or "pixel_values" in micro_batch:
        raise ValueError("Ulysses sequence parallelism does not take images (vision-language models)")
    chunk = split_for_sp(pack_rows(micro_batch, layout), sp.rank, sp.size)
    with sequence_parallel(sp):
        out = model(
            input_ids=chunk.input_ids,
            position_ids=chunk.position_ids,
            attention_mask=None,
            use_cache=False,
            **chunk.attention_kwargs(),
        )
    return out, chunk


def sp_response_logprobs(
    model: nn.Module,
    micro_batch: Mapping[str, Any],
    *,
    sp: SequenceParallelGroup,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = True,
    compiled_head: bool = False,
    layout: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~verity.engines.packed.packed_response_logprobs` over ``sp``'s ranks: ``(logprobs, entropy or None)``.

    The model (its attention set to :data:`~verity.engines.ulysses.ULYSSES_ATTENTION`) runs on
    this rank's ``T/s`` tokens; the results, ``[B, R]`` float32, are the whole micro-batch's on
    every SP rank, with autograd through this rank's share (see
    :func:`~verity.engines.ulysses.gather_sequence`). ``layout``: the micro-batch's host
    ``attention_mask`` the packing is planned from (:func:`~verity.engines.packed.pack_rows`).
    """
    out, chunk = _local_forward(model, micro_batch, sp, layout)
    response_len = int(micro_batch["responses"].shape[1])
    logprobs, entropy = logprobs_and_entropy_from_logits(
        out.logits[0],  # [T/s, V]
        chunk.labels[0],
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
        compiled_head=compiled_head,
    )
    logprobs = unpack_responses(gather_sequence(logprobs, sp.group), chunk.packed, response_len)
    if entropy is not None:
        entropy = unpack_responses(gather_sequence(entropy, sp.group), chunk.packed, response_len)
    return logprobs, entropy


def sp_response_values(
    model: nn.Module,
    inputs: Mapping[str, Any],
    *,
    sp: SequenceParallelGroup,
    layout: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`~verity.engines.packed.packed_response_values` over ``sp``'s ranks: ``[B, R]`` float32.

    The value of response token ``j`` is read at the position predicting it, like its log-prob.
    """
    out, chunk = _local_forward(model, inputs, sp, layout)
    values = getattr(out, "logits", out)
    if values.dim() == 3 and values.shape[-1] == 1:
        values = values.squeeze(-1)
    if values.shape != chunk.input_ids.shape:
        raise ValueError(
            f"value model output must be [1, T/s] or [1, T/s, 1] for a chunk of {chunk.input_ids.shape[1]} "
            f"tokens, got {tuple(values.shape)} (a critic needs a scalar head, e.g. num_labels=1)"
        )
    gathered = gather_sequence(values[0].float(), sp.group)
    return unpack_responses(gathered, chunk.packed, int(inputs["responses"].shape[1]))
