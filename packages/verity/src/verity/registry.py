"""Name registries: a config chooses a component with a string.

Every pluggable kind of component — training engines, rollout engines, roles,
stages, advantage estimators, policy losses, reward functions — is stored under a
name in a :class:`Registry`. Asking for a name that is not registered raises
:class:`UnknownNameError`, whose message lists every known name (aliases
included), so a typo in a config is caught before any compute starts and tells the
user what they could have written.

Registries live beside the components they hold (``verity.engines.registry``,
``verity.algorithms.registry``, ...); plug-ins add to them when loaded
(:mod:`verity.plugins`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class UnknownNameError(ValueError):
    """A registry was asked for a name it does not hold."""


class Registry(Generic[T]):
    """A mapping from names (and aliases) to registered objects of one kind.

    ``kind`` is a human-readable description used in error messages
    (e.g. ``"advantage estimator"``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._canonical: dict[str, str] = {}

    def register(self, name: str, *aliases: str) -> Callable[[T], T]:
        """Decorator: store the decorated object under ``name`` and ``aliases``."""

        def decorator(obj: T) -> T:
            self.add(name, obj, *aliases)
            return obj

        return decorator

    def add(self, name: str, obj: T, *aliases: str) -> None:
        """Store ``obj`` under ``name`` and each alias; a name may be registered once."""
        for key in (name, *aliases):
            if not isinstance(key, str) or not key:
                raise TypeError(f"{self.kind} names must be non-empty strings, got {key!r}")
            if key in self._entries:
                raise ValueError(f"{self.kind} name {key!r} is already registered")
        for key in (name, *aliases):
            self._entries[key] = obj
            self._canonical[key] = name

    def get(self, name: str) -> T:
        """Return the object registered under ``name``; raise :class:`UnknownNameError` if none."""
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} name must be a string, got {type(name).__name__}")
        try:
            return self._entries[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known {self.kind}s: {', '.join(self.names())}"
            ) from None

    def canonical(self, name: str) -> str:
        """Return the primary name for ``name`` (resolving aliases)."""
        self.get(name)
        return self._canonical[name]

    def names(self) -> list[str]:
        """All registered names and aliases, sorted."""
        return sorted(self._entries)

    def items(self) -> list[tuple[str, T]]:
        """``(primary name, object)`` pairs, sorted by name (aliases left out)."""
        return sorted((name, self._entries[name]) for name, canon in self._canonical.items() if name == canon)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, names={self.names()})"
