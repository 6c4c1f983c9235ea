"""Plug-ins: code from other packages (a recipe, a user's own) that registers components.

A package declares its plug-in under the entry-point group ``verity.plugins``::

    # pyproject.toml of the package
    [project.entry-points."verity.plugins"]
    dapo = "verity_recipe_dapo.plugin"            # a module: importing it registers
    mine = "my_package.verity_hooks:register"     # or a function called with no arguments

Importing the module (or calling the function) registers the package's components in
the runtime's registries — training or rollout engines, roles, stages and stage
planners, advantage estimators, policy losses, reward sources, config sections.

The runtime calls :func:`load_plugins` before it builds anything: in the driver
(:func:`verity.config.load_config` does it before composing the config, so plug-in
config sections are known) and in every worker process (the worker host does it
before building its roles), so a registration made by a plug-in is visible wherever
the code runs. Loading is idempotent per process (the installed packages' declarations
are read once, so a registry may call it on every lookup). The runtime never imports a recipe
by name: everything comes through this entry-point group.

``VERITY_PLUGINS`` (comma-separated ``module`` or ``module:function`` specs) adds
plug-ins that are not installed as packages, e.g. a file on ``PYTHONPATH``; it is
read in the driver and, because worker processes inherit the driver's environment,
in every worker on the same machine.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from functools import cache
from importlib import metadata

__all__ = [
    "ENTRY_POINT_GROUP",
    "ENV_VAR",
    "LoadedPlugin",
    "PluginError",
    "installed_distributions",
    "load_plugins",
    "loaded_plugins",
]

ENTRY_POINT_GROUP = "verity.plugins"
ENV_VAR = "VERITY_PLUGINS"

logger = logging.getLogger("verity.plugins")


class PluginError(ImportError):
    """A declared plug-in could not be loaded; the message names it and its package."""


@dataclass(frozen=True)
class LoadedPlugin:
    """One plug-in loaded in this process: its name, the ``module[:function]`` spec, its package."""

    name: str
    spec: str
    distribution: str | None


_loaded: dict[str, LoadedPlugin] = {}


def _run_spec(name: str, spec: str, distribution: str | None) -> None:
    module_name, _, function = spec.partition(":")
    where = f"plug-in {name!r} ({spec}" + (f", package {distribution}" if distribution else "") + ")"
    try:
        module = importlib.import_module(module_name.strip())
    except Exception as err:  # the plug-in's own import failed: say which one
        raise PluginError(f"{where} failed to import: {type(err).__name__}: {err}") from err
    if function:
        target = getattr(module, function.strip(), None)
        if not callable(target):
            raise PluginError(f"{where}: {module_name} has no callable {function!r}")
        try:
            target()
        except Exception as err:
            raise PluginError(f"{where} failed while registering: {type(err).__name__}: {err}") from err


@cache
def _installed() -> tuple[tuple[str, str, str | None], ...]:
    """The installed packages' declarations, read once per process: scanning every package's
    metadata takes milliseconds, and registries call :func:`load_plugins` on lookups."""
    return tuple(
        (entry.name, entry.value, entry.dist.name if entry.dist is not None else None)
        for entry in metadata.entry_points(group=ENTRY_POINT_GROUP)
    )


def _declared() -> list[tuple[str, str, str | None]]:
    found = list(_installed())
    for item in filter(None, (s.strip() for s in os.environ.get(ENV_VAR, "").split(","))):
        found.append((item, item, None))
    # entry points of one distribution can be listed twice (editable + regular metadata)
    unique = {(name, spec): dist for name, spec, dist in found}
    return sorted((name, spec, dist) for (name, spec), dist in unique.items())


def load_plugins() -> list[LoadedPlugin]:
    """Load every declared plug-in not yet loaded in this process; return all loaded ones.

    Raises :class:`PluginError` naming the plug-in and its package when one fails:
    a broken plug-in stops the run before anything is built rather than leaving a
    registry silently incomplete.
    """
    for name, spec, dist in _declared():
        if spec in _loaded:
            continue
        _run_spec(name, spec, dist)
        _loaded[spec] = LoadedPlugin(name, spec, dist)
        logger.debug("loaded plug-in %s (%s)", name, spec)
    return loaded_plugins()


def loaded_plugins() -> list[LoadedPlugin]:
    """The plug-ins loaded in this process so far, by name."""
    return sorted(_loaded.values(), key=lambda p: p.name)


def installed_distributions() -> set[str]:
    """Normalised names (lower case, ``-`` for ``_`` and ``.``) of the installed Python distributions."""
    return {_normalise(d.metadata["Name"]) for d in metadata.distributions() if d.metadata["Name"]}


def _normalise(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")
