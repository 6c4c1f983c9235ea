"""Every key of the run config, so that unknown keys are all reported at once with a suggestion.

Hydra stops at the first unknown key and, for ``+key=value`` (verl users type ``+``
constantly), may add a key the dataclasses do not have, which the typed config then
drops without a word. Before composing, :func:`check_keys` walks the schema
(dataclasses, resolved type hints) and checks every key of the config file and of
the overrides against it: ``+`` on a key that exists is accepted (it is an ordinary
override), every unknown key is listed with its closest known name.

A list key given one value (``data.train_files=train.parquet``) takes it as a list of one
(:func:`one_value_lists`); OmegaConf would say ``str is not a ListConfig``. In a config
file, where the file itself is composed, such a value is named with the bracket form
(:func:`one_values_for_lists`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "UnknownKey",
    "bool_keys",
    "check_keys",
    "list_keys",
    "non_bool_values",
    "one_value_lists",
    "one_values_for_lists",
    "schema_keys",
]

_FREE = "*"  # marks a mapping-typed field: any key below it is allowed
_BOOL_WORDS = ("true", "false", "yes", "no", "on", "off")


@dataclasses.dataclass(frozen=True)
class UnknownKey:
    """A key not in the schema, where it came from, the closest known key (or None) and a note on it."""

    key: str
    source: str
    suggestion: str | None
    note: str | None = None

    def describe(self) -> str:
        note = f" {self.note}" if self.note else ""
        hint = f" (did you mean {self.suggestion}?{note})" if self.suggestion else ""
        return f"{self.key} [{self.source}]{hint}"


def _is_mapping_type(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_is_mapping_type(a) for a in typing.get_args(tp) if a is not type(None))
    return tp is dict or origin in (dict, Mapping) or tp is Any


def _dataclass_of(tp: Any) -> type | None:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        if isinstance(arg, type) and dataclasses.is_dataclass(arg):
            return arg
    return None


def schema_keys(cls: type, prefix: str = "") -> dict[str, str]:
    """``{dotted key: "section" | "leaf" | "*"}`` for every key of the dataclass ``cls``.

    ``"*"`` marks a mapping-typed field, below which any key is accepted.
    """
    hints = typing.get_type_hints(cls)
    keys: dict[str, str] = {}
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints.get(f.name, Any)
        sub = _dataclass_of(tp)
        if sub is not None:
            keys[key] = "section"
            keys.update(schema_keys(sub, key + "."))
        elif _is_mapping_type(tp):
            keys[key] = _FREE
        else:
            keys[key] = "leaf"
    return keys


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterable[str]:
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        yield dotted
        if isinstance(value, Mapping):
            yield from _flatten(value, dotted + ".")


def _known(key: str, keys: Mapping[str, str]) -> bool:
    if key in keys:
        return True
    parts = key.split(".")
    return any(keys.get(".".join(parts[:i])) == _FREE for i in range(1, len(parts)))


def _unknown(key: str, source: str, keys: Mapping[str, str]) -> UnknownKey:
    """The unknown ``key`` with its suggestion: from verl's names and common synonyms
    (:mod:`verity.config.key_aliases`) when they have it, else the closest spelling."""
    from verity.config.key_aliases import alias_for

    alias = alias_for(key, lambda name: _known(name, keys))
    if alias is not None:
        return UnknownKey(key, source, alias[0], alias[1])
    return UnknownKey(key, source, _suggest(key, keys))


def _suggest(key: str, keys: Mapping[str, str]) -> str | None:
    """The known key the user most likely meant: a near spelling, or the same name in another section."""
    candidates = [k for k in keys if not key.startswith(k + ".")]  # not the unknown key's own parents
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.75)
    if close:
        return close[0]
    top, last = key.split(".")[0], key.rsplit(".", 1)[-1]
    leaves = {k.rsplit(".", 1)[-1] for k in candidates}
    for leaf in difflib.get_close_matches(last, sorted(leaves), n=3, cutoff=0.6):
        same_leaf = [k for k in candidates if k.rsplit(".", 1)[-1] == leaf]
        same_section = [k for k in same_leaf if k.split(".")[0] == top]
        for group in (same_section, same_leaf):
            if len(group) == 1:
                return group[0]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


def check_keys(
    cls: type, file_data: Mapping[str, Any] | None, overrides: Sequence[str]
) -> tuple[list[UnknownKey], list[str]]:
    """Check the keys of a config file's data and of Hydra overrides against the schema ``cls``.

    Returns ``(unknown keys, overrides to compose)``: the overrides with a leading ``+``
    removed where the key exists (adding an existing key is just setting it).
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = schema_keys(cls)
    unknown: list[UnknownKey] = []
    for key in _flatten({k: v for k, v in (file_data or {}).items() if k != "defaults"}):
        if not _known(key, keys) and not any(key.startswith(u.key + ".") for u in unknown):
            unknown.append(_unknown(key, "config file", keys))
    parser = OverridesParser.create()
    composed: list[str] = []
    for text in overrides:
        parsed = parser.parse_overrides([text])[0]
        key = parsed.key_or_group
        if not _known(key, keys):
            unknown.append(_unknown(key, f"override {text!r}", keys))
            continue
        if key in keys and keys[key] != _FREE and (parsed.is_add() or parsed.is_force_add()):
            text = text.lstrip("+")  # "+a.b=1" on an existing key is just "a.b=1"
        composed.append(text)
    return unknown, composed


def _bool_type(tp: Any) -> tuple[bool, bool]:
    """``(is a bool field, may be None)`` for the type hint ``tp``."""
    if tp is bool:
        return True, False
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if (origin is typing.Union or str(origin) == "<class 'types.UnionType'>") and set(args) == {bool, type(None)}:
        return True, True
    return False, False


def bool_keys(cls: type, prefix: str = "") -> dict[str, bool]:
    """``{dotted key: may be null}`` for every ``bool`` (or ``bool | None``) field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    keys: dict[str, bool] = {}
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name, Any)
        sub = _dataclass_of(tp)
        if sub is not None:
            keys.update(bool_keys(sub, f"{prefix}{f.name}."))
            continue
        is_bool, nullable = _bool_type(tp)
        if is_bool:
            keys[f"{prefix}{f.name}"] = nullable
    return keys


def _nested_items(data: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield from _nested_items(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def non_bool_values(cls: type, file_data: Mapping[str, Any] | None, overrides: Sequence[str]) -> list[str]:
    """One sentence per ``bool`` key given something else (``2``, ``"yes"``) in the file or an override.

    Composing would turn such a value into ``True`` or ``False`` without a word. The words
    OmegaConf reads unambiguously (``yes``/``no``, ``on``/``off``) are accepted.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = bool_keys(cls)

    def bad(key: str, value: Any) -> bool:
        if key not in keys or isinstance(value, bool) or (value is None and keys[key]):
            return False
        return not (isinstance(value, str) and value.strip().lower() in _BOOL_WORDS)

    def expected(key: str) -> str:
        return "true, false or null" if keys[key] else "true or false"

    problems = [
        f"{key} must be {expected(key)}, got {value!r} (config file)"
        for key, value in _nested_items({k: v for k, v in (file_data or {}).items() if k != "defaults"})
        if bad(key, value)
    ]
    parser = OverridesParser.create()
    for text in overrides:
        parsed = parser.parse_overrides([text])[0]
        key = parsed.key_or_group.lstrip("+~")
        if not parsed.is_delete() and bad(key, parsed.value()):
            problems.append(f"{key} must be {expected(key)}, got {parsed.value()!r} (override {text!r})")
    return problems


def _is_list_type(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_is_list_type(a) for a in typing.get_args(tp) if a is not type(None))
    return tp is list or origin is list


def list_keys(cls: type, prefix: str = "") -> set[str]:
    """Every dotted key of the dataclass ``cls`` that holds a list (``data.train_files``, ...)."""
    hints = typing.get_type_hints(cls)
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        tp = hints.get(f.name, Any)
        sub = _dataclass_of(tp)
        if sub is not None:
            keys |= list_keys(sub, f"{prefix}{f.name}.")
        elif _is_list_type(tp):
            keys.add(f"{prefix}{f.name}")
    return keys


def _one_value(value: Any) -> bool:
    """A string or a number: what a list key may take as a list of one (not a bool, null, list or sweep)."""
    return isinstance(value, str | int | float) and not isinstance(value, bool)


def one_value_lists(cls: type, overrides: Sequence[str]) -> list[str]:
    """The overrides, with one value given to a list key written as a list of one.

    ``data.train_files=train.parquet`` becomes ``data.train_files=[train.parquet]`` (the value's
    text is kept as typed, quotes included); lists, sweeps, ``null`` and deletions are left as they are.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys = list_keys(cls)
    parser = OverridesParser.create()
    out: list[str] = []
    for text in overrides:
        parsed = parser.parse_overrides([text])[0]
        key = parsed.key_or_group.lstrip("+~")
        value = None if parsed.is_delete() else parsed.value()
        if key in keys and _one_value(value) and "=" in text:
            left, right = text.split("=", 1)
            text = f"{left}=[{right.strip()}]"
        out.append(text)
    return out


def one_values_for_lists(cls: type, file_data: Mapping[str, Any] | None) -> list[str]:
    """One sentence per list key a config file gives one value, showing the bracket form."""
    keys = list_keys(cls)
    return [
        f"{key}: a list is expected, got the single value {value!r}; write it as a list of one: "
        f"{key.rsplit('.', 1)[-1]}: [{value}]"
        for key, value in _nested_items({k: v for k, v in (file_data or {}).items() if k != "defaults"})
        if key in keys and _one_value(value)
    ]
