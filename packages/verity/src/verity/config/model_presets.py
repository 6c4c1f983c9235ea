"""Named presets that a model brings: a layer of settings between the schema's defaults and the user's keys.

The schema's defaults are verl-like, chosen for real checkpoints. An embedded model
(``model.path=embedded``) may learn with other settings: its preset
(:class:`verity.data.embedded.EmbeddedModel`) names a YAML file of schema keys as its
``config_preset`` (the toy world's presets name ``embedded-tiny.yaml``). At config load
(:func:`verity.config.loader.load_config`) every key of the preset that the config file and
the overrides leave unset takes the preset's value; a key the user sets always wins, and
the ``actor.fsdp2`` keys step aside when the actor runs another engine (it would not read
them). The layer is recorded on the config (:func:`preset_layer`): ``verity config show``
marks each key it set, and a run prints it among its first lines
(``verity: preset embedded-tiny (model.path=embedded) sets actor.optim.lr=3e-05, ...``)
and logs its name as the MLflow parameter ``config.preset``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

__all__ = ["PresetLayer", "apply_model_preset", "model_preset", "preset_layer"]

# the layer of each loaded config object, by id while it lives (a config is no place for it: it
# is not a key, and a config with plug-in sections pickles every attribute as a section)
_LAYERS: dict[int, PresetLayer] = {}


@dataclass(frozen=True)
class PresetLayer:
    """The preset a config was loaded with: its name, why it applies and the keys it set (dotted -> value)."""

    name: str
    reason: str
    applied: dict[str, Any]

    def describe(self) -> str:
        """One line: ``preset NAME (REASON) sets k=v, ...`` (or that every key of it was the user's)."""
        if not self.applied:
            return f"preset {self.name} ({self.reason}) sets nothing: every key of it is set by the config"
        keys = ", ".join(f"{key}={value}" for key, value in self.applied.items())
        return f"preset {self.name} ({self.reason}) sets {keys}; a key you set wins"


@cache
def model_preset(path: Path) -> dict[str, Any]:
    """The dotted keys and values of the preset file ``path`` (a config YAML; its ``defaults`` list left out)."""
    data = yaml.safe_load(Path(path).read_text()) or {}

    def flat(node: dict[str, Any], prefix: str) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in node.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out

    return flat({k: v for k, v in data.items() if k != "defaults"}, "")


def _preset_for(cfg: Any) -> tuple[str, str, Path] | None:
    """``(preset name, why it applies, its file)`` for ``cfg``'s model, or None (the schema's defaults).

    A real checkpoint has none; an embedded model has its preset's ``config_preset``, if any
    (an embedded preset that is not registered is named by the config's validation).
    """
    if cfg.model.path != "embedded":
        return None
    from verity.data.embedded import embedded_preset

    try:
        file = embedded_preset(cfg.model.embedded_preset).config_preset
    except ValueError:
        return None
    if file is None:
        return None
    return Path(file).stem, "model.path=embedded", Path(file)


def apply_model_preset(cfg: Any, explicit: set[str]) -> PresetLayer | None:
    """Set each key of ``cfg``'s model preset that is not in ``explicit`` (the user's dotted keys).

    Records the layer on ``cfg`` (:func:`preset_layer`) and returns it; None (and ``cfg``
    unchanged) for a model without a preset.
    """
    found = _preset_for(cfg)
    if found is None:
        return None
    name, reason, file = found
    applied: dict[str, Any] = {}
    for key, value in model_preset(file).items():
        if key in explicit or (key.startswith("actor.fsdp2.") and cfg.actor.engine != "fsdp2"):
            continue
        *parents, leaf = key.split(".")
        node = cfg
        for part in parents:
            node = getattr(node, part)
        setattr(node, leaf, value)
        applied[key] = value
    layer = PresetLayer(name, reason, applied)
    if id(cfg) not in _LAYERS:
        weakref.finalize(cfg, _LAYERS.pop, id(cfg), None)
    _LAYERS[id(cfg)] = layer
    return layer


def preset_layer(cfg: Any) -> PresetLayer | None:
    """The preset layer :func:`apply_model_preset` recorded for this ``cfg`` object, or None.

    Kept in this process for the object itself: a copy (or a config unpickled in a worker) has none.
    """
    return _LAYERS.get(id(cfg))
