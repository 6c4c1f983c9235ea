"""The HF engine's request scheduler: one decode batch that requests join and leave between steps.

:class:`HFRequestScheduler` keeps the rows of every held request in one batch over one KV cache
(:mod:`verity.rollout.kv_cache`). Each :meth:`~HFRequestScheduler.step`::

    admit    the requests added since the last step: their own prefill (left-padded among
             themselves, repeated contexts computed once, as HFRollout's), then one rebuild of the
             cache that keeps the running rows, drops leading columns no row needs and appends
             the new rows right-aligned (their shorter width reads as left padding: mask 0)
    sample   one token for every live row from its next-token logits (rollout.sampling,
             the engine's own torch.Generator)
    retire   rows whose token is a stop token or their request's ``max_new_tokens``-th: returned
    decode   one forward of the sampled tokens for every row still in the batch

Positions are each row's own: ``cumsum(mask) - 1`` over its context at the prefill, then one
more per decoded token, exactly as :meth:`HFRollout.generate` counts them, so a request decodes
the same tokens (greedy) as ``generate`` on its context alone, log-probs equal up to the float
rounding of another batch shape. Retired rows ride along in the batch (fed the pad id, their
outputs ignored) until they make up ``COMPACT_FINISHED_FRACTION`` of it, or the columns every
live row has as padding make up that share of the width, or requests are admitted: then one
rebuild drops both, so the cache holds no more rows and columns than the live requests need
plus that slack.

While it holds a batch (from the step that admits into an empty one until the step that
retires its last row, :meth:`~HFRequestScheduler.close`, or an error, which drops the batch)
the model stays in eval mode with the grouped CPU attention switched on
(:func:`~verity.rollout.gqa_attention.grouped_sdpa`), as ``generate`` runs it for one call:
switching at every step walks every module. A user that abandons a scheduler holding requests
calls ``close()``.

Randomness: sampling draws from the engine's generator, one uniform per live row and step, so
the same seed and the same sequence of ``add`` / ``step`` calls give the same tokens.

Tensor-parallel replicas (:mod:`verity.rollout.hf_tensor_parallel`): every rank runs its own
scheduler and must be given the same ``add`` / ``step`` sequence; each admission first checks
the ranks agree on the contexts, sampling parameters and generator state
(:meth:`HFRollout.check_prefill_lockstep`) and raises on every rank rather than hang. Requests
carry token ids only (no images).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from verity.rollout.gqa_attention import grouped_sdpa
from verity.rollout.hf_rollout import COMPACT_FINISHED_FRACTION, HFRollout
from verity.rollout.kv_cache import CacheRows, reserved_cache, stack_left_padded
from verity.rollout.prompts import left_pad, position_ids_from_mask
from verity.rollout.requests import FinishedRequest, GenerationRequest, RequestScheduler
from verity.rollout.sampling import SamplingParams, sample_next_token

__all__ = ["HFRequestScheduler"]


@dataclass
class _Admitted:
    """A block of rows joining the batch: their cache, mask ``[b, w]``, next positions ``[b, 1]``,
    next-token logits ``[b, V]`` and row states."""

    cache: Any
    mask: torch.Tensor
    next_position: torch.Tensor
    next_logits: torch.Tensor
    rows: list[_Row | None]


@dataclass
class _Row:
    """A live request's row: what it has produced so far and where its context starts."""

    request: GenerationRequest
    start: int  # the first column of the batch that is not padding for this row
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.token_ids)


class HFRequestScheduler(RequestScheduler):
    """Continuous batching over an :class:`HFRollout`'s model (see the module docstring).

    ``engine``: the HF engine whose model, stop and pad ids and generator it uses. ``params``:
    the sampling parameters of every request (``n`` and ``max_new_tokens`` are ignored: each
    request brings its own ``max_new_tokens``; ``ignore_eos`` keeps rows past their stop tokens).
    """

    def __init__(self, engine: HFRollout, params: SamplingParams) -> None:
        self.engine = engine
        self.params = params
        self._queue: list[GenerationRequest] = []
        self._rows: list[_Row | None] = []  # one per batch row; None: retired, riding along
        self._cache = None  # the batch's KV cache: [B, H_kv, width, D] per layer
        self._mask: torch.Tensor | None = None  # [B, width] int64
        self._next_position: torch.Tensor | None = None  # [B, 1] int64
        self._next_logits: torch.Tensor | None = None  # [B, V]: each row's next-token logits
        self._fed: torch.Tensor | None = None  # [B, 1]: the tokens the next decode forward takes
        self._stop_ids = set() if params.ignore_eos else set(engine.eos_token_ids)
        self._held = ExitStack()  # undoes _hold_model
        self.rebuilds = 0  # how many times the cache was rebuilt (admissions and compactions)

    # ------------------------------------------------------------------ the interface

    def add(self, request: GenerationRequest) -> None:
        """Hold ``request``; it is prefilled and joins the decode batch at the next :meth:`step`.

        Raises ValueError for an empty context or ``max_new_tokens`` < 1.
        """
        if len(request.context) == 0:
            raise ValueError(f"request {request.request_id}: expected a non-empty context, got none")
        if request.max_new_tokens < 1:
            raise ValueError(
                f"request {request.request_id}: max_new_tokens must be >= 1, got {request.max_new_tokens}"
            )
        self._queue.append(request)

    def pending(self) -> int:
        """Requests held: queued for admission plus live in the batch."""
        return len(self._queue) + sum(row is not None for row in self._rows)

    @torch.no_grad()
    def step(self) -> list[FinishedRequest]:
        """Admit the queued requests, sample one token for every live row, retire the finished
        ones and run one decode forward for the rest; returns the retired requests, in batch order."""
        if not self._queue and not self._live():
            return []
        if self.engine.needs_weight_sync:
            raise RuntimeError(
                "the HF rollout released its weights while asleep and has not received all of them since: "
                "a weight sync must come before the next step"
            )
        self._hold_model()
        try:
            if self._queue:
                queue, self._queue = self._queue, []
                self._admit(queue)
            finished = self._sample_and_retire()
            if self._live():
                self._decode()
            else:
                self._clear()
        except BaseException:
            self._clear()
            raise
        return finished

    def close(self) -> None:
        """Drop the batch and its cache, and any queued request."""
        self._queue = []
        self._clear()

    # ------------------------------------------------------------------ the step's parts

    def _live(self) -> list[int]:
        return [index for index, row in enumerate(self._rows) if row is not None]

    def _clear(self) -> None:
        """Forget the batch and put the model back as it was."""
        self._rows, self._cache = [], None
        self._mask = self._next_position = self._next_logits = self._fed = None
        self._held.close()

    def _hold_model(self) -> None:
        """From the first step of a batch until it empties (or :meth:`close`, or an error): the model
        in eval mode with the grouped CPU attention (:func:`grouped_sdpa`), as ``generate`` runs it.
        Held across steps, not switched at each: switching walks every module of the model."""
        if self._rows:
            return
        model = self.engine.model
        self._held.enter_context(grouped_sdpa(model))
        if model.training:
            model.eval()
            self._held.callback(model.train)

    def _admit(self, queue: list[GenerationRequest]) -> None:
        """Prefill ``queue`` and rebuild the batch: live rows first (dead rows and all-padding
        leading columns dropped), then the new rows."""
        engine, device = self.engine, self.engine.device
        input_ids, prompt_mask = left_pad([list(r.context) for r in queue], engine.pad_token_id)
        input_ids, prompt_mask = input_ids.to(device), prompt_mask.to(device)
        engine.check_prefill_lockstep(input_ids, prompt_mask, self.params)
        engine.sync_generator_device()
        positions = position_ids_from_mask(prompt_mask)
        width = input_ids.shape[1]
        new_rows = [_Row(r, width - len(r.context)) for r in queue]
        live = self._live()
        if not live:  # nothing running: the prefill's cache is the batch's, reserved for all new tokens
            cache = reserved_cache(width + max(r.max_new_tokens for r in queue))
            logits, cache = engine._prefill(
                input_ids, prompt_mask, {"position_ids": positions}, cache, shared=True
            )
            self._rows, self._cache, self._mask = list(new_rows), cache, prompt_mask
            self._next_position, self._next_logits = positions[:, -1:] + 1, logits
            return
        cache = reserved_cache(width)
        logits, cache = engine._prefill(
            input_ids, prompt_mask, {"position_ids": positions}, cache, shared=True
        )
        self._rebuild(live, _Admitted(cache, prompt_mask, positions[:, -1:] + 1, logits, list(new_rows)))

    def _sample_and_retire(self) -> list[FinishedRequest]:
        """One token for every live row; rows that end are returned and leave (their slot becomes None)."""
        assert self._next_logits is not None
        live = self._live()
        index = torch.tensor(live, dtype=torch.long, device=self._next_logits.device)
        tokens, logprobs = sample_next_token(self._next_logits[index], self.params, self.engine._generator)
        self._fed = torch.full(
            (len(self._rows), 1), self.engine.pad_token_id, dtype=torch.long, device=self._next_logits.device
        )
        self._fed[index, 0] = tokens
        finished = []
        for slot, token, logprob in zip(live, tokens.tolist(), logprobs.tolist(), strict=True):
            row = self._rows[slot]
            assert row is not None
            row.token_ids.append(token)
            row.logprobs.append(logprob)
            if token in self._stop_ids or row.remaining == 0:
                finished.append(FinishedRequest(row.request.request_id, row.token_ids, row.logprobs))
                self._rows[slot] = None
        return finished

    def _decode(self) -> None:
        """Compact the batch when it carries enough dead rows or padding columns, then one forward."""
        assert self._mask is not None and self._next_position is not None and self._fed is not None
        live = self._live()
        dead = len(self._rows) - len(live)
        width = self._mask.shape[1]
        trim = min(self._rows[slot].start for slot in live)  # type: ignore[union-attr]
        slack = COMPACT_FINISHED_FRACTION
        if (dead and dead >= slack * len(self._rows)) or (trim and trim >= slack * width):
            fed = self._fed[torch.tensor(live, dtype=torch.long, device=self._fed.device)]
            self._rebuild(live)
            self._fed = fed
        mask = torch.cat([self._mask, torch.ones_like(self._mask[:, :1])], dim=1)
        output = self.engine.model(
            input_ids=self._fed,
            attention_mask=mask,
            position_ids=self._next_position,
            past_key_values=self._cache,
            use_cache=True,
        )
        self._cache, self._mask = output.past_key_values, mask
        self._next_logits = output.logits[:, -1, :]
        self._next_position = self._next_position + 1

    def _rebuild(self, live: list[int], admitted: _Admitted | None = None) -> None:
        """The batch as rows ``live`` of the current one with the leading columns none of them
        needs dropped, then the ``admitted`` requests' rows; each block right-aligned to the
        widest (a narrower block's first columns read as padding: mask 0, zero keys/values)."""
        assert self._cache is not None and self._mask is not None
        assert self._next_position is not None and self._next_logits is not None
        keep = torch.tensor(live, dtype=torch.long, device=self._mask.device)
        running = [self._rows[slot] for slot in live]
        trim = min(row.start for row in running)  # type: ignore[union-attr]
        for row in running:
            row.start -= trim  # type: ignore[union-attr]
        blocks = [
            _Admitted(
                self._cache,
                self._mask[keep, trim:],
                self._next_position[keep],
                self._next_logits[keep],
                running,
            )
        ]
        parts: list[CacheRows] = [(self._cache, keep, trim)]
        if admitted is not None:
            blocks.append(admitted)
            parts.append((admitted.cache, None, 0))
        width = max(block.mask.shape[1] for block in blocks)
        for block in blocks:
            for row in block.rows:
                row.start += width - block.mask.shape[1]  # type: ignore[union-attr]
        self._rows = [row for block in blocks for row in block.rows]
        remaining = max(row.remaining for row in self._rows)  # type: ignore[union-attr]
        self._cache = stack_left_padded(parts, capacity=width + remaining)
        self._mask = torch.cat([F.pad(block.mask, (width - block.mask.shape[1], 0)) for block in blocks])
        self._next_position = torch.cat([block.next_position for block in blocks])
        self._next_logits = torch.cat([block.next_logits for block in blocks])
        self.rebuilds += 1
