"""Name mapping between the trainer's parameter names and a rollout engine's.

A name mapper is a callable ``str -> str | None``: the rollout's name for a trainer
weight, or ``None`` to skip that weight. The HF rollout and vLLM/SGLang (whose
``load_weights`` accept HF names and fuse q/k/v themselves) need only
:func:`identity_names`; a custom rollout model with other names composes the helpers.

Example: ``compose(strip_prefix("model."), regex_rename([(r"^lm_head", "output")]))``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

NameMapper = Callable[[str], str | None]


def identity_names(name: str) -> str:
    """The same name."""
    return name


def strip_prefix(prefix: str) -> NameMapper:
    """Drop ``prefix`` from names that start with it; others pass unchanged."""

    def mapper(name: str) -> str:
        return name[len(prefix) :] if name.startswith(prefix) else name

    return mapper


def add_prefix(prefix: str) -> NameMapper:
    """Prepend ``prefix`` to every name."""

    def mapper(name: str) -> str:
        return prefix + name

    return mapper


def regex_rename(rules: Sequence[tuple[str, str]]) -> NameMapper:
    """Apply ``re.sub(pattern, replacement, name)`` for each rule, in order.

    A replacement of the empty string for a pattern that matches the whole name
    skips the weight (the mapper returns ``None``).
    """
    compiled = [(re.compile(pattern), repl) for pattern, repl in rules]

    def mapper(name: str) -> str | None:
        for pattern, repl in compiled:
            name = pattern.sub(repl, name)
        return name or None

    return mapper


def skip_matching(pattern: str) -> NameMapper:
    """Skip (map to ``None``) every name that ``re.search`` finds ``pattern`` in."""
    compiled = re.compile(pattern)

    def mapper(name: str) -> str | None:
        return None if compiled.search(name) else name

    return mapper


def compose(*mappers: NameMapper) -> NameMapper:
    """Apply ``mappers`` left to right; ``None`` from any of them skips the weight."""

    def mapper(name: str) -> str | None:
        current: str | None = name
        for m in mappers:
            if current is None:
                return None
            current = m(current)
        return current

    return mapper


def map_names(
    named_tensors: Iterable[tuple[str, torch.Tensor]], mapper: NameMapper | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename a stream of ``(name, tensor)``; names mapped to ``None`` are dropped."""
    for name, tensor in named_tensors:
        new_name = mapper(name) if mapper is not None else name
        if new_name is not None:
            yield new_name, tensor
        del tensor  # not held while the next tensor is gathered
