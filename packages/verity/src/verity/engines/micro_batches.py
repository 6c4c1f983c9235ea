"""Reading tensors from a mini-batch and cutting it into micro-batches.

A mini-batch is either a ``verity.batch.Batch`` or a plain mapping of name to tensor
``[B, ...]``. Micro-batches keep the mini-batch's type, so a loss callable sees the
same kind of object whatever the micro-batch size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from verity.data.vision_inputs import has_images, per_row_images
from verity.rollout.moe_routes import ROUTES_KEY

LOGPROB_KEYS = ("input_ids", "attention_mask", "position_ids", "responses")
TRAIN_KEYS = (*LOGPROB_KEYS, "response_mask")


def _has_key(batch: Any, key: str) -> bool:
    try:
        return key in batch
    except TypeError:
        return False


def get_tensor(batch: Any, key: str) -> torch.Tensor:
    """``batch[key]`` as a tensor, or a ``KeyError``/``TypeError`` naming the key."""
    try:
        value = batch[key]
    except KeyError:
        keys = list(batch.keys()) if hasattr(batch, "keys") else "?"
        raise KeyError(f"batch is missing required key {key!r}; it has {keys}") from None
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"batch[{key!r}] must be a torch.Tensor, got {type(value).__name__}")
    return value


def num_rows(batch: Any) -> int:
    """Number of rows ``B`` of the mini-batch (from ``input_ids``)."""
    return int(get_tensor(batch, "input_ids").shape[0])


def validate_layout(batch: Any, keys: tuple[str, ...]) -> None:
    """Check the verl layout of ``keys`` before any compute; raise ``ValueError`` if broken.

    ``input_ids``, ``attention_mask``, ``position_ids``: ``[B, P+R]``; ``responses`` and
    ``response_mask``: ``[B, R]`` with ``input_ids[:, P:] == responses``.
    """
    tensors = {k: get_tensor(batch, k) for k in keys}
    input_ids = tensors["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, P+R], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0:
        raise ValueError("the batch has no rows")
    for k in ("attention_mask", "position_ids"):
        if k in tensors and tensors[k].shape != input_ids.shape:
            raise ValueError(
                f"{k} must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(tensors[k].shape)}"
            )
    responses = tensors["responses"]
    if responses.dim() != 2 or responses.shape[0] != input_ids.shape[0]:
        raise ValueError(f"responses must be [B={input_ids.shape[0]}, R], got {tuple(responses.shape)}")
    response_len = responses.shape[1]
    if not 0 < response_len < input_ids.shape[1]:
        raise ValueError(
            f"responses width R={response_len} must be in [1, P+R-1] for input_ids of width {input_ids.shape[1]}"
        )
    if not torch.equal(input_ids[:, -response_len:], responses.to(input_ids.dtype)):
        raise ValueError("input_ids[:, P:] must equal responses (input_ids = cat(prompts, responses))")
    if "response_mask" in tensors and tensors["response_mask"].shape != responses.shape:
        raise ValueError(
            f"response_mask must have the shape of responses {tuple(responses.shape)}, "
            f"got {tuple(tensors['response_mask'].shape)}"
        )


def pick_rows(batch: Any, rows: slice | torch.Tensor, device: torch.device | None = None) -> Any:
    """The ``rows`` (a slice or an ``[n]`` int64 index) of the mini-batch, same type as ``batch``,
    moved to ``device`` when given.

    A ``verity.batch.Batch`` is cut with ``batch.index`` (views for a slice; ``pad_rows`` 0) and
    moved with ``.to(device)``; a mapping becomes a ``dict`` with every tensor and every list of
    length ``B`` cut (other values are kept as they are).
    """
    if hasattr(batch, "index") and hasattr(batch, "to") and not isinstance(batch, dict):
        picked = batch.index(rows)
        return picked if device is None else picked.to(device)
    if isinstance(batch, Mapping):
        size = num_rows(batch)
        positions = range(size)[rows] if isinstance(rows, slice) else rows.tolist()
        out: dict[str, Any] = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                out[key] = value[rows] if device is None else value[rows].to(device)
            elif isinstance(value, list) and len(value) == size:
                out[key] = [value[i] for i in positions]
            else:
                out[key] = value
        return out
    raise TypeError(f"batch must be a verity.batch.Batch or a mapping of tensors, got {type(batch).__name__}")


def take_rows(batch: Any, start: int, end: int, device: torch.device) -> Any:
    """Rows ``start:end`` of the mini-batch, moved to ``device``, same type as ``batch`` (:func:`pick_rows`)."""
    return pick_rows(batch, slice(start, end), device)


def on_device(batch: Any, rows: int, device: torch.device) -> Any:
    """The first ``rows`` rows of ``batch`` moved to ``device`` at once, for the micro-batches to slice.

    One transfer per tensor per step instead of one per micro-batch: each blocking
    host-to-device copy waits for the work already queued, so per-micro-batch copies keep
    the host from running ahead of the device. A batch with images stays where it is (its
    micro-batches move as they run: pixels can be large), and so does any batch when
    ``device`` is the CPU (there is nothing to move).
    """
    if has_images(batch) or device.type == "cpu":
        return batch
    return pick_rows(batch, slice(0, rows), device)


def host_layout(batch: Any, start: int, end: int) -> dict[str, torch.Tensor] | None:
    """``input_ids`` and ``attention_mask`` of rows ``start:end`` when they are in host memory, else None.

    :func:`verity.engines.logprobs.response_logprobs` plans a micro-batch's window and
    prompt groups from them without waiting on the device.
    """
    ids, mask = get_tensor(batch, "input_ids"), get_tensor(batch, "attention_mask")
    if ids.device.type != "cpu" or mask.device.type != "cpu":
        return None
    return {"input_ids": ids[start:end], "attention_mask": mask[start:end]}


def padding_rows(batch: Any) -> int:
    """Trailing rows that ``Batch.split`` added as padding (``batch.pad_rows``; 0 for a mapping)."""
    pad = int(getattr(batch, "pad_rows", 0) or 0)
    if not 0 <= pad <= num_rows(batch):
        raise ValueError(f"batch.pad_rows={pad} must be in [0, {num_rows(batch)}]")
    return pad


def model_inputs(micro_batch: Any) -> dict[str, Any]:
    """The four tensors a causal-LM forward pass needs, from a micro-batch (and its ``routed_experts``, if any).

    A micro-batch with images also gives its per-row ``pixel_values`` and ``image_grid_thw``
    lists (:mod:`verity.data.vision_inputs`).
    """
    inputs: dict[str, Any] = {k: get_tensor(micro_batch, k) for k in LOGPROB_KEYS}
    if _has_key(micro_batch, ROUTES_KEY):  # a mixture-of-experts rollout's routes, for routing replay
        inputs[ROUTES_KEY] = get_tensor(micro_batch, ROUTES_KEY)
    if has_images(micro_batch):
        inputs["pixel_values"], inputs["image_grid_thw"] = per_row_images(micro_batch)
    return inputs


def micro_batch_ranges(
    attention_mask: torch.Tensor,
    response_len: int,
    micro_batch_size: int,
    max_tokens: int = 0,
    cost: str = "window",
) -> list[tuple[int, int]]:
    """Consecutive row ranges ``[(start, end), ...]`` covering the rows of ``attention_mask``.

    Each range has at most ``micro_batch_size`` rows. With ``max_tokens > 0`` a range
    also stops before its padding-free window (rows x columns from the first real
    prompt column to the last real response column of its rows, what
    :func:`verity.engines.logprobs.padding_free_window` keeps) would exceed
    ``max_tokens`` positions; a single row wider than that still gets a range of its own.
    Rows stay in order, so rows of one prompt group stay together where they fit.

    Args:
        attention_mask: ``[B, P+R]``, 1 on real tokens (left-padded prompts, right-padded responses).
        response_len: ``R``.
        micro_batch_size: most rows per range, >= 1.
        max_tokens: most window positions per range (rows x window width); 0: no token budget.
        cost: what ``max_tokens`` counts: ``window`` (rows x window width, the padded layout's
            positions) or ``tokens`` (the rows' real tokens, the packed layout's,
            :mod:`verity.engines.packed`).

    Returns:
        ``ceil``-style cover of ``range(B)``: the first starts at 0, each starts where the
        previous ends, the last ends at ``B`` (empty for ``B == 0``).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens < 0:
        raise ValueError(f"micro_batch_tokens must be >= 0 (0: rows only), got {max_tokens}")
    if cost not in ("window", "tokens"):
        raise ValueError(f"cost must be 'window' or 'tokens', got {cost!r}")
    rows = int(attention_mask.shape[0])
    if max_tokens == 0:
        return [(s, min(s + micro_batch_size, rows)) for s in range(0, rows, micro_batch_size)]
    prompt_len = attention_mask.shape[1] - response_len
    real = attention_mask.bool()
    columns = torch.arange(attention_mask.shape[1])
    # first real prompt column per row (at most P-1), one past the last real response column (at least P+1)
    first = torch.where(real[:, :prompt_len], columns[:prompt_len], prompt_len - 1).min(dim=1).values
    last = torch.where(real[:, prompt_len:], columns[prompt_len:] + 1, prompt_len + 1).max(dim=1).values
    lengths = real.sum(dim=1).tolist()
    ranges: list[tuple[int, int]] = []
    start, lo, hi, tokens = 0, 0, 0, 0
    for row, (f, e) in enumerate(zip(first.tolist(), last.tolist(), strict=True)):
        if row > start:
            width = max(hi, e) - min(lo, f)
            size = tokens + lengths[row] if cost == "tokens" else (row - start + 1) * width
            if row - start >= micro_batch_size or size > max_tokens:
                ranges.append((start, row))
                start = row
        if row == start:
            lo, hi, tokens = f, e, lengths[row]
        else:
            lo, hi, tokens = min(lo, f), max(hi, e), tokens + lengths[row]
    if rows:
        ranges.append((start, rows))
    return ranges
