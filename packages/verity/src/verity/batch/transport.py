"""How a Batch's rows travel: tensors through pickle and Ray, and rows that stay where they were made.

**Tensors on the wire.** CPU tensors are pickled as numpy arrays (:func:`pack_tensor`):
pickle protocol 5 (which Ray uses) carries them as out-of-band buffers, so they are not
re-encoded by ``torch.save`` and Ray's object store holds them without extra copies. Dtypes
numpy lacks (bfloat16, float8, ...) go as a same-size integer view and are viewed back. On
arrival (:func:`unpack_tensor`) a read-only buffer (Ray's shared memory) is copied once, so
receivers can modify tensors in place. GPU tensors, tensors that require grad, and sparse
tensors use torch's own pickling. Values arrive as they were sent, bit for bit.

**Rows that stay on the worker that made them.** A generated row's prompt-aligned tensors —
every declared key whose second dimension is ``P`` or ``P+R`` (``prompts``, ``input_ids``,
``attention_mask``, ``position_ids``) — are most of its bytes, and the driver rarely reads them.
So a generating worker puts them in its node's Ray object store, one object per key
(:func:`keep_resident`, also the ``[B, R]`` keys named by ``also``), and answers the batch
without them, carrying one handle per row in the per-row column :data:`RESIDENT` instead:
``(RowSource, row index)``. On the driver such a key behaves like any other: ``key in batch``
and ``keys()`` list it, row operations (``select``, ``index``, ``split``, ``concat``,
``repeat_interleave``, ``union``) carry its handles, setting it replaces it by the driver's
value, and reading it (``batch[key]``) fetches the key's rows from the object store that holds
them (:func:`fetch_key`; counted in ``perf/driver_bytes_received``) and keeps them in the batch.

When a group call sends a batch with handles to a worker, the worker's host calls
:func:`materialize` before the method runs: each key's objects are fetched once (from the
node that made them, never through the driver), the rows are gathered in order and the prompt
side is left-padded to the widest source when rows of differently wide prompt batches meet
(dynamic sampling's rounds). The method sees a whole batch. A stored object lives as long as a
handle to it does: Ray frees it when the step's batch is dropped on the driver.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "RESIDENT",
    "DRIVER_TRANSFERS",
    "HandleRuns",
    "RowSource",
    "TransferMeter",
    "fetch_key",
    "handle_column_bytes",
    "keep_resident",
    "materialize",
    "pack_tensor",
    "payload_bytes",
    "prompt_aligned_keys",
    "resident_row_tokens",
    "unpack_tensor",
]

# ---------------------------------------------------------------------- tensors on the wire

# Same-size integer dtypes used to send tensors whose dtype numpy lacks.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def pack_tensor(value: torch.Tensor) -> Any:
    """A tensor as it is pickled: a CPU tensor as ``("np", array, dtype name or None)``, others as themselves."""
    if value.device.type != "cpu" or value.requires_grad or value.is_sparse:
        return value
    value = value.contiguous()
    dtype = value.dtype
    try:
        return ("np", value.numpy(), None)
    except TypeError:
        carrier = _INT_OF_SIZE[value.element_size()]
        return ("np", value.view(carrier).numpy(), str(dtype).removeprefix("torch."))


def unpack_tensor(packed: Any) -> torch.Tensor:
    """The tensor :func:`pack_tensor` was given (writable: a read-only buffer is copied once)."""
    if isinstance(packed, torch.Tensor):
        return packed
    _, array, dtype_name = packed
    if not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    if dtype_name is not None:
        tensor = tensor.view(getattr(torch, dtype_name))
    return tensor


# ---------------------------------------------------------------------- resident rows

RESIDENT = "_resident"
"""The per-row column of handles: ``(RowSource, index of the row in the stored block)``."""

# left padding that keeps a row's meaning: masks 0, position ids 0 (cumsum(mask) - 1 clipped at 0)
_ZERO_FILL_KEYS = ("attention_mask", "position_ids")

OBJECT_ID_BYTES = 28
"""Bytes of a Ray object id, counted per stored object a handle column refers to."""


class HandleRuns:
    """A handle column as it is pickled: one ``(source, first index, rows)`` per run of rows that
    come from one source in order, in place of a ``(source, index)`` tuple per row."""

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


@dataclass(frozen=True, eq=False)
class RowSource:
    """One stored block of rows: an object-store reference per key, and what the rows need to meet others.

    Attributes:
        refs: ``{key: Ray ObjectRef of that key's tensor [rows, ...]}`` for every stored key.
        keys: the resident keys this handle gives access to (a subset of ``refs``).
        prompt_width: ``P`` of the stored rows (prompt columns, left-padded).
        pad_token_id: the id left padding of token keys uses.
        row_tokens: per stored row, its real tokens (``attention_mask.sum(-1)``), or ``None``.
    """

    refs: Mapping[str, Any]
    keys: tuple[str, ...]
    prompt_width: int
    pad_token_id: int
    row_tokens: tuple[int, ...] | None = None

    @property
    def block_id(self) -> str:
        """The stored block's id (equal for every copy of a handle to it)."""
        ref = next(iter(self.refs.values()))
        return ref.hex() if hasattr(ref, "hex") else str(id(ref))

    def restricted(self, keys: Sequence[str]) -> RowSource:
        """The same stored rows, giving access to ``keys`` only (in this source's order)."""
        wanted = set(keys)
        kept = tuple(k for k in self.keys if k in wanted)
        return RowSource(self.refs, kept, self.prompt_width, self.pad_token_id, self.row_tokens)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSource) and (self.block_id, self.keys) == (other.block_id, other.keys)

    def __hash__(self) -> int:
        return hash((self.block_id, self.keys))


def handle_column_bytes(column: Sequence[tuple[Any, int]]) -> int:
    """Bytes a handle column takes on the wire, as :class:`HandleRuns`: each distinct source's
    description (an object id per key, keys, prompt width, row token counts) once, two integers a run."""
    runs = HandleRuns(column).runs
    sources = {id(source): source for source, _, _ in runs}.values()
    described = sum(
        OBJECT_ID_BYTES * len(s.refs)
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


def restrict_column(
    column: Sequence[tuple[RowSource, int]], keys: Sequence[str]
) -> list[tuple[RowSource, int]]:
    """The handle column giving access to ``keys`` only (each source rebuilt once)."""
    swapped: dict[int, RowSource] = {}
    out = []
    for source, index in column:
        new = swapped.get(id(source))
        if new is None:
            new = swapped[id(source)] = source.restricted(keys)
        out.append((new, index))
    return out


def keep_resident(
    batch: Any, pad_token_id: int, put: Callable[[Any], Any] | None = None, *, also: Sequence[str] = ()
) -> Any:
    """Put ``batch``'s prompt-aligned tensors in Ray's object store; return the batch with handles instead.

    ``also``: more keys to keep with them, where the batch has them — ``[B, R]`` keys the driver
    does not read in this run (``rollout_logprobs``, see
    :func:`verity.workers.rollout_side.resident_response_keys`); ``R`` is the rollout's
    ``max_new_tokens``, the same in every source, so they need no padding when rows meet.
    Each key is stored as its own object, so that whoever reads one key fetches that key only.
    Returns ``batch`` unchanged when it has no prompt-aligned tensor or Ray is not running in
    this process (a batch built outside a worker group keeps its tensors). ``put`` replaces
    ``ray.put`` (tests).
    """
    from verity.batch.core import Batch

    keys = prompt_aligned_keys(batch.tensor_keys())
    if not keys:
        return batch
    keys += [k for k in also if k in batch.tensor_keys() and k not in keys]
    if put is None:
        import ray

        if not ray.is_initialized():
            return batch
        put = ray.put
    if "prompts" in keys:
        width = int(batch["prompts"].shape[1])
    elif "input_ids" in keys and "responses" in batch.tensor_keys():
        width = int(batch["input_ids"].shape[1] - batch["responses"].shape[1])
    else:
        width = int(batch[keys[0]].shape[1])
    tokens = (
        tuple(int(n) for n in batch["attention_mask"].sum(-1).tolist()) if "attention_mask" in keys else None
    )
    refs = {key: put(Batch.from_dict({key: batch[key]})) for key in keys}
    source = RowSource(refs, tuple(keys), width, int(pad_token_id), tokens)
    light = [k for k in batch.tensor_keys() if k not in keys]
    out = Batch(batch.tensors.select(*light), dict(batch.non_tensors), dict(batch.meta), batch.pad_rows)
    out.non_tensors[RESIDENT] = [(source, i) for i in range(len(batch))]
    return out


def _gather_key(
    key: str,
    column: Sequence[tuple[RowSource, int]],
    fetch: Callable[[list[Any]], list[Any]],
    pad_prompt: bool,
) -> torch.Tensor:
    """``key``'s rows in column order, fetched once per source, prompt side left-padded to the widest."""
    sources = column_sources(column)
    order = {source: i for i, source in enumerate(sources)}
    stored = fetch([source.refs[key] for source in sources])
    width = max(source.prompt_width for source in sources)
    picks: list[list[int]] = [[] for _ in sources]
    positions: list[list[int]] = [[] for _ in sources]
    for position, (source, index) in enumerate(column):
        s = order[source]
        picks[s].append(index)
        positions[s].append(position)
    out = None
    for s, source in enumerate(sources):
        if not picks[s]:
            continue
        part = stored[s][key][torch.tensor(picks[s])]
        extra = width - source.prompt_width if pad_prompt else 0
        if extra:
            fill = 0 if key in _ZERO_FILL_KEYS or part.dtype == torch.bool else source.pad_token_id
            pad = torch.full((part.shape[0], extra, *part.shape[2:]), fill, dtype=part.dtype)
            part = torch.cat([pad, part], dim=1)
        if out is None:
            out = part.new_empty((len(column), *part.shape[1:]))
        out[torch.tensor(positions[s])] = part
    assert out is not None
    return out


def _ray_get(refs: list[Any]) -> list[Any]:
    import ray

    return ray.get(refs)


def materialize(batch: Any, fetch: Callable[[list[Any]], list[Any]] | None = None) -> Any:
    """``batch`` with its resident keys fetched and its handle column dropped (a batch without handles as is).

    Each key's object is fetched once per source (``ray.get``, or ``fetch`` for tests); rows keep
    their order; the prompt side of every prompt-aligned key is left-padded to the widest
    source's ``P`` (token keys with the source's ``pad_token_id``, masks and position ids with 0).
    """
    from tensordict import TensorDict

    from verity.batch.core import Batch

    column = batch.non_tensors.get(RESIDENT)
    if column is None:
        return batch
    keys = batch.resident_keys()
    prompt_keys = set(prompt_aligned_keys(keys))
    tensors = dict(batch.tensors.items())
    rest = {k: v for k, v in batch.non_tensors.items() if k != RESIDENT}
    if len(batch):
        for key in keys:
            tensors[key] = _gather_key(key, column, fetch or _ray_get, key in prompt_keys)
    return Batch(TensorDict(tensors, batch_size=[len(batch)]), rest, dict(batch.meta), batch.pad_rows)


def fetch_key(batch: Any, key: str, fetch: Callable[[list[Any]], list[Any]] | None = None) -> torch.Tensor:
    """Resident ``key``'s rows ``[B, ...]``, fetched into this process as :func:`materialize` would.

    Counted as received by the driver's meter (``perf/driver_bytes_received``). ``Batch.__getitem__``
    calls this for a resident key and keeps the tensor, so a key is fetched once.
    """
    column = batch.non_tensors[RESIDENT]
    prompt_side = key in prompt_aligned_keys([key])
    if not len(batch):
        return materialize(batch.select(key), fetch)[key]
    moved: list[Any] = []

    def fetch_counted(refs: list[Any]) -> list[Any]:
        moved.extend((fetch or _ray_get)(refs))
        return moved

    value = _gather_key(key, column, fetch_counted, prompt_side)
    DRIVER_TRANSFERS.add(received=moved)  # whole stored objects: what crossed, not only the rows read
    return value


def resident_row_tokens(batch: Any) -> torch.Tensor | None:
    """``[B]`` real tokens per row (``attention_mask.sum(-1)``) from the handles, or None when they do not say.

    Lets the driver count tokens without fetching the masks."""
    column = batch.non_tensors.get(RESIDENT)
    if column is None or any(source.row_tokens is None for source, _ in column):
        return None
    return torch.tensor([source.row_tokens[index] for source, index in column], dtype=torch.long)


# ---------------------------------------------------------------------- the driver's meter


def row_value_bytes(non_tensors: Mapping[str, list]) -> int:
    """Bytes of a batch's per-row Python values on the wire: each list pickled, the handle column as
    its runs, a list holding tensors as their ``nbytes`` (plus the pickled rest)."""
    total = 0
    for key, values in non_tensors.items():
        if key == RESIDENT:
            total += handle_column_bytes(values)
        elif any(isinstance(v, torch.Tensor) for v in values):
            rest = [None if isinstance(v, torch.Tensor) else v for v in values]
            total += sum(int(v.nbytes) for v in values if isinstance(v, torch.Tensor))
            total += len(pickle.dumps(rest, protocol=pickle.HIGHEST_PROTOCOL))
        else:
            total += len(pickle.dumps(values, protocol=pickle.HIGHEST_PROTOCOL))
    return total


def payload_bytes(value: Any) -> int:
    """Bytes in ``value`` as it travels: a tensor's ``nbytes``; a ``Batch``'s tensors plus its per-row
    values (:func:`row_value_bytes`); lists, tuples and dicts of them summed; 0 for anything else
    (a metrics dict of floats; the framing of pickled objects is not counted)."""
    from verity.batch.core import Batch

    if isinstance(value, torch.Tensor):
        return int(value.nbytes)
    if isinstance(value, Batch):
        return sum(int(value.tensors[k].nbytes) for k in value.tensor_keys()) + row_value_bytes(
            value.non_tensors
        )
    if isinstance(value, list | tuple):
        return sum(payload_bytes(item) for item in value)
    if isinstance(value, dict):
        return sum(payload_bytes(item) for item in value.values())
    return 0


class TransferMeter:
    """Running totals of bytes sent to and received from workers; thread-safe.

    Every worker-group call adds its arguments (a broadcast batch once: it is put in the object
    store once; a split batch's shards add up to the batch) to ``sent`` and every rank's answer to
    ``received``; a resident key read on the driver (:func:`fetch_key`) adds the objects fetched.
    The RL loop takes it after each step (``perf/driver_bytes_sent``, ``perf/driver_bytes_received``).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sent = 0
        self.received = 0

    def add(self, *, sent: Any = None, received: Any = None) -> None:
        """Count the bytes of ``sent`` (call arguments) and ``received`` (answers, fetched rows)."""
        s, r = payload_bytes(sent), payload_bytes(received)
        with self._lock:
            self.sent += s
            self.received += r

    def take(self) -> tuple[int, int]:
        """``(sent, received)`` bytes since the last ``take``; resets both to 0."""
        with self._lock:
            out = (self.sent, self.received)
            self.sent = self.received = 0
        return out


DRIVER_TRANSFERS = TransferMeter()
"""The driver process's meter (group calls and driver-side fetches add to it; the RL loop takes it each step)."""
