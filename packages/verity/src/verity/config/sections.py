"""Config sections contributed by plug-ins: ``dapo:``, ``prime:``, ... beside the built-in ones.

A plug-in declares a dataclass (every field with a default, like the built-in
sections) and registers it under a top-level name::

    @dataclass
    class DemoConfig:
        enabled: bool = False
        bonus: float = 0.5  # added to every score

        def validate(self) -> None:              # optional: raise ValueError naming the field
            if self.bonus < 0:
                raise ValueError(f"bonus must be >= 0, got {self.bonus}")

        def validate_run(self, cfg) -> None:     # optional: checks that need the whole run config
            if self.enabled and cfg.rollout.n < 2:
                raise ValueError("enabled needs rollout.n >= 2")

    register_config_section("demo", DemoConfig, provider="verity-demo-plugin")

:func:`schema_class` then returns a subclass of :class:`~verity.config.schema.VerityConfig`
with one more field per registered section, so the section is composed, typed and
checked by Hydra like every other key (an unknown key inside it is an error), and the
run reads it as ``cfg.demo.bonus``. Without the plug-in, the section is an unknown key;
:func:`verity.config.load_config` then names the package the config says provides it
(the config's ``plugins`` list).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from verity.config.schema import VerityConfig
from verity.registry import Registry

__all__ = ["CONFIG_SECTIONS", "SectionSpec", "register_config_section", "schema_class"]


@dataclass(frozen=True)
class SectionSpec:
    """A plug-in's config section: its top-level name, dataclass and providing package."""

    name: str
    cls: type
    provider: str | None = None


CONFIG_SECTIONS: Registry[SectionSpec] = Registry("config section")

_BUILTIN = {f.name for f in dataclasses.fields(VerityConfig)}
_schema_cache: dict[tuple, type] = {}


def register_config_section(name: str, cls: type, *, provider: str | None = None) -> None:
    """Add the top-level section ``name`` with the dataclass ``cls`` (every field defaulted).

    ``provider`` names the package that ships it (used in messages). A name may be
    registered once and may not shadow a built-in section.
    """
    if not name.isidentifier() or name.startswith("_"):
        raise ValueError(f"config section name {name!r} must be an identifier not starting with '_'")
    if name in _BUILTIN:
        raise ValueError(f"config section {name!r} is built in; a plug-in cannot replace it")
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"config section {name!r}: expected a dataclass type, got {cls!r}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"config section {name!r}: fields {missing} need defaults")
    CONFIG_SECTIONS.add(name, SectionSpec(name, cls, provider))


def schema_class() -> type:
    """The run-config class: ``VerityConfig`` plus one field per registered plug-in section."""
    specs = [spec for _, spec in CONFIG_SECTIONS.items()]
    if not specs:
        return VerityConfig
    key = tuple((s.name, s.cls) for s in specs)
    if key not in _schema_cache:
        fields = [(s.name, s.cls, dataclasses.field(default_factory=s.cls)) for s in specs]
        cls = dataclasses.make_dataclass(
            "VerityConfigWithPlugins", fields, bases=(VerityConfig,), namespace={"__reduce__": _reduce_config}
        )
        cls.__module__ = __name__
        _schema_cache[key] = cls
    return _schema_cache[key]


def _reduce_config(cfg: Any) -> tuple:
    """Pickle a config with plug-in sections by its values, never its run-time class.

    The class is rebuilt where the config is unpickled (a worker process) from that
    process's plug-ins, which :func:`rebuild_config` loads first.
    """
    return (rebuild_config, (dict(cfg.__dict__),))


def rebuild_config(state: dict[str, Any]) -> Any:
    """Unpickle a config with plug-in sections: load the plug-ins here, rebuild the class, fill it."""
    from verity.plugins import load_plugins

    load_plugins()
    cls = schema_class()
    missing = [name for name in state if name not in {f.name for f in dataclasses.fields(cls)}]
    if missing:
        raise RuntimeError(
            f"this process has no plug-in providing the config section(s) {missing}: "
            "is the plug-in package installed where the workers run?"
        )
    cfg = cls.__new__(cls)
    cfg.__dict__.update(state)
    return cfg


def plugin_sections(cfg: Any) -> dict[str, Any]:
    """``{section name: section object}`` for the plug-in sections present on ``cfg``."""
    return {name: getattr(cfg, name) for name, _ in CONFIG_SECTIONS.items() if hasattr(cfg, name)}
