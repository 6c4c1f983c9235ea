"""Turning a nested run config into MLflow params, and hashing it.

MLflow params are flat ``str -> str`` pairs with limits (keys up to 250
characters from ``[/\\w.\\- :]``, values up to 6000 characters), and a param
can never change once logged. :func:`flatten_config` joins nested keys with
dots (``actor.optim.lr``); :func:`to_mlflow_params` makes the strings fit.
:func:`config_hash` identifies a config across runs.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePath
from typing import Any

MAX_PARAM_KEY_LENGTH = 250
MAX_PARAM_VALUE_LENGTH = 6000
_INVALID_KEY_CHARS = re.compile(r"[^/\w.\- :]")


def _as_mapping(node: Any) -> Mapping[str, Any] | None:
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return {field.name: getattr(node, field.name) for field in dataclasses.fields(node)}
    if isinstance(node, Mapping):
        return node
    return None


def flatten_config(config: Mapping[str, Any] | Any, sep: str = ".") -> dict[str, Any]:
    """Nested mappings/dataclasses → ``{"a.b.c": leaf}``; lists and scalars are leaves.

    An empty nested mapping becomes a leaf ``{}`` so that it is still visible.
    """
    root = _as_mapping(config)
    if root is None:
        raise TypeError(f"config must be a mapping or a dataclass instance, got {type(config).__name__}")
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        mapping = _as_mapping(node)
        if mapping is None or (not mapping and prefix):
            flat[prefix] = {} if mapping is not None else node
            return
        for key, value in mapping.items():
            walk(f"{prefix}{sep}{key}" if prefix else str(key), value)

    walk("", root)
    return flat


def param_value_string(value: Any) -> str:
    """The string MLflow stores for one leaf, cut to MLflow's value limit."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, (list, tuple, dict)):
        text = json.dumps(_canonical(value, "value"), sort_keys=True)
    else:
        text = str(value)
    if len(text) > MAX_PARAM_VALUE_LENGTH:
        marker = f"...[truncated {len(text)} chars]"
        text = text[: MAX_PARAM_VALUE_LENGTH - len(marker)] + marker
    return text


def param_key_string(key: str) -> str:
    """A key MLflow accepts: invalid characters → "_", overlong keys shortened with a hash tail."""
    key = _INVALID_KEY_CHARS.sub("_", str(key)) or "_"
    if len(key) > MAX_PARAM_KEY_LENGTH:
        digest = hashlib.sha256(key.encode()).hexdigest()[:8]
        key = key[: MAX_PARAM_KEY_LENGTH - 9] + "~" + digest
    return key


def to_mlflow_params(config: Mapping[str, Any] | Any) -> dict[str, str]:
    """Flatten ``config`` and convert every key and value to what MLflow accepts."""
    return {param_key_string(key): param_value_string(value) for key, value in flatten_config(config).items()}


def _canonical(node: Any, path: str) -> Any:
    """A JSON-able, order-independent copy of ``node``; TypeError names the offending path."""
    mapping = _as_mapping(node)
    if mapping is not None:
        return {str(key): _canonical(value, f"{path}.{key}") for key, value in mapping.items()}
    if isinstance(node, enum.Enum):
        return _canonical(node.value, path)
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if isinstance(node, float):
        return node if math.isfinite(node) else str(node)
    if isinstance(node, PurePath):
        return str(node)
    if isinstance(node, (set, frozenset)):
        return sorted((_canonical(item, path) for item in node), key=repr)
    if isinstance(node, Sequence) and not isinstance(node, (bytes, bytearray)):
        return [_canonical(item, f"{path}[{i}]") for i, item in enumerate(node)]
    if hasattr(node, "item") and callable(node.item):  # numpy / torch scalars
        try:
            return _canonical(node.item(), path)
        except (ValueError, RuntimeError):  # arrays with more than one element
            pass
    if type(node).__module__ == "torch" and type(node).__name__ == "dtype":
        return str(node)
    raise TypeError(f"config value at {path!r} has type {type(node).__name__}, which cannot be hashed stably")


def config_hash(config: Mapping[str, Any] | Any) -> str:
    """sha256 hex digest of the config's canonical JSON (keys sorted, no whitespace).

    Equal configs hash equal whatever their key order; dataclasses hash like
    the dict of their fields.
    """
    canonical = json.dumps(_canonical(config, "config"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
