"""Leaderboard pages built from result files and MLflow runs, and the hardware bench page.

paths = build_leaderboard(Path("leaderboards/results"), Path("leaderboards"), ["sqlite:///outputs/harness/mlflow.db"],
                          bench_dirs=[Path("leaderboards/bench")], nightly_dirs=[Path("leaderboards/nightly")])
"""

from __future__ import annotations

import datetime as dt
import html
from collections.abc import Iterable
from pathlib import Path

from verity_harness.leaderboard.bench import collect_bench_rows, latest_bench_rows
from verity_harness.leaderboard.collect import collect_runs, latest_per_key
from verity_harness.leaderboard.pages import write_pages
from verity_harness.leaderboard.trend import load_nights

__all__ = [
    "build_leaderboard",
    "collect_bench_rows",
    "collect_runs",
    "latest_bench_rows",
    "latest_per_key",
    "load_nights",
    "write_pages",
]


def build_leaderboard(
    results_dir: Path | None,
    out_dir: Path,
    tracking_uris: Iterable[str] = (),
    generated: str | None = None,
    bench_dirs: Iterable[Path] = (),
    nightly_dirs: Iterable[Path] = (),
) -> list[Path]:
    """Collect the runs and write ``index.html`` plus one page per recipe into ``out_dir``.

    The pages' footer names the sources read: the results folder and the MLflow stores when
    there are any, each as a path relative to the current folder (a file name when outside
    it; a server's scheme and host), never a local absolute path (:func:`neutral_source`). ``bench_dirs``: folders searched for ``ci/bench_gpu.py``
    results; when any is found, ``bench.html`` too. ``nightly_dirs``: folders of per-night JSONs
    (``ci/nightly_history.py``); when any night is found, ``trend.html`` too.
    """
    uris = list(tracking_uris)
    runs = collect_runs(results_dir, uris)
    stamp = generated or dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = (
        []
        if results_dir is None
        else [f"the result files in <code>{html.escape(neutral_source(str(results_dir)))}</code>"]
    )
    if uris:
        parts.append(
            "the MLflow runs in " + ", ".join(f"<code>{html.escape(neutral_source(u))}</code>" for u in uris)
        )
    folders = [Path(d) for d in bench_dirs]
    bench = collect_bench_rows(folders)
    bench_sources = "the <code>ci/bench_gpu.py</code> results under " + ", ".join(
        f"<code>{html.escape(str(d))}</code>" for d in folders
    )
    night_folders = [Path(d) for d in nightly_dirs]
    nights = load_nights(night_folders)
    nights_sources = "the nights under " + ", ".join(
        f"<code>{html.escape(neutral_source(str(d)))}</code>" for d in night_folders
    )
    sources = " and ".join(parts) or "no source"
    return write_pages(runs, Path(out_dir), stamp, sources, bench, bench_sources, nights, nights_sources)


def neutral_source(source: str) -> str:
    """A results folder or MLflow URI as a page may show it: no local absolute path, no credentials.

    A local path (or ``sqlite:///`` / ``file:`` URI) becomes relative to the current folder, or
    its file name when outside it; a server URI keeps only its scheme and host.
    """
    from urllib.parse import urlparse

    parsed = urlparse(source)
    if parsed.scheme in ("http", "https", "databricks", "postgresql", "mysql", "mssql"):
        return f"{parsed.scheme}://{parsed.hostname or ''}"
    path = Path(source.split(":///", 1)[1] if ":///" in source else source.removeprefix("file:"))
    if not path.is_absolute():
        return str(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path.name
