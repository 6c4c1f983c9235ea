"""Compose a run configuration with Hydra and validate it before any compute starts.

    cfg = load_config(["actor.optim.lr=1e-5", "trainer.total_steps=10"])
    cfg = load_config(overrides, config_file="recipes/grpo/src/verity_recipe_grpo/configs/cpu.yaml")

A config file is YAML whose keys are a subset of :class:`VerityConfig`; it may start
with ``defaults: [verity, _self_]`` (added when missing). Overrides use Hydra's grammar.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

import yaml
from hydra import compose, initialize, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from verity.config.errors import ConfigError
from verity.config.model_presets import apply_model_preset
from verity.config.schema import VerityConfig
from verity.config.validate import validate_config

SCHEMA_NAME = "verity"

logger = logging.getLogger("verity.config")


def _register_schema(schema: type) -> None:
    ConfigStore.instance().store(name=SCHEMA_NAME, node=schema)


def load_config(
    overrides: Sequence[str] = (), config_file: str | os.PathLike | None = None, preset: bool = False
) -> VerityConfig:
    """Compose the run config from an optional YAML file plus command-line overrides.

    Order: the installed plug-ins are loaded (their config sections join the schema,
    :mod:`verity.plugins`), the config's ``plugins`` requirements are checked, every
    key of the file and the overrides is checked against the schema (all unknown keys
    reported at once, each with its closest known name), Hydra composes, and
    :func:`validate_config` checks values. Raises :class:`ConfigError` naming the
    offending key(s) for each failure.

    The keys of the config file and the overrides are the user's: one that the run would
    not read is an error. ``preset=True`` says the file is a preset the user did not pick
    (``verity quickstart`` without ``--config``): its keys for a part the run does not read
    (its ``actor.fsdp2`` tuning under ``actor.engine=megatron``) step aside with a logged
    line, as a model preset's do (:mod:`verity.config.model_presets`).
    """
    from verity.config.cluster_checks import apply_cluster_shape
    from verity.config.keys import check_keys, non_bool_values, one_value_lists, one_values_for_lists
    from verity.config.sections import schema_class
    from verity.plugins import PluginError, load_plugins

    try:
        load_plugins()
    except PluginError as err:
        raise ConfigError(str(err)) from None
    schema = schema_class()
    path = None if config_file is None else Path(config_file).expanduser().resolve()
    file_data = _read_with_chain(path) if path is not None else {}
    _check_required_plugins(file_data, overrides, path)
    unknown, overrides = check_keys(schema, file_data, overrides)
    if unknown:
        raise ConfigError(_unknown_keys_message(unknown, file_data, schema))
    not_bool = non_bool_values(schema, file_data, overrides)
    if not_bool:
        raise ConfigError("; ".join(not_bool))
    one_value = one_values_for_lists(schema, file_data)
    if one_value:
        raise ConfigError(f"config file {str(path)!r}: " + "; ".join(one_value))
    overrides = one_value_lists(schema, overrides)  # data.train_files=train.parquet: a list of one
    _register_schema(schema)
    GlobalHydra.instance().clear()
    try:
        if path is None:
            with initialize(version_base="1.3", config_path=None):
                raw = compose(config_name=SCHEMA_NAME, overrides=list(overrides))
        else:
            with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
                raw = compose(config_name=path.stem, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as err:
        cause = f" ({str(err.__cause__).splitlines()[0]})" if err.__cause__ else ""
        raise ConfigError(f"invalid configuration: {_first_lines(err)}{cause}") from None
    finally:
        GlobalHydra.instance().clear()
    cfg = OmegaConf.to_object(raw)
    assert isinstance(cfg, VerityConfig)
    explicit = _explicit_keys(file_data, overrides)
    layer = apply_model_preset(cfg, explicit)  # a run prints it among its first lines
    apply_cluster_shape(cfg, explicit)
    user_keys = _explicit_keys({}, overrides) if preset else explicit
    if preset and path is not None:
        source = f"the {path.stem} preset"
    else:
        source = f"the {layer.name} preset" if layer is not None else "the schema's defaults"
    validate_config(cfg, user_keys, source)
    return cfg


def _explicit_keys(file_data: dict, overrides: Sequence[str]) -> set[str]:
    """Every dotted key (and its parents) that the config file or an override sets."""

    def walk(node: dict, prefix: str) -> set[str]:
        keys: set[str] = set()
        for key, value in node.items():
            keys.add(prefix + key)
            if isinstance(value, dict):
                keys |= walk(value, f"{prefix}{key}.")
        return keys

    keys = walk({k: v for k, v in file_data.items() if k != "defaults"}, "")
    keys |= {text.lstrip("+~").split("=", 1)[0].strip() for text in overrides}
    return keys


def _first_lines(err: BaseException) -> str:
    """The error's whole text on one line: Hydra puts the reason and the key on later lines."""
    skip = ("reference_type", "object_type")
    lines = [
        line.strip() for line in str(err).splitlines() if line.strip() and not line.strip().startswith(skip)
    ]
    return " ".join(lines)


def _read_with_chain(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """The file's data merged over the files its ``defaults`` list names (``[verity, cpu, _self_]``).

    A recipe config may build on another in its folder; the keys every file of the chain
    sets count as set by the user (checked, and never replaced by a model preset's values).
    """
    if path in seen:
        raise ConfigError(
            f"config file {str(path)!r}: its defaults list includes itself (via {seen[-1].name})"
        )
    data = _read_config_file(path)
    merged: dict = {}
    for entry in data.get("defaults") or []:
        if isinstance(entry, str) and entry not in (SCHEMA_NAME, "_self_"):
            base = path.parent / f"{entry}.yaml"
            if not base.is_file():
                raise ConfigError(
                    f"config file {str(path)!r}: defaults entry {entry!r} has no file {str(base)!r}"
                )
            _deep_merge(
                merged, {k: v for k, v in _read_with_chain(base, (*seen, path)).items() if k != "defaults"}
            )
    _deep_merge(merged, data)
    return merged


def _deep_merge(into: dict, other: dict) -> None:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _read_config_file(path: Path) -> dict:
    """The YAML file's data; it must start with ``defaults: [verity, _self_]``."""
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a folder; give the path of a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(
            f"config file {str(path)!r} is not text (a data or model file?); give the path of a YAML file"
        ) from None
    try:
        data = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{where}: {problem}") from None
    except (OmegaConfBaseException, ValueError) as err:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {_first_lines(err)}") from None
    if not OmegaConf.is_dict(data):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of config sections")
    defaults = data.get("defaults")
    if not defaults or SCHEMA_NAME not in [d if isinstance(d, str) else None for d in defaults]:
        raise ConfigError(
            f"config file {str(path)!r} must start with 'defaults: [{SCHEMA_NAME}, _self_]' "
            "so its keys are checked against the schema"
        )
    return OmegaConf.to_container(data, resolve=False)  # type: ignore[return-value]


def _required_plugins(file_data: dict, overrides: Sequence[str]) -> list[str]:
    wanted = list(file_data.get("plugins") or [])
    for text in overrides:
        key, _, value = text.lstrip("+~").partition("=")
        if key.strip() == "plugins":
            wanted = [v.strip() for v in value.strip().strip("[]").split(",") if v.strip()]
    return wanted


def _check_required_plugins(file_data: dict, overrides: Sequence[str], path: Path | None) -> None:
    """Every package named in the config's ``plugins`` list is installed, or a ConfigError naming it."""
    from verity.plugins import _normalise, installed_distributions

    missing = [
        p for p in _required_plugins(file_data, overrides) if _normalise(p) not in installed_distributions()
    ]
    if missing:
        where = f"config file {str(path)!r}" if path is not None else "this config"
        raise ConfigError(
            f"{where} needs the plug-in package(s) {', '.join(missing)} (key plugins), not installed here: "
            f"pip install {' '.join(missing)} (in a checkout of verity: pip install -e recipes/<name>)"
        )


def _unknown_keys_message(unknown: list, file_data: dict, schema: type) -> str:
    """The unknown keys, and for a whole unknown top-level section of the file, where plug-in sections come from."""
    import dataclasses

    from verity.plugins import loaded_plugins

    lines = [f"{len(unknown)} unknown config key(s):"]
    lines += [f"  {u.describe()}" for u in unknown]
    known_top = {f.name for f in dataclasses.fields(schema)}
    top = {u.key.split(".")[0] for u in unknown}
    sections = [t for t in top if t not in known_top and isinstance(file_data.get(t), dict)]
    if sections:
        loaded = ", ".join(p.name for p in loaded_plugins()) or "none"
        lines.append(
            f"section(s) {', '.join(sorted(sections))}: no such section in verity or in an installed plug-in "
            f"(plug-ins loaded: {loaded}); a recipe's section needs its package installed "
            "(pip install -e recipes/<name>) and listed under 'plugins:' in the config"
        )
    return "\n".join(lines)


def config_to_dict(cfg: VerityConfig) -> dict:
    """The config as a plain nested dict (for logging, hashing and summary files)."""
    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]


def named_config_file(directory: str | Path, name: str) -> Path:
    """``<directory>/<name>.yaml``, or FileNotFoundError naming the directory and the configs it has.

    Recipe packages use it for their pinned configs: ``named_config_file(FOLDER / "configs", "cpu")``.
    """
    directory = Path(directory)
    path = directory / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in directory.glob("*.yaml"))) or "none"
        raise FileNotFoundError(f"no config {name!r} in {directory}; known: {known}")
    return path
