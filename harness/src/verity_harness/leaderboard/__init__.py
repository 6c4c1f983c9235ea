"""Leaderboard pages built from result files and MLflow runs, and the hardware bench page.

paths = build_leaderboard(Path("leaderboards/results"), Path("leaderboards"), ["sqlite:///outputs/harness/mlflow.db"],
                          bench_dirs=[Path("ci/reports")])
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Iterable
from pathlib import Path

from verity_harness.leaderboard.bench import collect_bench_rows, latest_bench_rows
from verity_harness.leaderboard.collect import collect_runs, latest_per_key
from verity_harness.leaderboard.pages import write_pages

__all__ = [
    "build_leaderboard",
    "collect_bench_rows",
    "collect_runs",
    "latest_bench_rows",
    "latest_per_key",
    "write_pages",
]


def build_leaderboard(
    results_dir: Path | None,
    out_dir: Path,
    tracking_uris: Iterable[str] = (),
    generated: str | None = None,
    bench_dirs: Iterable[Path] = (),
) -> list[Path]:
    """Collect the runs and write ``index.html`` plus one page per recipe into ``out_dir``.

    The pages' footer names the sources read: the results folder as given, and the MLflow
    stores when there are any. ``bench_dirs``: folders searched for ``ci/bench_gpu.py``
    results; when any is found, ``bench.html`` too.
    """
    uris = list(tracking_uris)
    runs = collect_runs(results_dir, uris)
    stamp = generated or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [] if results_dir is None else [f"the result files in <code>{html.escape(str(results_dir))}</code>"]
    if uris:
        parts.append("the MLflow runs in " + ", ".join(f"<code>{html.escape(u)}</code>" for u in uris))
    folders = [Path(d) for d in bench_dirs]
    bench = collect_bench_rows(folders)
    bench_sources = "the <code>ci/bench_gpu.py</code> results under " + ", ".join(
        f"<code>{html.escape(str(d))}</code>" for d in folders
    )
    return write_pages(runs, Path(out_dir), stamp, " and ".join(parts) or "no source", bench, bench_sources)
