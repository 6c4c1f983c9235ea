"""Reading a rollout's input batch and building its output batch.

A rollout takes a :class:`verity.batch.Batch` (or a plain dict of tensors and
per-row lists, handy in tests and scripts) and returns a ``Batch``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from verity.batch import Batch
from verity.rollout.prompts import position_ids_from_mask
from verity.rollout.sampling import SamplingParams


def unpack_batch(
    batch: Batch | Mapping[str, Any],
) -> tuple[dict[str, torch.Tensor], dict[str, list], dict[str, Any]]:
    """Split a batch into ``(tensors, non_tensors, meta)``.

    Accepts a ``Batch`` or a mapping whose values are tensors or per-row lists
    (an optional ``"meta"`` entry holding a dict becomes the meta).
    """
    if isinstance(batch, Batch):
        tensors = {key: batch[key] for key in batch.tensor_keys()}
        return tensors, {k: list(v) for k, v in batch.non_tensors.items()}, dict(batch.meta)
    if not isinstance(batch, Mapping):
        raise TypeError(f"batch: expected a verity Batch or a dict of tensors, got {type(batch).__name__}")
    tensors: dict[str, torch.Tensor] = {}
    non_tensors: dict[str, list] = {}
    meta: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif key == "meta" and isinstance(value, Mapping):
            meta.update(value)
        elif isinstance(value, list | tuple):
            non_tensors[key] = list(value)
        else:
            raise TypeError(
                f"batch[{key!r}]: expected a tensor or a per-row list, got {type(value).__name__}"
            )
    return tensors, non_tensors, meta


def pack_batch(
    tensors: dict[str, torch.Tensor], non_tensors: dict[str, list], meta: dict[str, Any], pad_rows: int = 0
) -> Batch:
    """Build the output ``Batch`` (``pad_rows``: trailing padding rows recorded by ``Batch.split``)."""
    out = Batch.from_dict(tensors, non_tensors=non_tensors or None, meta=meta or None)
    out.pad_rows = pad_rows
    return out


def resolve_sampling(
    batch: Batch | Mapping[str, Any], default: SamplingParams, params: SamplingParams | None
) -> SamplingParams:
    """``params`` when given; otherwise ``default`` updated by the sampling keys in the batch's meta."""
    if params is not None:
        return params
    meta = batch.meta if isinstance(batch, Batch) else batch.get("meta", {})
    return default.updated(dict(meta) if isinstance(meta, Mapping) else {})


@dataclass
class PromptRows:
    """A rollout's validated input, already repeated ``n`` times per prompt.

    ``prompt_ids`` / ``prompt_mask``: [B*n, P] left-padded prompt ids and mask;
    ``tensors`` / ``non_tensors``: every input key, repeated like the prompts
    (with a ``group`` key [B*n] added when ``n > 1`` and the input has none);
    ``meta`` and ``pad_rows`` pass through to the output.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    tensors: dict[str, torch.Tensor]
    non_tensors: dict[str, list]
    meta: dict[str, Any]
    pad_rows: int


def read_prompt_rows(
    batch: Batch | Mapping[str, Any], n: int, *, takes_images: str | None = None
) -> PromptRows:
    """Validate a rollout's input batch and repeat each prompt ``n`` times consecutively.

    Raises KeyError without ``input_ids`` / ``attention_mask``, ValueError for
    shapes that differ, an empty batch, right padding, or a batch padded by
    ``Batch.split`` asked for ``n > 1`` samples. ``takes_images``: None for an engine
    that cannot feed images to its model — a batch with ``pixel_values`` is then refused
    (its image tokens would be read without their images).
    """
    tensors, non_tensors, meta = unpack_batch(batch)
    if takes_images is None and "pixel_values" in non_tensors:
        raise ValueError(
            "batch: the prompts carry images (pixel_values) but this rollout engine does not feed images "
            "to the model; use rollout.engine=hf without the agent loop (docs/multimodal.md)"
        )
    pad_rows = int(getattr(batch, "pad_rows", 0))
    if pad_rows and n > 1:
        raise ValueError(
            f"batch.pad_rows: a batch padded by split ({pad_rows} rows) cannot be sampled with n={n}; "
            "repeat the prompts before splitting"
        )
    for key in ("input_ids", "attention_mask"):
        if key not in tensors:
            raise KeyError(
                f"batch: expected key {key!r} ([B, P] left-padded prompt), found {sorted(tensors)}"
            )
    prompt_ids, prompt_mask = tensors["input_ids"], tensors["attention_mask"]
    if prompt_ids.dim() != 2 or prompt_ids.shape != prompt_mask.shape:
        raise ValueError(
            f"batch['input_ids'], batch['attention_mask']: expected equal [B, P] shapes, "
            f"got {tuple(prompt_ids.shape)} and {tuple(prompt_mask.shape)}"
        )
    if prompt_ids.shape[0] == 0:
        raise ValueError("batch: expected at least one prompt row, got 0")
    if bool((prompt_mask[:, -1] == 0).any()):
        raise ValueError("batch['attention_mask']: prompts must be left-padded (last column all ones)")
    rows = prompt_ids.shape[0]
    if n > 1:
        tensors = {key: value.repeat_interleave(n, dim=0) for key, value in tensors.items()}
        non_tensors = {key: [v for v in value for _ in range(n)] for key, value in non_tensors.items()}
        if "group" not in tensors:
            tensors["group"] = torch.arange(rows, dtype=torch.long).repeat_interleave(n)
        prompt_ids, prompt_mask = tensors["input_ids"], tensors["attention_mask"]
    return PromptRows(prompt_ids, prompt_mask, tensors, non_tensors, meta, pad_rows)


def build_rollout_output(
    rows: PromptRows,
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    logprobs: torch.Tensor,
    response_attention: torch.Tensor | None = None,
) -> Batch:
    """The rollout's output batch (keys and shapes in ``verity.rollout.base``).

    ``responses`` [B*n, R] int64 right-padded, ``response_mask`` [B*n, R] int64,
    ``logprobs`` [B*n, R] float32; every input key other than ``input_ids``,
    ``attention_mask`` and ``position_ids`` passes through. ``response_attention``
    [B*n, R]: 1 on every real response token (None: ``response_mask``); it differs from
    ``response_mask`` in multi-turn rollouts, whose tool tokens are context but not trained.
    """
    device = responses.device
    prompt_ids = rows.prompt_ids.to(device)
    span = response_mask if response_attention is None else response_attention.to(device).long()
    if span.shape != response_mask.shape or bool((response_mask.bool() & ~span.bool()).any()):
        raise ValueError(
            "response_attention must cover every response_mask token, with the same [B, R] shape"
        )
    attention_mask = torch.cat([rows.prompt_mask.to(device).long(), span], dim=1)
    out = {
        key: value
        for key, value in rows.tensors.items()
        if key not in ("input_ids", "attention_mask", "position_ids")
    }
    out.update(
        prompts=prompt_ids,
        responses=responses,
        response_mask=response_mask,
        rollout_logprobs=logprobs,
        input_ids=torch.cat([prompt_ids, responses], dim=1),
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    )
    return pack_batch(out, rows.non_tensors, rows.meta, rows.pad_rows)


def prompt_token_lists(rows: PromptRows, max_new_tokens: int, max_model_len: int) -> list[list[int]]:
    """Each row's real prompt tokens (padding dropped), for engines that take token-id lists.

    Raises ValueError when the longest prompt plus ``max_new_tokens`` exceeds ``max_model_len``.
    """
    lengths = rows.prompt_mask.sum(dim=1)
    longest = int(lengths.max())
    if longest + max_new_tokens > max_model_len:
        raise ValueError(
            f"max_model_len={max_model_len}: the longest prompt ({longest} tokens) plus "
            f"max_new_tokens={max_new_tokens} does not fit; raise max_model_len or shorten the prompts"
        )
    ids = rows.prompt_ids.cpu()
    mask = rows.prompt_mask.cpu().bool()
    return [ids[row][mask[row]].tolist() for row in range(ids.shape[0])]


def responses_from_token_lists(
    tokens: list[list[int]], logprobs: list[list[float]], length: int, pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad per-row generated tokens into ``(responses, response_mask, logprobs)`` [rows, length].

    ``tokens[i]`` are row i's generated ids (the stop token included, at most ``length``);
    ``logprobs[i]`` their log-probs. Raises ValueError when a row is longer than ``length``
    or its log-probs do not match its tokens one for one.
    """
    rows = len(tokens)
    if len(logprobs) != rows:
        raise ValueError(f"logprobs: expected {rows} rows (one per token row), got {len(logprobs)}")
    responses = torch.full((rows, length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((rows, length), dtype=torch.long)
    out_logprobs = torch.zeros((rows, length), dtype=torch.float32)
    for row, (ids, lps) in enumerate(zip(tokens, logprobs, strict=True)):
        if len(ids) > length:
            raise ValueError(f"tokens[{row}]: {len(ids)} tokens, more than max_new_tokens={length}")
        if len(lps) != len(ids):
            raise ValueError(f"logprobs[{row}]: {len(lps)} values for {len(ids)} tokens")
        if ids:
            responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            response_mask[row, : len(ids)] = 1
            out_logprobs[row, : len(ids)] = torch.tensor(lps, dtype=torch.float32)
    return responses, response_mask, out_logprobs


SEED_BOUND = 2**62


def draw_request_seeds(generator: torch.Generator, count: int) -> list[int]:
    """``count`` per-request seeds in ``[0, 2**62)`` from ``generator`` (one per sampled row)."""
    return torch.randint(0, SEED_BOUND, (count,), generator=generator).tolist()
