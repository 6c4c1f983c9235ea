"""A KV cache whose layers reserve room for the whole generation, so each decode step writes in place.

transformers' ``DynamicLayer`` appends a step's keys and values with ``torch.cat``: every
step copies the whole cache so far, ``O(T^2)`` bytes over ``T`` steps. :class:`ReservedLayer`
keeps keys and values ``[B, H, capacity, D]`` in one buffer sized for prompt + new tokens and
hands the attention a view of the filled part ``[B, H, length, D]``; an append is a copy of the
new ``[B, H, 1, D]`` slice. Attention reads exactly the positions a ``DynamicLayer`` would
return (same values, same length), so the logits are the same; a buffer that runs out of room
grows (doubling), so ``capacity`` is a hint, not a limit.

    cache = reserved_cache(capacity=prompt_len + max_new_tokens)
    model(input_ids, past_key_values=cache, use_cache=True)     # prefill, then decode steps

:func:`stack_left_padded` builds one such cache out of rows of several (the request scheduler's
running batch and the requests it admits), each part's positions right-aligned to a common
width, so a part that is shorter reads as left padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

__all__ = ["CacheRows", "ReservedLayer", "reserved_cache", "stack_left_padded"]


class ReservedLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values live in a buffer with room for ``capacity`` positions."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 position, got {capacity}")
        self.capacity = capacity
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._length = 0

    def _view(self) -> None:
        assert self._key_buffer is not None and self._value_buffer is not None
        self.keys = self._key_buffer[..., : self._length, :]
        self.values = self._value_buffer[..., : self._length, :]

    def _reserve(self, like_keys: torch.Tensor, like_values: torch.Tensor, positions: int) -> None:
        """(Re)allocate the buffers with room for ``positions``, keeping what is filled."""
        keys = like_keys.new_empty((*like_keys.shape[:-2], positions, like_keys.shape[-1]))
        values = like_values.new_empty((*like_values.shape[:-2], positions, like_values.shape[-1]))
        if self._length:
            assert self._key_buffer is not None and self._value_buffer is not None
            keys[..., : self._length, :] = self._key_buffer[..., : self._length, :]
            values[..., : self._length, :] = self._value_buffer[..., : self._length, :]
        self._key_buffer, self._value_buffer = keys, values

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, n, D]`` keys/values after the filled positions; return all ``[B, H, length, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self._length + key_states.shape[-2]
        if self._key_buffer is None or end > self._key_buffer.shape[-2]:
            grown = self.capacity if self._key_buffer is None else 2 * self._key_buffer.shape[-2]
            self._reserve(key_states, value_states, max(end, grown))
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[..., self._length : end, :] = key_states
        self._value_buffer[..., self._length : end, :] = value_states
        self._length = end
        self._view()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        """Positions filled so far."""
        return self._length

    def _remap_rows(self, pick: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace both buffers by ``pick(buffer)`` (a new batch of rows), keeping the filled positions."""
        if self._length:
            assert self._key_buffer is not None and self._value_buffer is not None
            self._key_buffer, self._value_buffer = pick(self._key_buffer), pick(self._value_buffer)
            self._view()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows ``beam_idx`` of the cache, in that order (the batch may grow or shrink)."""
        self._remap_rows(lambda buffer: buffer.index_select(0, beam_idx.to(buffer.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows ``indices``."""
        self._remap_rows(lambda buffer: buffer[indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times."""
        self._remap_rows(lambda buffer: buffer.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``|tokens_to_remove|`` positions (a positive value: keep that many, as HF's legacy form)."""
        keep = tokens_to_remove if tokens_to_remove > 0 else self._length - abs(tokens_to_remove)
        if 0 <= keep < self._length:
            self._length = keep
            self._view()

    def reset(self) -> None:
        """Forget every position and the buffers."""
        self._key_buffer = self._value_buffer = None
        self._length = 0
        super().reset()


def reserved_cache(capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose layers (created on first use) are :class:`ReservedLayer` of ``capacity`` positions."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = lambda: ReservedLayer(capacity)  # type: ignore[assignment]
    return cache


CacheRows = tuple[DynamicCache, "torch.Tensor | None", int]
"""A part of :func:`stack_left_padded`: ``(cache, rows, start)``: rows ``rows`` (an int64 index
tensor; None: all) of ``cache``, positions ``start`` onwards."""


def stack_left_padded(parts: Sequence[CacheRows], capacity: int) -> DynamicCache:
    """One reserved cache holding the rows of ``parts`` in order, right-aligned to a common width.

    Each part ``(cache, rows, start)`` contributes ``len(rows)`` rows of its filled positions
    ``[start, length)``; the result has ``W = max(length - start)`` filled positions and each
    part's rows occupy the last ``length - start`` of them, the columns before reading zeros
    (give them attention mask 0). Every layer is a :class:`ReservedLayer` whose buffers have
    room for ``max(capacity, W)`` positions; the parts are left as they were. Keys and values
    ``[B, H_kv, W, D]`` per layer, ``B`` the rows of all parts.
    """
    if not parts:
        raise ValueError("stack_left_padded: expected at least one part, got none")
    layer_count = len(parts[0][0].layers)
    if any(len(cache.layers) != layer_count for cache, _, _ in parts):
        raise ValueError("stack_left_padded: the parts' caches have different numbers of layers")
    width = max(cache.get_seq_length() - start for cache, _, start in parts)
    room = max(capacity, width)
    stacked = reserved_cache(room)
    for index in range(layer_count):
        layer = ReservedLayer(room)
        keys = [_rows_from(cache.layers[index].keys, rows, start) for cache, rows, start in parts]
        values = [_rows_from(cache.layers[index].values, rows, start) for cache, rows, start in parts]
        layer.lazy_initialization(keys[0], values[0])
        layer._key_buffer = _right_aligned(keys, width, room)
        layer._value_buffer = _right_aligned(values, width, room)
        layer._length = width
        layer._view()
        stacked.layers.append(layer)
    return stacked


def _rows_from(states: torch.Tensor, rows: torch.Tensor | None, start: int) -> torch.Tensor:
    """``states [B, H, length, D]`` at ``rows`` (None: all), positions ``start`` onwards (a view where it can)."""
    states = states[..., start:, :]
    return states if rows is None else states.index_select(0, rows.to(states.device))


def _right_aligned(pieces: list[torch.Tensor], width: int, room: int) -> torch.Tensor:
    """``pieces`` ``[b_i, H, w_i, D]`` stacked along rows into a ``[sum b_i, H, room, D]`` buffer,
    each at positions ``[width - w_i, width)``, zeros before; positions from ``width`` on are unset."""
    first = pieces[0]
    rows = sum(piece.shape[0] for piece in pieces)
    buffer = first.new_empty((rows, first.shape[1], room, first.shape[-1]))
    row = 0
    for piece in pieces:
        count, length = piece.shape[0], piece.shape[-2]
        buffer[row : row + count, :, : width - length].zero_()
        buffer[row : row + count, :, width - length : width] = piece
        row += count
    return buffer
