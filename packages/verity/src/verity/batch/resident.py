"""Rows that stay where they were made: the worker keeps the bulk, the driver holds handles.

A generated row's prompt-aligned tensors — every declared key whose second dimension
is ``P`` or ``P+R`` (``prompts``, ``input_ids``, ``attention_mask``, ``position_ids``) —
are most of its bytes, and the driver never reads them: it scores responses, computes
advantages and logs metrics from ``[B, R]`` and ``[B]`` keys. Neither does it read the
sampler's ``rollout_logprobs [B, R]`` unless they become the run's old log-probs, so
those stay too (``keep_resident(..., also=...)``). So a generating worker
puts them in Ray's object store (:func:`keep_resident`) and returns the batch without
them, carrying one handle per row in the per-row column :data:`RESIDENT` instead:
``(RowSource, row index)``, where the :class:`RowSource` names the stored object and
the keys it holds.

On the driver a resident key behaves like a key of the batch for everything but
reading it: ``key in batch`` is true, ``batch.keys()`` lists it, ``select``, ``index``,
``split``, ``concat``, ``repeat_interleave`` and ``union`` carry the handles like any
per-row value, and setting a resident key replaces it by the driver's value (a key is
never both resident and local). Reading one raises :class:`ResidentKeyError` naming it.

When a group call sends such a batch to a worker, the worker's host calls
:func:`materialize` before the method runs: each source is fetched once (from the
process that made it, never through the driver), the rows are gathered in order and
the prompt side is left-padded to the widest source when rows of differently wide
prompt batches meet (dynamic sampling's rounds). The method sees a whole batch.

The responses and their mask the driver does read (rewards, advantages, metrics), so they
come back to it; but the update needs them again on the workers. With ``echo`` the
generating worker stores them as well, with an 8-byte digest per row, and the driver keeps
its copies: when a stage sends a batch to workers (:func:`send_echoes_as_handles`), a key
whose every row still matches its digest goes as the handles the batch carries anyway, and
a key the driver changed goes as it is. The digests travel with the handles to the driver
only, and ``perf/driver_bytes_*`` count them.

A driver-side diagnostic (a test's probe stage) may call :func:`materialize` too; the rows
then do come through the driver, outside ``perf/driver_bytes_*``. With
``trainer.resident_rows=false`` every key stays on the driver as before.

The stored object lives as long as a handle to it does: Ray frees it when the step's
batch is dropped on the driver.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DIGEST_BYTES",
    "HandleRuns",
    "RESIDENT",
    "ResidentKeyError",
    "RowSource",
    "echo_digest_bytes",
    "handle_column_bytes",
    "keep_resident",
    "materialize",
    "prompt_aligned_keys",
    "resident_prompt_width",
    "resident_row_tokens",
    "row_digests",
    "send_echoes_as_handles",
]

DIGEST_BYTES = 8
RESIDENT = "_resident"
"""The per-row column of handles: ``(RowSource, index of the row in the stored batch)``."""

# left padding that keeps a row's meaning: masks 0, position ids 0 (cumsum(mask) - 1 clipped at 0)
_ZERO_FILL_KEYS = ("attention_mask", "position_ids")


class HandleRuns:
    """A handle column as it is pickled: one ``(source, first index, rows)`` per run of rows that
    come from one source in order, in place of a ``(source, index)`` tuple per row.

    A generated batch's column is a run per generating rank, and it stays so through
    ``split`` and ``select``; a few runs travel where there were ``B`` tuples.
    """

    __slots__ = ("runs",)

    def __init__(self, column: Sequence[tuple[Any, int]]) -> None:
        runs: list[list[Any]] = []
        for source, index in column:
            last = runs[-1] if runs else None
            if last is not None and last[0] is source and last[1] + last[2] == index:
                last[2] += 1
            else:
                runs.append([source, index, 1])
        self.runs = [tuple(run) for run in runs]

    def rows(self) -> list[tuple[Any, int]]:
        """The column again: one ``(source, index)`` per row."""
        return [(source, first + i) for source, first, count in self.runs for i in range(count)]

    def __getstate__(self) -> list[tuple[Any, int, int]]:
        return self.runs

    def __setstate__(self, runs: list[tuple[Any, int, int]]) -> None:
        self.runs = runs


OBJECT_ID_BYTES = 28
"""Bytes of a Ray object id, the part of a handle's stored-object reference counted on the wire."""


def handle_column_bytes(column: Sequence[tuple[Any, int]]) -> int:
    """Bytes a handle column takes on the wire, as :class:`HandleRuns`: each distinct source's
    description (object id, keys, prompt width, row token counts) once, and two integers a run."""
    runs = HandleRuns(column).runs
    sources = {id(source): source for source, _, _ in runs}.values()
    described = sum(
        OBJECT_ID_BYTES
        + len(
            pickle.dumps(
                (s.keys, s.prompt_width, s.pad_token_id, s.row_tokens), protocol=pickle.HIGHEST_PROTOCOL
            )
        )
        for s in sources
    )
    return described + len(
        pickle.dumps([(first, count) for _, first, count in runs], protocol=pickle.HIGHEST_PROTOCOL)
    )


class ResidentKeyError(KeyError):
    """A resident key was read on the driver, where only its handles are."""


@dataclass(frozen=True, eq=False)
class RowSource:
    """One stored block of rows: the object-store reference and what it holds.

    Attributes:
        ref: Ray ``ObjectRef`` of a :class:`~verity.batch.Batch` with ``keys`` for ``rows`` rows.
        keys: the resident keys this handle gives access to (a subset of what is stored).
        prompt_width: ``P`` of the stored rows (prompt columns, left-padded).
        pad_token_id: the id left padding of token keys uses.
        row_tokens: per stored row, its real tokens (``attention_mask.sum(-1)``), or ``None``.
        echoes: keys stored here that the driver keeps too (:func:`keep_resident`'s ``echo``),
            each with one digest per stored row (:func:`row_digests`), or ``None``.
    """

    ref: Any
    keys: tuple[str, ...]
    prompt_width: int
    pad_token_id: int
    row_tokens: tuple[int, ...] | None = None
    echoes: Mapping[str, tuple[bytes, ...]] | None = None

    @property
    def ref_id(self) -> str:
        """The stored object's id (equal for every copy of a handle to it)."""
        ref = self.ref
        return ref.hex() if hasattr(ref, "hex") else str(id(ref))

    def restricted(self, keys: Sequence[str]) -> RowSource:
        """The same stored rows, giving access to ``keys`` only (in this source's order)."""
        wanted = set(keys)
        return RowSource(
            self.ref,
            tuple(k for k in self.keys if k in wanted),
            self.prompt_width,
            self.pad_token_id,
            self.row_tokens,
            self.echoes,
        )

    def for_workers(self, echoed: Sequence[str] = ()) -> RowSource:
        """The source as a batch sent to a worker carries it: also giving access to the
        ``echoed`` keys it stores, and without the digests (the worker has no use for them)."""
        extra = tuple(k for k in echoed if k not in self.keys and k in (self.echoes or {}))
        return RowSource(self.ref, self.keys + extra, self.prompt_width, self.pad_token_id, self.row_tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSource) and (self.ref_id, self.keys) == (other.ref_id, other.keys)

    def __hash__(self) -> int:
        return hash((self.ref_id, self.keys))


def prompt_aligned_keys(keys: Sequence[str]) -> list[str]:
    """The declared keys among ``keys`` whose second dimension is ``P`` or ``P+R`` (in order)."""
    from verity.batch.schema import declared_keys

    specs = declared_keys()
    out = []
    for key in keys:
        spec = specs.get(key)
        if spec is not None and spec.is_tensor and len(spec.dims) >= 2 and spec.dims[1] in ("P", "P+R"):
            out.append(key)
    return out


def column_sources(column: Sequence[tuple[RowSource, int]]) -> list[RowSource]:
    """The distinct sources of a handle column, in order of first appearance."""
    seen: dict[int, RowSource] = {}
    for source, _ in column:
        seen.setdefault(id(source), source)
    distinct: dict[RowSource, None] = {}
    for source in seen.values():
        distinct.setdefault(source, None)
    return list(distinct)


def map_column(
    column: Sequence[tuple[RowSource, int]], rebuild: Callable[[RowSource], RowSource]
) -> list[tuple[RowSource, int]]:
    """The handle column with each source replaced by ``rebuild(source)``, rebuilt once per source."""
    swapped: dict[int, RowSource] = {}
    out = []
    for source, index in column:
        new = swapped.get(id(source))
        if new is None:
            new = swapped[id(source)] = rebuild(source)
        out.append((new, index))
    return out


def restrict_column(
    column: Sequence[tuple[RowSource, int]], keys: Sequence[str]
) -> list[tuple[RowSource, int]]:
    """The handle column giving access to ``keys`` only."""
    return map_column(column, lambda source: source.restricted(keys))


def row_digests(values: torch.Tensor) -> tuple[bytes, ...]:
    """One 8-byte BLAKE2b digest per row of ``values [B, ...]``, of its dtype, shape and bytes.

    A change detector, not a signature: two different rows agree with probability 2^-64.
    """
    rows = values.detach().cpu().contiguous()
    head = f"{rows.dtype}{tuple(rows.shape[1:])}".encode()
    flat = rows.reshape(rows.shape[0], -1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
    # rows of one NumPy view: indexing the tensor per row cost 4x as much (0.29 against 0.07 ms for [128, 8])
    blake2b = hashlib.blake2b
    return tuple(blake2b(head + row.tobytes(), digest_size=DIGEST_BYTES).digest() for row in raw.numpy())


def keep_resident(
    batch: Any,
    pad_token_id: int,
    put: Callable[[Any], Any] | None = None,
    *,
    also: Sequence[str] = (),
    echo: Sequence[str] = (),
) -> Any:
    """Put ``batch``'s prompt-aligned tensors in Ray's object store; return the batch with handles instead.

    ``also``: more keys to keep with them, where the batch has them — ``[B, R]`` keys the
    driver never reads in this run (``rollout_logprobs``, see
    :func:`verity.workers.rollout_side.resident_response_keys`); ``R`` is the rollout's
    ``max_new_tokens``, the same in every source, so they need no padding when rows meet.
    ``echo``: ``[B, R]`` keys the driver reads (``responses``, ``response_mask``): stored as
    well, with a digest per row, and kept on the driver; a batch the driver later sends a
    worker leaves out a row set whose values still match the digests (:func:`send_echoes_as_handles`).
    Returns ``batch`` unchanged when it has no prompt-aligned tensor or Ray is not
    running in this process (a batch built outside a worker group keeps its tensors).
    The stored block is owned by this process; Ray frees it when no handle is left.
    ``put`` replaces ``ray.put`` (tests).
    """
    from verity.batch.core import Batch

    keys = prompt_aligned_keys(batch.tensor_keys())
    if not keys:
        return batch
    keys += [k for k in also if k in batch.tensor_keys() and k not in keys]
    echoed = [k for k in echo if k in batch.tensor_keys() and k not in keys]
    if put is None:
        import ray

        if not ray.is_initialized():
            return batch
        put = ray.put
    stored = batch.select(*keys, *echoed)
    stored.meta = {}
    stored.pad_rows = 0
    if "prompts" in keys:
        width = int(batch["prompts"].shape[1])
    elif "input_ids" in keys and "responses" in batch.tensor_keys():
        width = int(batch["input_ids"].shape[1] - batch["responses"].shape[1])
    else:
        width = int(batch[keys[0]].shape[1])
    tokens = (
        tuple(int(n) for n in batch["attention_mask"].sum(-1).tolist()) if "attention_mask" in keys else None
    )
    echoes = {k: row_digests(batch[k]) for k in echoed} or None
    source = RowSource(put(stored), tuple(keys), width, int(pad_token_id), tokens, echoes)
    light = [k for k in batch.tensor_keys() if k not in keys]
    out = Batch(batch.tensors.select(*light), dict(batch.non_tensors), dict(batch.meta), batch.pad_rows)
    out.non_tensors[RESIDENT] = [(source, i) for i in range(len(batch))]
    return out


def materialize(batch: Any, fetch: Callable[[list[Any]], list[Any]] | None = None) -> Any:
    """``batch`` with its resident keys fetched and its handle column dropped (a batch without handles as is).

    Each distinct source is fetched once (``ray.get``, or ``fetch`` for tests); rows keep
    their order; the prompt side of every prompt-aligned key is left-padded to the widest
    source's ``P`` (token keys with the source's ``pad_token_id``, masks and position ids with 0).
    """
    from verity.batch.core import Batch

    column = batch.non_tensors.get(RESIDENT)
    if column is None:
        return batch
    keys = batch.resident_keys()
    prompt_keys = set(prompt_aligned_keys(keys))  # the keys that are left-padded to the widest P
    rows = len(batch)
    tensors = dict(batch.tensors.items())
    rest = {k: v for k, v in batch.non_tensors.items() if k != RESIDENT}
    if keys and rows:
        if fetch is None:
            import ray

            fetch = ray.get
        sources = column_sources(column)
        order = {source: i for i, source in enumerate(sources)}
        stored = fetch([source.ref for source in sources])
        width = max(source.prompt_width for source in sources)
        picks: list[list[int]] = [[] for _ in sources]
        positions: list[list[int]] = [[] for _ in sources]
        for position, (source, index) in enumerate(column):
            s = order[source]
            picks[s].append(index)
            positions[s].append(position)
        for key in keys:
            out = None
            for s, source in enumerate(sources):
                if not picks[s]:
                    continue
                part = stored[s][key][torch.tensor(picks[s])]
                extra = width - source.prompt_width if key in prompt_keys else 0
                if extra:
                    fill = 0 if key in _ZERO_FILL_KEYS or part.dtype == torch.bool else source.pad_token_id
                    pad = torch.full((part.shape[0], extra, *part.shape[2:]), fill, dtype=part.dtype)
                    part = torch.cat([pad, part], dim=1)
                if out is None:
                    out = part.new_empty((rows, *part.shape[1:]))
                out[torch.tensor(positions[s])] = part
            tensors[key] = out
    from tensordict import TensorDict

    return Batch(TensorDict(tensors, batch_size=[rows]), rest, dict(batch.meta), batch.pad_rows)


def send_echoes_as_handles(batch: Any) -> Any:
    """``batch`` as it goes to workers: each echoed key whose rows all still match their digests
    made resident again, and the digests left behind.

    Such a key then travels as the handles the batch already carries (the worker fetches the
    rows from the process that generated them), not through the driver. A key the driver
    changed — replaced, edited in place, trimmed, rows from a source that did not echo it —
    fails the check and is sent as it is. The batch given is not changed; a batch without
    handles, or whose handles echo nothing, is returned as is.
    """
    from verity.batch.core import Batch

    column = batch.non_tensors.get(RESIDENT)
    if not column:
        return batch
    sources = column_sources(column)
    if not any(source.echoes for source in sources):
        return batch  # nothing echoed: no digests to check or to leave behind
    matching = []
    for key in batch.tensor_keys():
        if not all(source.echoes and key in source.echoes for source in sources):
            continue
        local = row_digests(batch[key])
        if all(
            source.echoes[key][index] == digest for (source, index), digest in zip(column, local, strict=True)
        ):
            matching.append(key)
    light = [k for k in batch.tensor_keys() if k not in matching]
    out = Batch(batch.tensors.select(*light), dict(batch.non_tensors), dict(batch.meta), batch.pad_rows)
    out.non_tensors[RESIDENT] = map_column(column, lambda source: source.for_workers(matching))
    return out


def echo_digest_bytes(batch: Any) -> int:
    """Bytes of the row digests the batch's handles carry (counted with the tensors moved)."""
    column = batch.non_tensors.get(RESIDENT) if hasattr(batch, "non_tensors") else None
    if not column:
        return 0
    return sum(
        len(digests) * DIGEST_BYTES
        for source in column_sources(column)
        for digests in (source.echoes or {}).values()
    )


def resident_prompt_width(batch: Any) -> int | None:
    """``P`` the batch's resident rows will have once materialized (the widest source), or None without handles."""
    column = batch.non_tensors.get(RESIDENT)
    if not column:
        return None
    return max(source.prompt_width for source in column_sources(column))


def resident_row_tokens(batch: Any) -> torch.Tensor | None:
    """``[B]`` real tokens per row (``attention_mask.sum(-1)``) from the handles, or None when they do not say."""
    column = batch.non_tensors.get(RESIDENT)
    if column is None or any(source.row_tokens is None for source, _ in column):
        return None
    return torch.tensor([source.row_tokens[index] for source, index in column], dtype=torch.long)
