"""Continue an MLflow run after a resume without logging the replayed steps twice.

A run killed after step k but checkpointed at step s < k has already logged steps
s+1..k; the resumed run computes them again (bit for bit the same on a deterministic
backend). :class:`ReplayAwareTracker` wraps the run's tracker and drops each
``(metric, step)`` value already in the tracking store, so every metric's history
reads like that of an uninterrupted run. Everything else passes through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def logged_points(tracking_uri: str, run_id: str) -> set[tuple[str, int]]:
    """Every ``(metric key, step)`` already logged in run ``run_id``."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    keys = list(client.get_run(run_id).data.metrics)
    return {(key, int(m.step)) for key in keys for m in client.get_metric_history(run_id, key)}


class ReplayAwareTracker:
    """A :class:`verity.tracking.Tracker` proxy whose ``log_metrics`` skips values already logged."""

    def __init__(self, tracker: Any, already_logged: set[tuple[str, int]]) -> None:
        self._tracker = tracker
        self._logged = already_logged
        self.skipped = 0

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Log the values of ``metrics`` at ``step`` that the run does not hold yet."""
        fresh = {k: v for k, v in metrics.items() if (k, step) not in self._logged}
        self.skipped += len(metrics) - len(fresh)
        if fresh:
            self._tracker.log_metrics(fresh, step=step)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tracker, name)
