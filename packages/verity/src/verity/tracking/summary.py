"""``summary.json``: the one file a run leaves that says how it ended.

    {
      "final_metrics": {...},      # metrics of the last step
      "best_metrics": {...},       # e.g. {"acc/mean": {"value": 0.81, "step": 37}}
      "wall_seconds": 512.3,
      "config_hash": "3f9a...",    # verity.tracking.config_hash of the run config
      "verity_version": "0.1.0",
      "written_at": "2026-11-21T22:40:00+00:00",
      ...extra                     # caller's top-level keys, e.g. accuracy_before
    }

The file is written atomically (a temporary file in the same directory, then
``os.replace``), so a reader never sees half a summary. NaN and infinities
become ``null`` (JSON has no spelling for them).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verity.tracking.names import BEST_GOALS

SUMMARY_FILE = "summary.json"
_RESERVED = ("final_metrics", "best_metrics", "wall_seconds", "config_hash", "verity_version", "written_at")


def _jsonable(node: Any) -> Any:
    if isinstance(node, Mapping):
        return {str(key): _jsonable(value) for key, value in node.items()}
    if isinstance(node, (list, tuple)):
        return [_jsonable(item) for item in node]
    if isinstance(node, os.PathLike):
        return os.fspath(node)
    if hasattr(node, "item") and callable(node.item) and not isinstance(node, (str, bytes)):
        node = node.item()  # numpy / torch scalars
    if isinstance(node, float) and not math.isfinite(node):
        return None
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    raise TypeError(f"cannot write a {type(node).__name__} into summary.json: {node!r}")


def umask() -> int:
    """The process's umask, read without changing it (``/proc/self/status``; else set and restored)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` via a synced temp file (``.<name>.*.tmp``) in the same folder and ``os.replace``.

    Readers see the old file or the new one, never a partial write; the temp file is removed on failure.
    The file's mode is what ``open(path, "w")`` would give (0666 less the umask), not mkstemp's 0600.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600; the file gets the mode open() would give
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return target


def write_summary(
    run_dir: str | os.PathLike[str],
    final_metrics: Mapping[str, Any],
    best_metrics: Mapping[str, Any],
    wall_seconds: float,
    config_hash: str,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``<run_dir>/summary.json`` atomically and return its path.

    Args:
        final_metrics: metric name → value at the last step.
        best_metrics: metric name → best value (or ``{"value", "step"}``, as
            :class:`BestMetrics` gives).
        wall_seconds: run wall time in seconds (>= 0).
        config_hash: :func:`verity.tracking.config_hash` of the run config.
        extra: further top-level keys; they may not reuse the names above.
    """
    import verity

    if wall_seconds < 0 or not math.isfinite(wall_seconds):
        raise ValueError(f"wall_seconds must be a finite number >= 0, got {wall_seconds!r}")
    if not isinstance(config_hash, str) or not config_hash:
        raise ValueError(f"config_hash must be a non-empty str, got {config_hash!r}")
    extra = dict(extra or {})
    clashes = sorted(set(extra) & set(_RESERVED))
    if clashes:
        raise ValueError(f"extra keys {clashes} clash with summary fields {list(_RESERVED)}")
    summary = {
        "final_metrics": _jsonable(final_metrics),
        "best_metrics": _jsonable(best_metrics),
        "wall_seconds": float(wall_seconds),
        "config_hash": config_hash,
        "verity_version": verity.__version__,
        "written_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        **_jsonable(extra),
    }
    text = json.dumps(summary, indent=2, allow_nan=False) + "\n"
    return atomic_write_text(Path(run_dir) / SUMMARY_FILE, text)


def read_summary(run_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The parsed ``<run_dir>/summary.json``."""
    return json.loads((Path(run_dir) / SUMMARY_FILE).read_text(encoding="utf-8"))


class BestMetrics:
    """Best value (and the step it happened) of chosen metrics over a run.

    Args:
        goals: metric name → "max" or "min"; defaults to ``names.BEST_GOALS``
            (reward, accuracy, validation accuracy/reward: higher is better).
    """

    def __init__(self, goals: Mapping[str, str] | None = None) -> None:
        self.goals = dict(BEST_GOALS if goals is None else goals)
        for key, goal in self.goals.items():
            if goal not in ("max", "min"):
                raise ValueError(f"goal for {key!r} must be 'max' or 'min', got {goal!r}")
        self._best: dict[str, dict[str, float | int]] = {}

    def update(self, metrics: Mapping[str, Any], step: int) -> None:
        """Consider this step's ``metrics``; NaN and missing values are ignored."""
        for key, goal in self.goals.items():
            value = metrics.get(key)
            if value is None:
                continue
            value = float(value.item() if hasattr(value, "item") else value)
            if not math.isfinite(value):
                continue
            current = self._best.get(key)
            better = current is None or (
                value > current["value"] if goal == "max" else value < current["value"]
            )
            if better:
                self._best[key] = {"value": value, "step": step}

    def as_dict(self) -> dict[str, dict[str, float | int]]:
        """``{name: {"value": best, "step": step}}`` for metrics seen so far."""
        return {key: dict(entry) for key, entry in self._best.items()}
