"""Constraints a config field declares in its type: the values it may take.

    mode: Annotated[str, OneOf("sync", "async")] = "sync"             # one of these strings
    n: Annotated[int, AtLeast(1)] = 8                                 # a bound
    top_p: Annotated[float, Above(0.0), AtMost(1.0)] = 1.0            # two bounds: "in (0, 1]"
    dtype: Annotated[str, OneOf("float32", "bfloat16")] | None = None  # None passes where allowed

A bound may carry a note that the message repeats (``AtLeast(0, "0: no limit")``).
:func:`check_fields` reads the constraints of every section of a composed config, plug-in
sections included, and raises :class:`~verity.config.errors.ConfigError` naming the key, the
value and what was expected, before anything is built. OmegaConf and Hydra see only the
plain type (``Annotated`` extras are invisible to them), so composing is unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any

from verity.config.errors import ConfigError

__all__ = ["Above", "AtLeast", "AtMost", "OneOf", "check_fields", "field_problems"]


@dataclass(frozen=True, init=False)
class OneOf:
    """``OneOf("a", "b")`` (or ``OneOf(*TUPLE)``): the values a string field may take."""

    values: tuple[str, ...]

    def __init__(self, *values: str) -> None:
        object.__setattr__(self, "values", tuple(values))

    def problem(self, value: Any, nullable: bool = False) -> str | None:
        if value in self.values:
            return None
        return f"must be one of {'|'.join(self.values)}{' or null' if nullable else ''}, got {value!r}"


@dataclass(frozen=True)
class Bound:
    """One side of a numeric range; use :class:`AtLeast`, :class:`Above` or :class:`AtMost`."""

    limit: float
    note: str = ""
    strict: bool = False
    upper: bool = False

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.upper:
            return value < self.limit if self.strict else value <= self.limit
        return value > self.limit if self.strict else value >= self.limit


def AtLeast(limit: float, note: str = "") -> Bound:  # noqa: N802 (reads as a type annotation)
    """The value is ``>= limit``."""
    return Bound(limit, note)


def Above(limit: float, note: str = "") -> Bound:  # noqa: N802
    """The value is ``> limit``."""
    return Bound(limit, note, strict=True)


def AtMost(limit: float, note: str = "") -> Bound:  # noqa: N802
    """The value is ``<= limit``."""
    return Bound(limit, note, upper=True)


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _range_problem(bounds: list[Bound], value: Any, nullable: bool = False) -> str | None:
    """``"must be in (0, 1], got 2"`` for the bounds ``value`` breaks; None when it keeps them all."""
    if not isinstance(value, int | float) or isinstance(value, bool) or all(b.holds(value) for b in bounds):
        return None
    lower = [b for b in bounds if not b.upper]
    upper = [b for b in bounds if b.upper]
    if lower and upper:
        lo, hi = lower[0], upper[0]
        rule = f"in {'(' if lo.strict else '['}{_number(lo.limit)}, {_number(hi.limit)}{')' if hi.strict else ']'}"
    else:
        b = bounds[0]
        sign = ("<" if b.strict else "<=") if b.upper else (">" if b.strict else ">=")
        rule = f"{sign} {_number(b.limit)}"
    notes = "; ".join(b.note for b in bounds if b.note)
    return f"must be {rule}{' or null' if nullable else ''}{f' ({notes})' if notes else ''}, got {value}"


def _constraints(annotation: Any) -> list[Any]:
    """The :class:`OneOf` and :class:`Bound` markers of a field's annotation (inside ``X | None`` too)."""
    if typing.get_origin(annotation) is Annotated:
        return [m for m in annotation.__metadata__ if isinstance(m, OneOf | Bound)]
    found: list[Any] = []
    for arg in typing.get_args(annotation):  # Optional[Annotated[...]]
        if typing.get_origin(arg) is Annotated:
            found += _constraints(arg)
    return found


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except (NameError, TypeError):  # an annotation that does not resolve: nothing to check there
        return {}


def field_problems(section: Any, prefix: str = "") -> list[str]:
    """``"key must be ..., got ..."`` for every field of the dataclass ``section`` (and those nested in it)
    whose value breaks its declared constraints; ``prefix`` is prepended to each key."""
    problems: list[str] = []
    hints = _hints(type(section))
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            problems += field_problems(value, key + ".")
            continue
        if value is None:
            continue
        annotation = hints.get(f.name)
        markers = _constraints(annotation)
        nullable = type(None) in typing.get_args(annotation)
        choices = [m for m in markers if isinstance(m, OneOf)]
        bounds = [m for m in markers if isinstance(m, Bound)]
        problems_here = [c.problem(value, nullable) for c in choices]
        if bounds:
            problems_here.append(_range_problem(bounds, value, nullable))
        for problem in problems_here:
            if problem:
                problems.append(f"{key} {problem}")
    return problems


def check_fields(cfg: Any) -> None:
    """Raise :class:`ConfigError` with the first field of ``cfg`` that breaks its declared constraints."""
    problems = field_problems(cfg)
    if problems:
        raise ConfigError(problems[0])
