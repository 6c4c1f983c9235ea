"""How a group call is spread over the ranks of a worker group and how answers come back.

A worker method declares its modes with :func:`register`::

    class Actor(Worker):
        @register(Dispatch.DP_SPLIT)          # collect defaults to Collect.DP_CONCAT
        def compute_logprobs(self, batch: Batch) -> Batch: ...

        @register(Dispatch.BROADCAST)         # collect defaults to Collect.ALL
        def init_model(self, config) -> None: ...

Dispatch modes (what each rank receives):

* ``BROADCAST`` - every rank gets the same arguments.
* ``DP_SPLIT`` - every :class:`~verity.batch.Batch` argument is split into ``dp_size``
  parts (padding by repeating rows, see ``Batch.split``); a rank gets the part of its
  data-parallel rank. Ranks that share a ``dp_rank`` (tensor-parallel peers) get the
  same part. Positional arguments must all be batches; keyword arguments that are not
  batches go unchanged to every rank.
* ``RANK_ZERO`` - only rank 0 is called.
* ``DP_COLLECT`` - like ``BROADCAST``, but only the data-parallel collectors answer.
* ``PER_RANK`` - every argument is a list with one item per rank; rank ``i`` gets item ``i``.

Collect modes (what the driver gets back):

* ``ALL`` - the list of answers of the called ranks, in rank order.
* ``RANK_ZERO`` - rank 0's answer.
* ``DP`` - the list of the collectors' answers, in data-parallel rank order.
* ``DP_CONCAT`` - the collectors' answers joined in data-parallel rank order with the
  padding rows dropped: batches via ``Batch.concat``, tensors with ``torch.cat`` on
  dimension 0; all ``None`` gives ``None``; other objects give the ``DP`` list.
* ``NONE`` - nothing (``None``).

A data-parallel layout (:class:`DPLayout`) is reported by every worker (by default
``dp_rank = rank``, ``dp_size = world_size``, every rank a collector); a worker with
tensor or pipeline parallelism calls ``Worker.set_dp_layout`` so that exactly one rank
per data-parallel shard is the collector. A worker whose roles split the same ranks
differently (a tensor-parallel rollout over data-parallel training ranks) declares a
second, named layout (``set_dp_layout(..., name="rollout")``); a method registered with
``register(Dispatch.DP_SPLIT, layout="rollout")`` is split and collected by it, and by
the main layout where a worker declared no such name.

A ``DP_SPLIT`` call whose batch carries a :class:`~verity.batch.balance.BalanceRequest` in
``meta[BALANCE_META]`` is token-balanced: its rows are reordered before the split so that every
data-parallel rank gets about the same tokens (:func:`~verity.batch.balance.balanced_order`, each
row kept in its mini-batch), and a ``DP_CONCAT`` answer is put back in the batch's order. The
request stays on the driver.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verity.batch import Batch, BatchError, BatchSchemaError, validate
from verity.batch.balance import BALANCE_META, balanced_order, inverse_permutation, row_tokens
from verity.controller.errors import DispatchError

__all__ = [
    "CallPlan",
    "Collect",
    "DPLayout",
    "Dispatch",
    "MethodSpec",
    "collect_results",
    "plan_call",
    "register",
    "registered_methods",
]

_SPEC_ATTR = "__verity_method__"


class Dispatch(enum.Enum):
    """What each rank receives; see the module docstring."""

    BROADCAST = "broadcast"
    DP_SPLIT = "dp_split"
    RANK_ZERO = "rank_zero"
    DP_COLLECT = "dp_collect"
    PER_RANK = "per_rank"


class Collect(enum.Enum):
    """What the driver gets back; see the module docstring."""

    ALL = "all"
    RANK_ZERO = "rank_zero"
    DP = "dp"
    DP_CONCAT = "dp_concat"
    NONE = "none"


_DEFAULT_COLLECT = {
    Dispatch.BROADCAST: Collect.ALL,
    Dispatch.DP_SPLIT: Collect.DP_CONCAT,
    Dispatch.RANK_ZERO: Collect.RANK_ZERO,
    Dispatch.DP_COLLECT: Collect.DP,
    Dispatch.PER_RANK: Collect.ALL,
}


@dataclass(frozen=True)
class MethodSpec:
    """The modes declared on a worker method by :func:`register`."""

    dispatch: Dispatch
    collect: Collect
    check_schema: bool = True
    layout: str | None = None  # the named data-parallel layout it splits by; None: the main one


@dataclass(frozen=True)
class DPLayout:
    """A worker's place in data parallelism: its shard index, shard count, and whether it answers."""

    dp_rank: int
    dp_size: int
    is_collector: bool = True
    # other ways the same worker splits data, by name: ((name, layout), ...)
    named: tuple[tuple[str, DPLayout], ...] = ()

    def layout_for(self, name: str | None) -> DPLayout:
        """The layout called ``name`` (this one for ``None``, or where the worker declared no such name)."""
        for key, layout in self.named:
            if key == name:
                return layout
        return self


def register(
    dispatch: Dispatch | str | Callable = Dispatch.BROADCAST,
    collect: Collect | str | None = None,
    *,
    check_schema: bool = True,
    layout: str | None = None,
) -> Callable:
    """Declare how a worker method is dispatched and collected when called on a group.

    ``collect`` defaults by dispatch mode (BROADCAST->ALL, DP_SPLIT->DP_CONCAT,
    RANK_ZERO->RANK_ZERO, DP_COLLECT->DP, PER_RANK->ALL). With ``check_schema`` every
    Batch argument and Batch answer is checked by ``verity.batch.validate``. ``layout``
    names the data-parallel layout a DP_SPLIT / DP_COLLECT method splits and collects by
    (see the module docstring). Usable as ``@register`` (broadcast) or
    ``@register(Dispatch.DP_SPLIT)``.
    """
    if callable(dispatch) and not isinstance(dispatch, Dispatch | str):
        return register()(dispatch)
    mode = Dispatch(dispatch) if isinstance(dispatch, str) else dispatch
    if not isinstance(mode, Dispatch):
        raise TypeError(f"register: dispatch must be a Dispatch, got {dispatch!r}")
    gather = _DEFAULT_COLLECT[mode] if collect is None else Collect(collect)
    if mode is Dispatch.RANK_ZERO and gather not in (Collect.RANK_ZERO, Collect.NONE, Collect.ALL):
        raise ValueError(f"register: dispatch RANK_ZERO calls only rank 0 and cannot collect {gather.name}")
    spec = MethodSpec(mode, gather, check_schema, layout)

    def decorate(fn: Callable) -> Callable:
        if not callable(fn):
            raise TypeError(f"register: expected a method, got {fn!r}")
        setattr(fn, _SPEC_ATTR, spec)
        return fn

    return decorate


def registered_methods(cls: type) -> dict[str, MethodSpec]:
    """``{method name: MethodSpec}`` of the registered methods of ``cls`` and its bases.

    A subclass that overrides a registered method without re-registering keeps the
    base class's modes.
    """
    found: dict[str, MethodSpec] = {}
    for klass in reversed(cls.__mro__):
        for name, member in vars(klass).items():
            spec = getattr(member, _SPEC_ATTR, None)
            if isinstance(spec, MethodSpec):
                found[name] = spec
    return {name: spec for name, spec in found.items() if callable(getattr(cls, name, None))}


@dataclass
class CallPlan:
    """Which ranks to call with which arguments, and what the collector needs to know."""

    calls: list[tuple[int, tuple, dict]]
    shard_rows: list[int] = field(default_factory=list)  # rows of each dp shard (DP_SPLIT only)
    shard_pads: list[int] = field(default_factory=list)  # padding rows of each dp shard
    payload: tuple = ()  # (args, kwargs) as sent, before any split or share
    order: torch.Tensor | None = None  # [B] row order a token-balanced split sent (None: as given)


def _check_batch(label: str, where: str, batch: Batch) -> None:
    try:
        validate(batch)
    except BatchSchemaError as err:
        raise BatchSchemaError(f"{label}: {where}: {err}") from err


def dp_collectors(label: str, layouts: Sequence[DPLayout]) -> tuple[int, list[int]]:
    """``(dp_size, ranks of the collectors ordered by dp_rank)``; DispatchError if inconsistent."""
    if not layouts:
        raise DispatchError(f"{label}: the worker group has no workers")
    sizes = {layout.dp_size for layout in layouts}
    if len(sizes) != 1:
        raise DispatchError(f"{label}: workers disagree on dp_size: {sorted(sizes)}")
    dp_size = sizes.pop()
    by_dp: dict[int, int] = {}
    for rank, layout in enumerate(layouts):
        if not 0 <= layout.dp_rank < dp_size:
            raise DispatchError(
                f"{label}: rank {rank} reports dp_rank {layout.dp_rank} outside [0, {dp_size})"
            )
        if layout.is_collector:
            if layout.dp_rank in by_dp:
                raise DispatchError(
                    f"{label}: ranks {by_dp[layout.dp_rank]} and {rank} are both collectors of dp_rank {layout.dp_rank}"
                )
            by_dp[layout.dp_rank] = rank
    missing = [d for d in range(dp_size) if d not in by_dp]
    if missing:
        raise DispatchError(f"{label}: no collector rank for dp_rank(s) {missing} (dp_size {dp_size})")
    return dp_size, [by_dp[d] for d in range(dp_size)]


def plan_call(
    label: str,
    spec: MethodSpec,
    args: tuple,
    kwargs: dict,
    layouts: Sequence[DPLayout],
    share: Callable[[Any], Any] = lambda value: value,
) -> CallPlan:
    """Work out the per-rank arguments of one group call.

    ``label`` names the method in errors (``"actor.compute_logprobs"``); ``layouts`` has
    one :class:`DPLayout` per rank; ``share`` turns a value sent to many ranks into
    something cheaper to send many times (the worker group passes ``ray.put``).
    """
    if spec.check_schema:
        for i, value in enumerate(args):
            if isinstance(value, Batch):
                _check_batch(label, f"argument {i}", value)
        for key, value in kwargs.items():
            if isinstance(value, Batch):
                _check_batch(label, f"argument {key!r}", value)
    layouts = [layout.layout_for(spec.layout) for layout in layouts]
    plan = _plan(label, spec, args, kwargs, layouts, share)
    plan.payload = (args, kwargs)
    return plan


def _plan(
    label: str,
    spec: MethodSpec,
    args: tuple,
    kwargs: dict,
    layouts: Sequence[DPLayout],
    share: Callable[[Any], Any],
) -> CallPlan:
    world = len(layouts)
    mode = spec.dispatch
    if mode in (Dispatch.BROADCAST, Dispatch.DP_COLLECT):
        if mode is Dispatch.DP_COLLECT:
            dp_collectors(label, layouts)
        shared_args = tuple(share(a) if isinstance(a, Batch) else a for a in args)
        shared_kwargs = {k: share(v) if isinstance(v, Batch) else v for k, v in kwargs.items()}
        return CallPlan([(r, shared_args, shared_kwargs) for r in range(world)])
    if mode is Dispatch.RANK_ZERO:
        return CallPlan([(0, args, kwargs)])
    if mode is Dispatch.PER_RANK:
        for name, value in [*((f"argument {i}", a) for i, a in enumerate(args)), *kwargs.items()]:
            if not isinstance(value, list | tuple) or len(value) != world:
                got = (
                    f"{type(value).__name__} of length {len(value)}"
                    if isinstance(value, list | tuple)
                    else type(value).__name__
                )
                raise DispatchError(
                    f"{label} (dispatch PER_RANK): {name} must be a list with one item per rank "
                    f"({world} items), got {got}"
                )
        return CallPlan(
            [(r, tuple(a[r] for a in args), {k: v[r] for k, v in kwargs.items()}) for r in range(world)]
        )
    if mode is Dispatch.DP_SPLIT:
        return _plan_dp_split(label, args, kwargs, layouts, share)
    raise DispatchError(f"{label}: unknown dispatch mode {mode!r}")


def _plan_dp_split(
    label: str, args: tuple, kwargs: dict, layouts: Sequence[DPLayout], share: Callable[[Any], Any]
) -> CallPlan:
    dp_size, _ = dp_collectors(label, layouts)
    for i, value in enumerate(args):
        if not isinstance(value, Batch):
            raise DispatchError(
                f"{label} (dispatch DP_SPLIT): argument {i} must be a verity.batch.Batch, got {type(value).__name__}"
            )
    batches = {f"argument {i}": a for i, a in enumerate(args)}
    batches.update({f"argument {k!r}": v for k, v in kwargs.items() if isinstance(v, Batch)})
    if not batches:
        raise DispatchError(
            f"{label} (dispatch DP_SPLIT): expected at least one verity.batch.Batch argument, got none"
        )
    sizes = {name: len(b) for name, b in batches.items()}
    if len(set(sizes.values())) != 1:
        raise DispatchError(f"{label} (dispatch DP_SPLIT): Batch arguments have different sizes {sizes}")
    order = _balanced_order(label, list(batches.values()), dp_size)
    if any(BALANCE_META in b.meta for b in batches.values()):
        args = tuple(_reordered(a, order) for a in args)
        kwargs = {k: _reordered(v, order) if isinstance(v, Batch) else v for k, v in kwargs.items()}
    try:
        split_args = [a.split(dp_size) for a in args]
        split_kwargs = {k: v.split(dp_size) for k, v in kwargs.items() if isinstance(v, Batch)}
    except BatchError as err:
        raise DispatchError(
            f"{label} (dispatch DP_SPLIT): cannot split the batch across {dp_size} data-parallel ranks: {err}"
        ) from err
    reference = split_args[0] if split_args else next(iter(split_kwargs.values()))
    shard_rows, shard_pads = [len(p) for p in reference], [p.pad_rows for p in reference]
    if dp_size < len(layouts):  # several ranks per shard (tensor-parallel peers): send each shard once
        split_args = [[share(p) for p in parts] for parts in split_args]
        split_kwargs = {k: [share(p) for p in parts] for k, parts in split_kwargs.items()}
    calls = []
    for rank, layout in enumerate(layouts):
        d = layout.dp_rank
        rank_args = tuple(parts[d] for parts in split_args)
        rank_kwargs = {k: (split_kwargs[k][d] if k in split_kwargs else v) for k, v in kwargs.items()}
        calls.append((rank, rank_args, rank_kwargs))
    return CallPlan(calls, shard_rows, shard_pads, order=order)


def _balanced_order(label: str, batches: list[Batch], dp_size: int) -> torch.Tensor | None:
    """The token-balanced row order a call's :class:`BalanceRequest` asks for, or None (rows as given:
    no request, one rank, rows already padded, or token counts the driver does not have)."""
    requests = [b.meta[BALANCE_META] for b in batches if BALANCE_META in b.meta]
    if not requests or dp_size == 1 or any(b.pad_rows for b in batches):
        return None
    request = requests[0]
    rows = len(batches[0])
    costs = request.costs
    if costs is None:
        costs = next((t for t in map(row_tokens, batches) if t is not None), None)
        if costs is None:
            return None
    if costs.shape != (rows,):
        raise DispatchError(
            f"{label}: the balance request's costs have shape {tuple(costs.shape)}, expected ({rows},)"
        )
    order = balanced_order(costs, dp_size, request.mini_batch_rows)
    return None if torch.equal(order, torch.arange(rows)) else order


def _reordered(batch: Batch, order: torch.Tensor | None) -> Batch:
    """``batch`` in ``order`` (its meta without the balance request), or as it is without an order."""
    out = batch.index(order) if order is not None else batch.select(*batch.keys())
    out.pad_rows = batch.pad_rows if order is None else 0
    out.meta.pop(BALANCE_META, None)
    return out


def answer_wanted(spec: MethodSpec, rank: int) -> bool:
    """Whether the driver reads rank ``rank``'s answer: not under ``Collect.NONE``, and under
    ``Collect.RANK_ZERO`` only rank 0's. The other ranks still run the method (and report
    failures) but send ``None`` back instead of an answer nobody reads."""
    if spec.collect is Collect.NONE:
        return False
    return spec.collect is not Collect.RANK_ZERO or rank == 0


def collect_results(
    label: str,
    spec: MethodSpec,
    plan: CallPlan,
    results: dict[int, Any],
    layouts: Sequence[DPLayout],
) -> Any:
    """Turn the per-rank answers ``{rank: answer}`` into what the driver gets back."""
    layouts = [layout.layout_for(spec.layout) for layout in layouts]
    mode = spec.collect
    if mode is Collect.NONE:
        return None
    if mode is Collect.ALL:
        return [results[rank] for rank, _, _ in plan.calls]
    if mode is Collect.RANK_ZERO:
        return results[0]
    _, collectors = dp_collectors(label, layouts)
    answers = [results[rank] for rank in collectors]
    if mode is Collect.DP:
        return answers
    if mode is not Collect.DP_CONCAT:
        raise DispatchError(f"{label}: unknown collect mode {mode!r}")
    pads = plan.shard_pads or [0] * len(answers)
    rows = plan.shard_rows or [0] * len(answers)
    if all(a is None for a in answers):
        return None
    if all(isinstance(a, Batch) for a in answers):
        for d, answer in enumerate(answers):
            if answer.pad_rows == 0 and pads[d]:
                answer.pad_rows = _answer_padding(label, d, collectors[d], len(answer), rows[d], pads[d])
        joined = Batch.concat(answers)
        if spec.check_schema:
            _check_batch(label, "returned batch", joined)
        return joined if plan.order is None else joined.index(_restore(label, plan.order, len(joined)))
    if all(isinstance(a, torch.Tensor) and a.dim() >= 1 for a in answers):
        keep = [
            len(a) - _answer_padding(label, d, collectors[d], len(a), rows[d], pads[d])
            for d, a in enumerate(answers)
        ]
        tensor = torch.cat([a[:k] for a, k in zip(answers, keep, strict=True)], dim=0)
        return tensor if plan.order is None else tensor[_restore(label, plan.order, len(tensor))]
    return answers


def _restore(label: str, order: torch.Tensor, answer_rows: int) -> torch.Tensor:
    """The index that puts a token-balanced call's answer back in the order of the batch it was given."""
    if answer_rows != order.numel():
        raise DispatchError(
            f"{label}: a token-balanced call must answer one row per row sent; got {answer_rows} rows "
            f"for {order.numel()}"
        )
    return inverse_permutation(order)


def _answer_padding(
    label: str, dp_rank: int, rank: int, answer_rows: int, shard_rows: int, shard_pad: int
) -> int:
    """Padding rows in an answer: the shard's padding, scaled when the answer has k rows per input row."""
    if shard_pad == 0:
        return 0
    if answer_rows == shard_rows:
        return shard_pad
    if shard_rows and answer_rows % shard_rows == 0:
        return shard_pad * (answer_rows // shard_rows)
    raise DispatchError(
        f"{label}: rank {rank} (dp_rank {dp_rank}) returned {answer_rows} rows for a shard of {shard_rows} rows "
        f"with {shard_pad} padding rows; cannot tell which rows are padding"
    )
