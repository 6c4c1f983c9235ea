"""Finding recipes: installed packages first, then the ``recipes/`` folder of a checkout.

A recipe is a Python package whose folder holds

    configs/<config>.yaml                  pinned run configs (``defaults: [verity, _self_]``)
    expected/<hardware>-<backend>.yaml     the metrics each config must reach there

Installed recipes announce themselves under the entry-point group
``verity.recipes`` (name -> package), e.g. in ``recipes/grpo/pyproject.toml``::

    [project.entry-points."verity.recipes"]
    grpo = "verity_recipe_grpo"

In a checkout where they are not installed, ``recipes/<name>/src/<package>/`` is
found by walking up from the working directory to the folder holding
``recipes/`` (or ``$VERITY_RECIPES_DIR``). Nothing is imported from a recipe to
find it: a recipe never runs code at discovery time.
"""

from __future__ import annotations

import importlib.util
import os
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ENTRY_POINT_GROUP = "verity.recipes"
RECIPES_DIR_ENV = "VERITY_RECIPES_DIR"
DEFAULT_CONFIG = "cpu"


class RecipeNotFoundError(LookupError):
    """No recipe (or no config of a recipe) by that name; the message lists the known ones."""


@dataclass(frozen=True)
class Recipe:
    """One recipe: its name, the folder holding ``configs/`` and ``expected/``, its version."""

    name: str
    package: str  # the import name, e.g. "verity_recipe_grpo"
    folder: Path
    version: str | None = None

    @property
    def configs_dir(self) -> Path:
        return self.folder / "configs"

    @property
    def expected_dir(self) -> Path:
        return self.folder / "expected"

    def configs(self) -> dict[str, Path]:
        """Config name (file stem) -> path, sorted by name."""
        return {p.stem: p for p in sorted(self.configs_dir.glob("*.yaml"))}

    def config_path(self, config: str = DEFAULT_CONFIG) -> Path:
        """The path of config ``config``; RecipeNotFoundError naming the known configs otherwise."""
        known = self.configs()
        if config not in known:
            raise RecipeNotFoundError(
                f"recipe {self.name!r} has no config {config!r}; known: {', '.join(known) or 'none'}"
            )
        return known[config]

    def expected_files(self) -> list[Path]:
        return sorted(self.expected_dir.glob("*.yaml"))


def _package_folder(package: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _installed() -> dict[str, Recipe]:
    found: dict[str, Recipe] = {}
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        folder = _package_folder(entry.value)
        if folder is None:
            continue
        version = entry.dist.version if entry.dist is not None else None
        found[entry.name] = Recipe(entry.name, entry.value, folder, version)
    return found


def recipes_root(start: Path | None = None) -> Path | None:
    """The checkout's ``recipes/`` folder: ``$VERITY_RECIPES_DIR``, else the nearest one above ``start``."""
    env = os.environ.get(RECIPES_DIR_ENV)
    if env:
        return Path(env).expanduser().resolve()
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "recipes"
        if candidate.is_dir() and any(candidate.glob("*/pyproject.toml")):
            return candidate
    return None


def _project_version(pyproject: Path) -> str | None:
    try:
        return tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {}).get("version")
    except (OSError, tomllib.TOMLDecodeError):
        return None


def _from_checkout(root: Path) -> dict[str, Recipe]:
    found: dict[str, Recipe] = {}
    for project in sorted(root.glob("*/pyproject.toml")):
        for configs in sorted(project.parent.glob("src/*/configs")):
            name = project.parent.name
            found[name] = Recipe(name, configs.parent.name, configs.parent, _project_version(project))
            break
    return found


def list_recipes(start: Path | None = None) -> dict[str, Recipe]:
    """Every recipe found, by name: the checkout's folder first, installed packages override it."""
    root = recipes_root(start)
    found = _from_checkout(root) if root is not None else {}
    found.update(_installed())
    return dict(sorted(found.items()))


def find_recipe(name: str, start: Path | None = None) -> Recipe:
    """The recipe called ``name``; RecipeNotFoundError listing the known recipes otherwise."""
    known = list_recipes(start)
    if name not in known:
        raise RecipeNotFoundError(
            f"no recipe {name!r}; known: {', '.join(known) or 'none'} "
            f"(install recipes/<name> or run from a checkout holding recipes/)"
        )
    return known[name]
