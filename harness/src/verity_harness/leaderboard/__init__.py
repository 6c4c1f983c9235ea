"""Leaderboard pages built from result files and MLflow runs.

paths = build_leaderboard(Path("leaderboards/results"), Path("leaderboards"), ["sqlite:///outputs/harness/mlflow.db"])
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from pathlib import Path

from verity_harness.leaderboard.collect import collect_runs, latest_per_key
from verity_harness.leaderboard.pages import write_pages

__all__ = ["build_leaderboard", "collect_runs", "latest_per_key", "write_pages"]


def build_leaderboard(
    results_dir: Path | None, out_dir: Path, tracking_uris: Iterable[str] = (), generated: str | None = None
) -> list[Path]:
    """Collect the runs and write ``index.html`` plus one page per recipe into ``out_dir``."""
    runs = collect_runs(results_dir, tracking_uris)
    stamp = generated or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return write_pages(runs, Path(out_dir), stamp)
