"""verity.tracking: MLflow logging, console progress, run summaries, metric names.

    from verity.tracking import Tracker, ProgressLine, write_summary, config_hash, names

    with Tracker(run_dir, run_name="grpo") as tracker:      # sqlite:///<run_dir>/mlflow.db
        tracker.log_params(cfg_dict)                          # nested → dotted params
        for step in range(1, steps + 1):
            tracker.log_metrics({names.REWARD_MEAN: r}, step)
    write_summary(run_dir, final, best.as_dict(), wall_s, config_hash(cfg_dict))

MLflow is imported only when a Tracker is created.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verity.tracking import names
from verity.tracking.params import config_hash, flatten_config, to_mlflow_params
from verity.tracking.progress import ProgressLine, format_metrics, format_value
from verity.tracking.summary import SUMMARY_FILE, BestMetrics, atomic_write_text, read_summary, write_summary

if TYPE_CHECKING:
    from verity.tracking.mlflow_tracker import Tracker, embedded_tracking_uri

__all__ = [
    "SUMMARY_FILE",
    "BestMetrics",
    "ProgressLine",
    "Tracker",
    "atomic_write_text",
    "config_hash",
    "embedded_tracking_uri",
    "flatten_config",
    "format_metrics",
    "format_value",
    "names",
    "read_summary",
    "to_mlflow_params",
    "write_summary",
]


def __getattr__(name: str) -> Any:
    # Tracker pulls in mlflow, slow to import; load it on first use only
    # (ci/reports/2026-12-06-docstring-figures.md)
    if name in ("Tracker", "embedded_tracking_uri"):
        from verity.tracking import mlflow_tracker

        return getattr(mlflow_tracker, name)
    raise AttributeError(f"module 'verity.tracking' has no attribute {name!r}")
