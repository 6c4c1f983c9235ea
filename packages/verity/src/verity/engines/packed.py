"""The packed (padding-free) layout: a micro-batch's real tokens back to back in one sequence.

The verl layout pads: ``input_ids [B, P+R]`` is a left-padded prompt (width ``P``) and a
right-padded response ``responses [B, R]``, so a micro-batch costs ``B x window`` positions
however short most of its rows are. Packed, row ``i``'s real tokens (its first real prompt
token to its last real response token, ``L_i`` of them) sit at ``cu[i] .. cu[i+1]-1`` of one
``[1, T]`` sequence, ``T = sum_i L_i``, with the row's own position ids, and attention is
kept inside each row (:mod:`verity.engines.packed_attention`). Every token sees exactly the
keys it sees in its padded row, at the same positions, so log-probs, entropy, values and
gradients equal the padded layout's up to float rounding, while a micro-batch costs its
real tokens only.

Only the positions that predict a response token need the vocabulary head: position
``P-1+j`` of a padded row (the token before response token ``j``) is packed position
``cu[i] + (P-1-s_i) + j`` for a row whose first real column is ``s_i``; those ``N``
positions (:attr:`PackedRows.predict_index`) go to the model's ``logits_to_keep`` as an
index, so the head runs on ``N`` rows, not ``T``.

Packing needs each row's real tokens to be contiguous and, when the row has a response,
its last prompt column real (:func:`packable`); the verl layout always is. Other
micro-batches, and those with images, keep the padded path.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from verity.data.vision_inputs import has_images
from verity.engines.logprobs import (
    DEFAULT_CHUNK_TOKENS,
    _accepts_logits_to_keep,
    logprobs_and_entropy_from_logits,
    padding_free_window,
    response_logprobs,
)
from verity.engines.packed_attention import PACKED_KERNELS, packed_attention, packed_kernel
from verity.engines.shared_prompt import find_prompt_groups, grouped_positions, should_share_prompts
from verity.engines.values import response_values

__all__ = [
    "PackedRows",
    "micro_batch_logprobs",
    "micro_batch_values",
    "packable",
    "packed_response_logprobs",
    "packed_response_values",
    "pack_rows",
    "prefer_packed",
    "resolve_packed",
    "supports_packing",
    "unpack_kept",
    "unpack_responses",
    "varlen_attention_kwargs",
]


@dataclass(frozen=True)
class PackedRows:
    """A micro-batch of ``B`` rows packed into one sequence of ``T`` tokens.

    Attributes:
        input_ids: ``[1, T]`` int64: each row's real tokens (first real prompt token .. last
            real response token) back to back, in row order.
        position_ids: ``[1, T]`` int64: each token's position id in its padded row (the rows'
            own positions, restarting per row).
        cu_seqlens: ``[B+1]`` int32 on the model's device: row ``i`` occupies
            ``[cu[i], cu[i+1])`` (empty for a row with no real token).
        max_seqlen: the longest row, in tokens.
        labels: ``[1, T]`` int64: the next token within the row (0 at each row's last position).
        predict_index: ``[N]`` int64: the packed positions that predict a real response token,
            row by row (response token ``j`` of row ``i`` is predicted at its predecessor's position).
        response_rows, response_cols: ``[N]`` int64: where each of those goes in ``[B, R]``.
        seqlens: the ``B`` row lengths, in host memory (for planning; no device sync).
        batch_size: ``B``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    labels: torch.Tensor
    predict_index: torch.Tensor
    response_rows: torch.Tensor
    response_cols: torch.Tensor
    seqlens: tuple[int, ...]
    batch_size: int

    @property
    def total_tokens(self) -> int:
        """``T``: the tokens the packed pass computes."""
        return int(self.input_ids.shape[1])

    def attention_kwargs(self) -> dict[str, Any]:
        """The forward kwargs transformers hands to every layer's attention (``cu_seq_lens_q`` ...)."""
        return varlen_attention_kwargs(self.cu_seqlens, self.max_seqlen)


def varlen_attention_kwargs(cu_seqlens: torch.Tensor, max_seqlen: int) -> dict[str, Any]:
    """transformers' variable-length attention kwargs for rows ``[cu[i], cu[i+1])`` (``[n+1]``), the longest ``max_seqlen``."""
    return {
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max_seqlen,
        "max_length_k": max_seqlen,
    }


def packable(attention_mask: torch.Tensor, response_len: int) -> bool:
    """Whether every row's real tokens are contiguous and a row with a response has its last prompt column real.

    ``attention_mask``: ``[B, P+R]`` (a host copy avoids a device sync). Such rows pack
    exactly; the verl layout (left-padded prompt, right-padded response) always does.
    """
    real = attention_mask.bool()
    width = real.shape[1]
    columns = torch.arange(width)
    count = real.sum(1)
    first = torch.where(real, columns, width).min(1).values
    last = torch.where(real, columns, -1).max(1).values
    contiguous = (count == 0) | (last - first + 1 == count)
    prompt_len = width - response_len
    has_response = real[:, prompt_len:].any(1)
    return bool((contiguous & (~has_response | real[:, prompt_len - 1])).all())


def pack_rows(micro_batch: Mapping[str, Any], layout: Mapping[str, torch.Tensor] | None = None) -> PackedRows:
    """Pack a micro-batch's rows (the verl layout) into one sequence; see :class:`PackedRows`.

    Args:
        micro_batch: ``input_ids``, ``attention_mask``, ``position_ids`` ``[B, P+R]`` and
            ``responses [B, R]`` on the model's device.
        layout: the micro-batch's ``attention_mask`` in host memory
            (:func:`verity.engines.micro_batches.host_layout`): the index tensors are planned
            from it without waiting on the device; default: the micro-batch's own.

    Raises ``ValueError`` when the rows hold no real token or do not pack (:func:`packable`).
    """
    input_ids = micro_batch["input_ids"]
    device = input_ids.device
    response_len = int(micro_batch["responses"].shape[1])
    mask = (micro_batch if layout is None else layout)["attention_mask"]
    real = mask.bool().cpu()
    if not packable(real, response_len):
        raise ValueError("the micro-batch's rows do not pack: real tokens must be contiguous per row")
    rows, width = real.shape
    prompt_len = width - response_len
    seqlens = real.sum(1)
    total = int(seqlens.sum())
    if total == 0:
        raise ValueError("the micro-batch has no real token to pack")
    cu = F.pad(seqlens.cumsum(0), (1, 0))
    flat = real.reshape(-1).nonzero().squeeze(1)  # real tokens, row by row, column by column
    packed_at = (real.reshape(-1).cumsum(0) - 1).reshape(rows, width)  # packed index of each real cell
    # response token j of a row is predicted at the packed position of column P-1+j
    targets = real[:, prompt_len:]
    response_rows, response_cols = targets.nonzero(as_tuple=True)
    predict_index = packed_at[:, prompt_len - 1 : width - 1][response_rows, response_cols]
    last = cu[1:][seqlens > 0] - 1  # each non-empty row's last packed position

    to_device = {"device": device, "non_blocking": True}
    flat_device = flat.to(**to_device)
    ids = input_ids.reshape(-1).index_select(0, flat_device).unsqueeze(0)
    positions = micro_batch["position_ids"].reshape(-1).index_select(0, flat_device).unsqueeze(0)
    labels = torch.roll(ids, -1, dims=1)
    labels[0, last.to(**to_device)] = 0
    return PackedRows(
        input_ids=ids,
        position_ids=positions.to(torch.long),
        cu_seqlens=cu.to(torch.int32).to(**to_device),
        max_seqlen=int(seqlens.max()),
        labels=labels,
        predict_index=predict_index.to(**to_device),
        response_rows=response_rows.to(**to_device),
        response_cols=response_cols.to(**to_device),
        seqlens=tuple(seqlens.tolist()),
        batch_size=rows,
    )


def unpack_kept(per_kept: torch.Tensor, packed: PackedRows, response_len: int) -> torch.Tensor:
    """``[N]`` or ``[1, N]`` values at :attr:`PackedRows.predict_index` -> ``[B, R]``, zeros elsewhere.

    Differentiable: the gradient of each ``[B, R]`` entry flows back to its packed value.
    """
    values = per_kept.reshape(-1)
    out = values.new_zeros(packed.batch_size, response_len)
    return out.index_put((packed.response_rows, packed.response_cols), values)


def unpack_responses(per_token: torch.Tensor, packed: PackedRows, response_len: int) -> torch.Tensor:
    """A per-position quantity of the packed pass, ``[1, T]`` or ``[T]`` -> the response's ``[B, R]``.

    Entry ``(i, j)`` is read at the position predicting response token ``j`` of row ``i``
    (``P-1+j`` of the padded row, as :mod:`verity.engines.logprobs` and
    :mod:`verity.engines.values` read it); response padding reads 0.
    """
    return unpack_kept(per_token.reshape(-1).index_select(0, packed.predict_index), packed, response_len)


def supports_packing(model: nn.Module) -> bool:
    """Whether ``model`` takes the packed pass: a text-only HF model whose layers dispatch attention by name.

    Vision-language models keep the padded layout: their vision tower's attention reads
    ``cu_seq_lens`` of its own (bidirectional, per image) through the same kernel name.
    """
    config = getattr(model, "config", None)
    return (
        config is not None
        and hasattr(config, "_attn_implementation_internal")
        and getattr(config, "vision_config", None) is None
        and bool(getattr(model, "_supports_attention_backend", False))
    )


def prefer_packed(
    model: nn.Module, micro_batch: Mapping[str, Any], layout: Mapping[str, torch.Tensor] | None = None
) -> bool:
    """Whether this micro-batch runs packed: it packs, has no images, and no shared-prompt pass is cheaper.

    The shared-prompt layout (:mod:`verity.engines.shared_prompt`, a GRPO group's prompt
    computed once) wins when it computes fewer positions than the packed ``T``: long
    prompts shared by many short answers. Both are exact, so the choice changes only rounding.
    """
    if has_images(micro_batch) or not supports_packing(model):
        return False
    plan = micro_batch if layout is None else layout
    mask = plan["attention_mask"].cpu()
    response_len = int(micro_batch["responses"].shape[1])
    if not packable(mask, response_len) or not bool(mask.any()):
        return False
    total = int(mask.sum())
    prompt_len = mask.shape[1] - response_len
    first, kept = padding_free_window(mask, response_len)
    groups = find_prompt_groups(plan["input_ids"].cpu(), mask, prompt_len)
    if should_share_prompts(model, micro_batch, groups, first, kept):
        return grouped_positions(groups, prompt_len - first, kept) >= total
    return True


def _packed_forward(model: nn.Module, packed: PackedRows, **extra: Any) -> Any:
    """The model's forward on the packed sequence, under a kernel that keeps the rows apart."""
    kernel = packed_kernel(model, packed.input_ids.device)
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    # an engine switched its model once (use_packed_kernel); a plain model is switched for this pass
    switch = contextlib.nullcontext() if current == kernel else packed_attention(model, kernel)
    with switch:
        return model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            attention_mask=None,
            use_cache=False,
            **packed.attention_kwargs(),
            **extra,
        )


def packed_response_logprobs(
    model: nn.Module,
    micro_batch: Mapping[str, Any],
    *,
    temperature: float = 1.0,
    compute_entropy: bool = True,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    entropy_grad: bool = True,
    compiled_head: bool = False,
    layout: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`verity.engines.logprobs.response_logprobs` (``trim_padding=True``) in the packed layout.

    Args: as ``response_logprobs``; ``micro_batch`` must pack (:func:`packable`) and carry no images.

    Returns:
        ``(logprobs [B, R], entropy [B, R] or None)`` float32, nats; response padding reads 0;
        autograd flows through them when grad mode is on.
    """
    packed = pack_rows(micro_batch, layout)
    response_len = int(micro_batch["responses"].shape[1])
    if _accepts_logits_to_keep(model):
        # the head runs on the N response-predicting positions only
        logits = _packed_forward(model, packed, logits_to_keep=packed.predict_index).logits
    else:
        logits = _packed_forward(model, packed).logits.index_select(1, packed.predict_index)
    labels = packed.labels.index_select(1, packed.predict_index)
    logprobs, entropy = logprobs_and_entropy_from_logits(
        logits,
        labels,
        temperature=temperature,
        compute_entropy=compute_entropy,
        chunk_tokens=chunk_tokens,
        entropy_grad=entropy_grad,
        compiled_head=compiled_head,
    )
    logprobs = unpack_kept(logprobs, packed, response_len)
    return logprobs, None if entropy is None else unpack_kept(entropy, packed, response_len)


def packed_response_values(
    module: nn.Module,
    inputs: Mapping[str, Any],
    layout: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """:func:`verity.engines.values.response_values` in the packed layout: ``[B, R]`` float32.

    The value of response token ``j`` is read at the position before it (``P-1+j`` of the
    padded row); response padding reads 0; autograd flows when grad mode is on.
    """
    packed = pack_rows(inputs, layout)
    out = _packed_forward(module, packed)
    values = getattr(out, "logits", out)
    if not isinstance(values, torch.Tensor):
        raise TypeError(
            f"value model must return a tensor or an output with .logits, got {type(out).__name__}"
        )
    if values.dim() == 3 and values.shape[-1] == 1:
        values = values.squeeze(-1)
    if values.shape != packed.input_ids.shape:
        raise ValueError(
            f"value model output must be [1, T] or [1, T, 1] for a packed pass of {packed.total_tokens} tokens, "
            f"got {tuple(values.shape)} (a critic needs a scalar head, e.g. num_labels=1)"
        )
    return unpack_responses(values.float(), packed, int(inputs["responses"].shape[1]))


def resolve_packed(
    packed: bool | None, model: nn.Module, device: torch.device, attn_implementation: str | None = None
) -> bool:
    """Whether an engine runs its passes packed: ``packed``, or when None, on a CPU for a model that takes it.

    On a CPU packing measured faster on long-tailed lengths (docs/benchmarks.md, "Long traces");
    accelerators are not measured yet. A packed pass attends through its own kernel
    (:func:`verity.engines.packed_attention.packed_kernel`), so an ``attn_implementation`` asked
    for explicitly other than ``sdpa`` or a flash kernel keeps the padded layout when ``packed``
    is None, and ``packed=True`` with it raises ``ValueError``, as does ``packed=True`` for a
    model that cannot take it.
    """
    own_kernel = attn_implementation not in (None, "sdpa", *PACKED_KERNELS)
    if packed is None:
        return device.type == "cpu" and supports_packing(model) and not own_kernel
    if packed and own_kernel:
        raise ValueError(
            f"packed=True attends through its own kernel, but attn_implementation={attn_implementation!r} "
            "was asked for: set packed=false to keep that kernel, or attn_implementation=null"
        )
    if packed and not supports_packing(model):
        raise ValueError(
            f"packed=True: {type(model).__name__} is not an HF model that dispatches attention by name "
            "(transformers' AttentionInterface); set packed=false"
        )
    return bool(packed)


def micro_batch_logprobs(
    model: nn.Module,
    micro_batch: Mapping[str, Any],
    *,
    packed: bool,
    layout: Mapping[str, torch.Tensor] | None = None,
    **head: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An engine's log-probs of one micro-batch: packed where :func:`prefer_packed` says so, else padded.

    ``head``: ``temperature``, ``compute_entropy``, ``chunk_tokens``, ``entropy_grad``,
    ``compiled_head`` as for :func:`verity.engines.logprobs.response_logprobs`. Both layouts
    give ``[B, R]`` float32 with response padding 0 and agree up to float rounding.
    """
    if packed and prefer_packed(model, micro_batch, layout):
        return packed_response_logprobs(model, micro_batch, layout=layout, **head)
    return response_logprobs(model, micro_batch, layout=layout, **head)


def micro_batch_values(
    module: nn.Module,
    micro_batch: Mapping[str, Any],
    *,
    packed: bool,
    layout: Mapping[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """An engine's values of one micro-batch, ``[B, R]`` float32: packed where :func:`prefer_packed` says so."""
    if packed and prefer_packed(module, micro_batch, layout):
        return packed_response_values(module, micro_batch, layout)
    return response_values(module, micro_batch)
