"""Leaderboard pages built from result files and MLflow runs.

paths = build_leaderboard(Path("leaderboards/results"), Path("leaderboards"), ["sqlite:///outputs/harness/mlflow.db"])
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Iterable
from pathlib import Path

from verity_harness.leaderboard.collect import collect_runs, latest_per_key
from verity_harness.leaderboard.pages import write_pages

__all__ = ["build_leaderboard", "collect_runs", "latest_per_key", "write_pages"]


def build_leaderboard(
    results_dir: Path | None, out_dir: Path, tracking_uris: Iterable[str] = (), generated: str | None = None
) -> list[Path]:
    """Collect the runs and write ``index.html`` plus one page per recipe into ``out_dir``.

    The pages' footer names the sources read: the results folder as given, and the MLflow
    stores when there are any.
    """
    uris = list(tracking_uris)
    runs = collect_runs(results_dir, uris)
    stamp = generated or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [] if results_dir is None else [f"the result files in <code>{html.escape(str(results_dir))}</code>"]
    if uris:
        parts.append("the MLflow runs in " + ", ".join(f"<code>{html.escape(u)}</code>" for u in uris))
    return write_pages(runs, Path(out_dir), stamp, " and ".join(parts) or "no source")
