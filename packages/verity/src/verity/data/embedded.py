"""``model.path=embedded``: the seam through which a package provides a self-contained model and task.

The runtime builds no model of its own. A plug-in registers named embedded presets here
(``verity-toyworld``, installed by the README's install line, registers ``default``,
``multiply-tools`` and ``shape-count``); ``model.embedded_preset`` picks one, and before Ray
starts the driver asks it for a model folder and task files (:meth:`EmbeddedModel.build`),
which the run then uses like any HF checkpoint and verl-schema files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from verity.registry import Registry, UnknownNameError

INSTALL_HINT = (
    "model.path=embedded needs a package that provides embedded models, and none is installed: "
    "pip install -e packages/toyworld (the verity-toyworld package, in the README's install line)"
)


@runtime_checkable
class EmbeddedFiles(Protocol):
    """What a built preset gives the run: an HF model folder (with its tokenizer) and verl-schema files."""

    model_dir: Path
    train_file: Path
    test_file: Path


@runtime_checkable
class EmbeddedModel(Protocol):
    """A named embedded preset: how to build (or reuse) its model and task files."""

    eval_max_new_tokens: int  # the response budget `verity eval embedded` uses, in tokens
    # a YAML file of schema keys applied under the user's keys (verity.config.model_presets),
    # for a model that learns with other settings than a real checkpoint's; None: none
    config_preset: Path | None

    @property
    def vision(self) -> bool:
        """Whether the model is a vision-language model (its prompts carry images)."""
        ...

    def check(self) -> None:
        """Raise ValueError naming what is wrong with the preset, before anything is built."""
        ...

    def build(self, cache_dir: Path, sft_steps: int | None = None) -> EmbeddedFiles:
        """The cached build under ``cache_dir`` (built on first use); ``sft_steps`` overrides the warm-start."""
        ...

    def fresh_model(self, seed: int = 0) -> tuple[Any, Any]:
        """``(untrained model, tokenizer)`` of the preset's shape, for ``verity sft``'s default model."""
        ...

    def task_rows(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(train rows, test rows)`` of the preset's task as generated (verl schema)."""
        ...


EMBEDDED_PRESETS: Registry[EmbeddedModel] = Registry("embedded preset")


def register_embedded_model(name: str, preset: EmbeddedModel) -> None:
    """Make ``preset`` available as ``model.embedded_preset=<name>``."""
    if not isinstance(preset, EmbeddedModel):
        raise TypeError(f"embedded preset {name!r}: {type(preset).__name__} is not an EmbeddedModel")
    EMBEDDED_PRESETS.add(name, preset)


def embedded_preset(name: str) -> EmbeddedModel:
    """The preset registered as ``name``, plug-ins loaded first.

    ValueError: :data:`INSTALL_HINT` when no package registers any preset; an unknown name
    lists the known ones (:class:`~verity.registry.UnknownNameError`, a ValueError).
    """
    from verity.plugins import load_plugins

    load_plugins()
    if not EMBEDDED_PRESETS.names():
        raise UnknownNameError(INSTALL_HINT)
    return EMBEDDED_PRESETS.get(name)


def ensure_embedded_preset(
    name: str = "default", cache_dir: str | Path = "~/.cache/verity/embedded", sft_steps: int | None = None
) -> EmbeddedFiles:
    """The cached build of the embedded preset ``name`` (built on first use under ``cache_dir``)."""
    return embedded_preset(name).build(Path(cache_dir).expanduser(), sft_steps)
