"""The declared table of every batch key that crosses a role boundary.

Each key has symbolic dimensions, a dtype kind and a one-line meaning. Dimension
symbols are shared across keys: every ``B`` in a batch is the same number, every ``R``
is the same number, and ``P+R`` must equal ``P`` plus ``R`` when both are known (when
only one of them is known the other is inferred from the ``P+R`` key). A dimension may
also be a fixed integer, and ``...`` as the last dimension allows any trailing shape.

Dtype kinds: ``float`` (floating point), ``int`` (integers, not bool), ``bool``,
``mask`` (float, int or bool 0/1), ``number`` (any real tensor), ``object`` (a
per-sample Python list in ``Batch.non_tensors`` rather than a tensor).

Recipes add their own keys with :func:`register_key`; :func:`validate` rejects keys
that were never declared, so a typo (``old_log_probs``) fails at dispatch with the
key's name instead of silently producing a new column.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from verity.batch.core import Batch

__all__ = [
    "BatchSchemaError",
    "KeySpec",
    "declared_keys",
    "describe",
    "get_key",
    "register_key",
    "validate",
]

DTYPE_KINDS = ("float", "int", "bool", "mask", "number", "object")
_SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class BatchSchemaError(ValueError):
    """A batch does not match the declared schema (unknown key, wrong shape or dtype)."""


@dataclass(frozen=True)
class KeySpec:
    """One declared key: ``dims`` like ``("B", "R")``, a dtype kind and its meaning."""

    name: str
    dims: tuple[str, ...]
    dtype: str
    meaning: str

    @property
    def is_tensor(self) -> bool:
        """True for tensor keys, False for per-sample Python lists."""
        return self.dtype != "object"

    def shape_text(self) -> str:
        """The symbolic shape, e.g. ``[B, P+R]``."""
        return "[" + ", ".join(self.dims) + "]"


_REGISTRY: dict[str, KeySpec] = {}


def _parse_dim(name: str, dim: str | int, position: int, last: bool) -> str:
    if isinstance(dim, int) and not isinstance(dim, bool):
        if dim < 0:
            raise ValueError(f"register_key({name!r}): dimension {position} is negative ({dim})")
        return str(dim)
    if not isinstance(dim, str):
        raise TypeError(f"register_key({name!r}): dimension {position} must be a str or int, got {dim!r}")
    dim = dim.replace(" ", "")
    if dim == "...":
        if not last:
            raise ValueError(f"register_key({name!r}): '...' is allowed only as the last dimension")
        return dim
    if dim.isdigit():
        return dim
    terms = dim.split("+")
    if not all(_SYMBOL.match(t) for t in terms):
        raise ValueError(
            f"register_key({name!r}): dimension {position} {dim!r} must be a symbol like 'R', "
            "a sum like 'P+R', an integer or '...'"
        )
    return dim


def register_key(
    name: str,
    dims: Sequence[str | int],
    dtype: str,
    meaning: str,
    *,
    replace: bool = False,
) -> KeySpec:
    """Declare a batch key. ``dims`` must start with ``"B"`` (the batch dimension).

    Re-registering an identical spec is a no-op; a different spec for an existing key
    needs ``replace=True``.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_key: name must be a non-empty str, got {name!r}")
    dims = tuple(dims)
    if not dims or dims[0] != "B":
        raise ValueError(f"register_key({name!r}): dims must start with 'B', got {list(dims)}")
    if dtype not in DTYPE_KINDS:
        raise ValueError(f"register_key({name!r}): dtype must be one of {DTYPE_KINDS}, got {dtype!r}")
    if dtype == "object" and dims != ("B",):
        raise ValueError(
            f"register_key({name!r}): per-sample (object) keys have dims ('B',), got {list(dims)}"
        )
    parsed = tuple(_parse_dim(name, d, i, i == len(dims) - 1) for i, d in enumerate(dims))
    spec = KeySpec(name, parsed, dtype, meaning)
    existing = _REGISTRY.get(name)
    if existing is not None and existing != spec and not replace:
        raise ValueError(
            f"register_key: {name!r} is already declared as {existing.shape_text()} {existing.dtype}; "
            "pass replace=True to change it"
        )
    _REGISTRY[name] = spec
    return spec


def get_key(name: str) -> KeySpec:
    """The declared spec of ``name``; KeyError naming the key if it was never declared."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"batch key {name!r} is not declared; declare it with verity.batch.register_key"
        ) from None


def declared_keys() -> dict[str, KeySpec]:
    """A copy of the declared table, in declaration order."""
    return dict(_REGISTRY)


def describe() -> str:
    """The declared table as Markdown (key | shape | dtype | meaning)."""
    lines = ["| key | shape | dtype | meaning |", "|---|---|---|---|"]
    for spec in _REGISTRY.values():
        lines.append(f"| `{spec.name}` | `{spec.shape_text()}` | {spec.dtype} | {spec.meaning} |")
    return "\n".join(lines)


def _dtype_ok(kind: str, dtype: torch.dtype) -> bool:
    if kind == "float":
        return dtype.is_floating_point
    if kind == "int":
        return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool
    if kind == "bool":
        return dtype == torch.bool
    if kind in ("mask", "number"):
        return not dtype.is_complex
    return True


class _Bindings:
    """Values of the dimension symbols seen so far, with the key that fixed each one."""

    def __init__(self) -> None:
        self.value: dict[str, int] = {}
        self.source: dict[str, str] = {}

    def bind(self, symbol: str, value: int, key: str) -> None:
        self.value[symbol] = value
        self.source[symbol] = key

    def explain(self, spec: KeySpec) -> str:
        shown = []
        for dim in spec.dims:
            terms = dim.split("+")
            if dim.isdigit() or dim == "...":
                shown.append(dim)
            elif all(t in self.value for t in terms):
                shown.append(str(sum(self.value[t] for t in terms)))
            elif dim in self.value:
                shown.append(str(self.value[dim]))
            else:
                shown.append(dim)
        origins = sorted(
            {
                f"{t}={self.value[t]} from {self.source[t]!r}"
                for d in spec.dims
                for t in d.split("+")
                if t in self.value
            }
        )
        where = f" ({'; '.join(origins)})" if origins else ""
        return f"{spec.shape_text()} = [{', '.join(shown)}]{where}"


def validate(
    batch: Batch, keys: Iterable[str] | None = None, *, allow_unknown: bool = False
) -> dict[str, int]:
    """Check ``batch`` against the declared schema; return the dimension values found.

    ``keys``: check only these keys and require each to be present (default: every key
    of the batch). Unknown keys are an error unless ``allow_unknown``. Raises
    :class:`BatchSchemaError` naming the key, the expected (symbolic and numeric) shape
    and the shape found. Returns e.g. ``{"B": 8, "P": 5, "R": 7, "P+R": 12}``.
    """
    if not isinstance(batch, Batch):
        raise TypeError(f"validate: expected a Batch, got {type(batch).__name__}")
    if keys is None:
        names = batch.keys()
    else:
        names = list(keys)
        missing = [k for k in names if k not in batch]
        if missing:
            raise BatchSchemaError(f"batch is missing required key(s) {missing}; it has {batch.keys()}")
    unknown = [k for k in names if k not in _REGISTRY]
    if unknown and not allow_unknown:
        raise BatchSchemaError(
            f"batch key(s) {unknown} are not declared in the batch schema "
            "(a typo, or a new key that needs verity.batch.register_key)"
        )
    order = {k: i for i, k in enumerate(_REGISTRY)}
    resident = set(batch.resident_keys())  # checked where they live, when a worker materializes them
    specs = sorted(
        (_REGISTRY[k] for k in names if k in _REGISTRY and k not in resident), key=lambda s: order[s.name]
    )

    bindings = _Bindings()
    bindings.bind("B", len(batch), "batch size")
    deferred: list[tuple[KeySpec, str, int]] = []
    for spec in specs:
        in_lists = spec.name in batch.non_tensors
        if not spec.is_tensor:
            if not in_lists:
                raise BatchSchemaError(
                    f"batch key {spec.name!r}: expected a per-sample list (non-tensor), got a tensor"
                )
            continue
        if in_lists:
            raise BatchSchemaError(
                f"batch key {spec.name!r}: expected a tensor {spec.shape_text()} of {spec.dtype}, got a per-sample list"
            )
        value = batch.tensors.get(spec.name)
        shape = list(value.shape)
        if not _dtype_ok(spec.dtype, value.dtype):
            raise BatchSchemaError(
                f"batch key {spec.name!r}: expected dtype kind {spec.dtype}, got {value.dtype}"
            )
        open_end = spec.dims[-1] == "..."
        fixed = spec.dims[:-1] if open_end else spec.dims
        if len(shape) < len(fixed) or (not open_end and len(shape) != len(fixed)):
            raise BatchSchemaError(
                f"batch key {spec.name!r}: expected shape {bindings.explain(spec)}, got {shape} "
                f"({len(shape)} dims instead of {len(fixed)}{'+' if open_end else ''})"
            )
        for pos, dim in enumerate(fixed):
            size = shape[pos]
            if dim.isdigit():
                ok = size == int(dim)
            elif "+" in dim:
                deferred.append((spec, dim, size))
                continue
            elif dim in bindings.value:
                ok = size == bindings.value[dim]
            else:
                bindings.bind(dim, size, spec.name)
                ok = True
            if not ok:
                raise BatchSchemaError(
                    f"batch key {spec.name!r}: expected shape {bindings.explain(spec)}, got {shape}"
                )

    _resolve_sums(deferred, bindings, batch)
    return dict(bindings.value)


def _resolve_sums(deferred: list[tuple[KeySpec, str, int]], bindings: _Bindings, batch: Batch) -> None:
    """Check ``P+R``-style dimensions, inferring one unknown term when the others are known."""
    pending = list(deferred)
    progress = True
    while pending and progress:
        progress = False
        for item in list(pending):
            spec, dim, size = item
            terms = dim.split("+")
            unknown = [t for t in terms if t not in bindings.value]
            if len(unknown) == 1:
                rest = size - sum(bindings.value[t] for t in terms if t != unknown[0])
                if rest < 0:
                    shape = list(batch.tensors.get(spec.name).shape)
                    raise BatchSchemaError(
                        f"batch key {spec.name!r}: expected shape {bindings.explain(spec)}, got {shape}"
                    )
                bindings.bind(unknown[0], rest, spec.name)
                unknown = []
            if not unknown:
                if size != sum(bindings.value[t] for t in terms):
                    shape = list(batch.tensors.get(spec.name).shape)
                    raise BatchSchemaError(
                        f"batch key {spec.name!r}: expected shape {bindings.explain(spec)}, got {shape}"
                    )
                pending.remove(item)
                progress = True
    # Sums with two or more unknown terms: all keys using the same sum must agree.
    for spec, dim, size in pending:
        if dim in bindings.value and bindings.value[dim] != size:
            shape = list(batch.tensors.get(spec.name).shape)
            raise BatchSchemaError(
                f"batch key {spec.name!r}: expected shape {spec.shape_text()} with {dim}={bindings.value[dim]} "
                f"(from {bindings.source[dim]!r}), got {shape}"
            )
        if dim not in bindings.value:
            bindings.bind(dim, size, spec.name)


# --------------------------------------------------------------------------- the declared keys
# Token layout (shared by every role): prompt part [B, P] left-padded, response part
# [B, R] right-padded, full sequence [B, P+R] = cat(prompt, response).
_CORE_KEYS = [
    ("prompts", ("B", "P"), "int", "prompt token ids, left-padded with pad_token_id"),
    ("input_ids", ("B", "P+R"), "int", "token ids of prompt then response (R=0 before generation)"),
    ("attention_mask", ("B", "P+R"), "mask", "1 on real tokens of input_ids, 0 on padding"),
    ("position_ids", ("B", "P+R"), "int", "cumsum(attention_mask)-1 clipped at 0"),
    ("responses", ("B", "R"), "int", "generated token ids, right-padded with pad_token_id"),
    ("response_mask", ("B", "R"), "mask", "1 on real response tokens up to and including EOS, 0 after"),
    ("rollout_logprobs", ("B", "R"), "float", "log-prob of each response token under the rollout engine"),
    (
        "routed_experts",
        ("B", "P+R", "L", "K"),
        "int",
        "experts the rollout chose per column and MoE layer (rollout routing replay; -1: none recorded)",
    ),
    (
        "old_logprobs",
        ("B", "R"),
        "float",
        "log-prob of each response token under the policy before the update",
    ),
    ("logprobs", ("B", "R"), "float", "log-prob of each response token under the current policy"),
    ("ref_logprobs", ("B", "R"), "float", "log-prob of each response token under the reference policy"),
    ("values", ("B", "R"), "float", "critic value estimate at each response token"),
    (
        "entropy",
        ("B", "R"),
        "float",
        "entropy (nats) of the policy's token distribution at each response token",
    ),
    # the sampler-vs-trainer gap (verity.algorithms.logprob_gap), per row, answered by compute_log_prob
    ("rollout_logprob_gap_sum", ("B",), "float", "sum over response tokens of |old - rollout log-probs|"),
    ("rollout_logprob_gap_tokens", ("B",), "float", "response tokens counted in rollout_logprob_gap_sum"),
    ("rollout_logprob_gap_row_max", ("B",), "float", "largest |old_logprobs - rollout_logprobs| in the row"),
    (
        "token_scores",
        ("B", "R"),
        "float",
        "verifier/reward-model score placed on response tokens, before KL penalty",
    ),
    (
        "token_rewards",
        ("B", "R"),
        "float",
        "per-token reward used by the advantage estimator (after any KL penalty)",
    ),
    ("advantages", ("B", "R"), "float", "advantage of each response token"),
    ("returns", ("B", "R"), "float", "return (value target) of each response token"),
    ("scores", ("B",), "float", "sequence-level reward of each sample"),
    ("acc", ("B",), "float", "1.0 where the verifier judged the answer correct, else 0.0"),
    ("group", ("B",), "int", "group id: the prompt index shared by the n samples of one prompt"),
    ("data_source", ("B",), "object", "dataset name that selects the reward function"),
    ("ground_truth", ("B",), "object", "reference answer given to the verifier"),
    ("extra_info", ("B",), "object", "dict of dataset-specific per-sample information"),
    ("prompt_text", ("B",), "object", "prompt as text, after chat templating"),
    ("raw_prompt", ("B",), "object", "prompt as a chat message list [{'role', 'content'}, ...]"),
    ("response_text", ("B",), "object", "decoded response text"),
    ("uid", ("B",), "object", "unique id of the prompt a sample was generated from"),
    ("reward_extra", ("B",), "object", "dict of extra per-sample outputs of the reward function"),
    # prompts with images (verity.data.multimodal): per-row tensors of different lengths, never padded
    (
        "pixel_values",
        ("B",),
        "object",
        "per row: the image processor's patches [patches, C*T*P*P] of the row's images, in prompt order",
    ),
    ("image_grid_thw", ("B",), "object", "per row: int64 [images, 3] patch grid (t, h, w) of each image"),
    # multi-turn rollouts (the agent loop): responses interleave model turns and tool answers;
    # response_mask is 1 on model tokens only, attention_mask[:, P:] on both
    ("num_turns", ("B",), "int", "model turns in the response (agent loop)"),
    ("tool_calls", ("B",), "int", "tool calls the response made and got answered (agent loop)"),
    ("tool_errors", ("B",), "int", "tool calls answered with an error message (agent loop)"),
    (
        "response_attention",
        ("B", "R"),
        "mask",
        "1 on every real response token, the model's and the tools' (agent loop; response_mask: the model's)",
    ),
    ("tool_tokens", ("B",), "int", "response tokens written by tools, attended but not trained (agent loop)"),
    ("tool_wait_s", ("B",), "float", "seconds the response waited for its tool answers, queue included (agent loop)"),
    ("tool_queue_s", ("B",), "float", "seconds its tool calls waited for a free tool worker (agent loop)"),
    (
        "agent_engine_busy_fraction",
        ("B",),
        "float",
        "share of its generate call's wall time the engine was decoding (agent loop; same on every row of a call)",
    ),
    (
        "agent_requests_in_flight_mean",
        ("B",),
        "float",
        "requests the engine held per decode step, mean over its generate call (agent loop; same per call)",
    ),
    (
        "agent_requests_in_flight_max",
        ("B",),
        "float",
        "most requests the engine held at one step of its generate call (agent loop; same per call)",
    ),
    (
        "trajectory",
        ("B",),
        "object",
        "dict: the response's turns as chat messages with tool calls and answers, counters, stop reason",
    ),
]

for _name, _dims, _dtype, _meaning in _CORE_KEYS:
    register_key(_name, _dims, _dtype, _meaning)
