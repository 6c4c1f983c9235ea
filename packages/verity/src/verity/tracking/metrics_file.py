"""``metrics.jsonl``: one JSON object of metrics per RL step, in the run's output folder.

:class:`MetricsFile` is a step-end hook of the training loop (``hook(step, result)``):
after each step it appends that step's metrics, so a killed run leaves every finished
step behind. A resumed run first rewrites the file from the checkpoint's history
(:meth:`MetricsFile.start`), so replayed steps appear once. The loop calls it before the
checkpoint hook: a step's row is on disk before its checkpoint is saved.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

METRICS_FILE = "metrics.jsonl"


class HasHistory(Protocol):
    """What the hook reads of the loop's results: the per-step metrics so far."""

    history: list[dict[str, float]]


def jsonl_text(rows: Iterable[Mapping[str, Any]]) -> str:
    """One JSON object per line (each row's keys in order), a newline after each."""
    return "".join(json.dumps(dict(row)) + "\n" for row in rows)


class MetricsFile:
    """The run's ``metrics.jsonl``, kept up to date step by step.

    Args:
        out_dir: the run's output folder (``trainer.output_dir``); the file is ``out_dir/metrics.jsonl``.
    """

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / METRICS_FILE

    def start(self, history: list[dict[str, float]]) -> None:
        """Rewrite the file from ``history`` (the steps a resumed run keeps; empty when fresh)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(jsonl_text(history))

    def __call__(self, step: int, result: HasHistory) -> None:
        """Append the last step's metrics (``result.history[-1]``); nothing when there is none."""
        if result.history:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(jsonl_text(result.history[-1:]))

    def write(self, history: list[dict[str, float]]) -> None:
        """Write the whole history at once (a finished run's final copy)."""
        self.path.write_text(jsonl_text(history))
