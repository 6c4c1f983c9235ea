"""Which checkpoint a run starts from (``trainer.resume``), decided before any worker starts.

- ``auto`` (default): the newest complete checkpoint in the run's checkpoint folder
  (``trainer.checkpoint.dir``, default ``<trainer.output_dir>/checkpoints``) — only when
  it was saved with the same config (:func:`require_same_config`; bookkeeping keys
  such as ``trainer.total_steps`` may differ, and a section the saved run lacked counts
  as unchanged at its defaults: :func:`config_differences`); a fresh start when there is none.
- ``off``: a fresh start. A previous run's outputs and checkpoints are moved aside
  first (``verity.launch.run_dir.move_aside``), never mixed with the new run's.
- a path: a ``step_N`` checkpoint folder, a checkpoint folder (its newest), or a run's
  output folder (its ``checkpoints/``' newest). Refused when that would mix two
  histories: an older checkpoint of this run's own folder, or any checkpoint while this
  run's folder already holds checkpoints (continue those with ``auto``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from verity.checkpoint.layout import find_latest, is_complete, list_checkpoints, step_of
from verity.config.loader import ConfigError
from verity.config.schema import VerityConfig

logger = logging.getLogger("verity.checkpoint")

# keys that may differ between the run that saved a checkpoint and the run resuming it
# with trainer.resume=auto: how long and where it runs, not what each step computes
_BOOKKEEPING_PREFIXES = (
    "trainer.resume",
    "trainer.checkpoint.",
    "trainer.progress",
    "trainer.stage_timeout_s",
    "trainer.total_steps",
    "trainer.val_every",
    "trainer.ray_address",
    "trainer.placement_timeout_s",
    "trainer.run_name",
)


def checkpoint_root(cfg: VerityConfig) -> Path:
    """The run's checkpoint folder: ``trainer.checkpoint.dir`` or ``<trainer.output_dir>/checkpoints``.

    Absolute (a relative key is resolved against the driver's working folder): workers on other
    nodes write into it and their working folder is not the driver's.
    """
    t = cfg.trainer
    base = t.checkpoint.dir if t.checkpoint.dir else str(Path(t.output_dir) / "checkpoints")
    return Path(base).expanduser().absolute()


def resolve_resume(cfg: VerityConfig) -> Path | None:
    """The checkpoint to resume from, or None for a fresh start (see the module docstring).

    Raises :class:`ConfigError` naming ``trainer.resume`` when the choice cannot work.
    """
    mode = cfg.trainer.resume
    root = checkpoint_root(cfg)
    if mode == "off":
        return None
    if mode == "auto":
        return find_latest(root)
    path = Path(mode).expanduser()
    chosen = path if is_complete(path) else None
    for base in (path, path / "checkpoints"):
        if chosen is None:
            chosen = find_latest(base)
    if chosen is None:
        raise ConfigError(
            f"trainer.resume={mode!r}: no complete checkpoint there (expected a step_N folder holding "
            "trainer_state.json, a checkpoint folder, or a run output folder with checkpoints/)"
        )
    _refuse_mixed_histories(mode, chosen, root)
    return chosen


def _refuse_mixed_histories(mode: str, chosen: Path, root: Path) -> None:
    """An explicit checkpoint must not mix this run's saves with checkpoints of another history.

    Allowed: the newest checkpoint of this run's own folder, or any checkpoint when this
    run's folder holds none yet. Otherwise rerunning the same command after a crash would
    silently go back to ``chosen``, or ``latest`` would end up pointing into two timelines.
    """
    own = list_checkpoints(root)
    if not own:
        return
    if chosen.parent.resolve() == root.resolve():
        newer = [p.name for step, p in own if step > (step_of(chosen) or 0)]
        if not newer:
            return
        raise ConfigError(
            f"trainer.resume={mode!r}: {root} holds checkpoints newer than {chosen.name} ({', '.join(newer)}); "
            "resuming from an older one would mix two histories in one folder: give a new "
            "trainer.output_dir (or trainer.checkpoint.dir), or delete the newer checkpoints"
        )
    raise ConfigError(
        f"trainer.resume={mode!r}: this run's checkpoint folder {root} already holds checkpoints "
        f"({', '.join(p.name for _, p in own)}); continue it with trainer.resume=auto, or give a new "
        "trainer.output_dir to start from the given checkpoint"
    )


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node}


def default_config_dict() -> dict[str, Any]:
    """Every key of this environment's schema (plug-in sections included) at its default, as a nested dict."""
    from verity.config.loader import config_to_dict
    from verity.config.sections import schema_class

    return config_to_dict(schema_class()())


def config_differences(
    saved: dict[str, Any], current: dict[str, Any], defaults: dict[str, Any] | None = None
) -> list[str]:
    """``key: saved -> current`` for every config value that changed, bookkeeping keys left out.

    A key only one of the two configs has, holding its default there, is no change: a
    section the saved run did not have (a plug-in installed since, such as the recipes'
    ``dapo.*``, ``prime.*``, ``prm.*``) or a key a newer verity added, left at its default,
    computes what the saved run computed. Set away from its default it is a change.
    ``defaults``: the schema's defaults as a nested dict (default: :func:`default_config_dict`).
    """
    a, b = _flatten(saved), _flatten(current)
    lines = []
    base: dict[str, Any] | None = None
    for key in sorted(set(a) | set(b)):
        if key.startswith(_BOOKKEEPING_PREFIXES):
            continue
        if (key in a) != (key in b):
            if base is None:
                base = _flatten(default_config_dict() if defaults is None else defaults)
            if key in base and base[key] == (a[key] if key in a else b[key]):
                continue
        if a.get(key, "<absent>") != b.get(key, "<absent>"):
            lines.append(f"{key}: {a.get(key, '<absent>')!r} -> {b.get(key, '<absent>')!r}")
    return lines


def require_same_config(saved: dict[str, Any], current: dict[str, Any], checkpoint: Path) -> None:
    """``trainer.resume=auto`` continues only the run that saved ``checkpoint``: same config, or ConfigError.

    The message lists every differing key and the two ways out.
    """
    changes = config_differences(saved, current)
    if changes:
        raise ConfigError(
            f"trainer.resume=auto: {checkpoint} was saved by a run with a different config:\n  "
            + "\n  ".join(changes)
            + "\nauto continues only the same config. Give this run a new trainer.output_dir, or start over "
            "in this folder with trainer.resume=off (the old run is moved aside, nothing is deleted)."
        )


def warn_on_config_change(saved: dict[str, Any], current: dict[str, Any], checkpoint: Path) -> list[str]:
    """Log a warning listing config changes since ``checkpoint`` was saved; return the list."""
    changes = config_differences(saved, current)
    if changes:
        logger.warning(
            "resuming from %s with a changed config (metrics will not match an uninterrupted run):\n  %s",
            checkpoint,
            "\n  ".join(changes),
        )
    return changes


def last_checkpoint_hint(cfg: VerityConfig) -> str | None:
    """One line for failure messages: the newest complete checkpoint and how to resume from it.

    None when there is none: a run that failed before its first checkpoint has nothing to
    resume, and a hint about checkpoints would only distract from the error.
    """
    latest = find_latest(checkpoint_root(cfg))
    if latest is None:
        return None
    return f"last complete checkpoint: {latest}; continue with trainer.resume=auto"
