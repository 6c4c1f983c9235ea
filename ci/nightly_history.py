"""Nightly history: each night's figures kept across nights, for people and for the trend page.

    python -m ci.nightly_history outputs/nightly/report.json            # record one finished night
    python -m ci.nightly_history --backfill ci/reports                   # the nights committed as Markdown
    mlflow ui --backend-store-uri sqlite:///outputs/nightly/mlflow.db    # each figure over nights

Recording a night (``ci/nightly.py`` does it after writing ``report.json``) writes:

1. one small JSON per night, ``<nights-dir>/<date>T<HHMM>-<machine class>.json`` (committed:
   ``leaderboards/nightly``, the folder ``verity-harness leaderboard`` reads for ``trend.html``):
   the night's date, commit, machine class and verdict, and per figure its value, the accepted
   band it was judged against (``low``/``high``, None where unbounded) and whether it passed;
2. one MLflow run in the experiment ``nightly`` of the history store (SQLite,
   ``--history-store PATH`` or ``$VERITY_NIGHTLY_HISTORY_STORE``, default
   ``outputs/nightly/mlflow.db``): each figure a metric at step = the night's index in that
   experiment and timestamp = the night's time, tagged with date, commit, machine class and
   verdict, so ``mlflow ui`` charts every figure over nights.

A figure's key is its report metric, the expected-file checks as ``expected/<row>.<metric>``
(e.g. ``expected/grpo.accuracy_gain``) beside the gates' ``grpo.accuracy_gain``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENV_VAR = "VERITY_NIGHTLY_HISTORY_STORE"
DEFAULT_STORE = ROOT / "outputs" / "nightly" / "mlflow.db"
DEFAULT_NIGHTS_DIR = ROOT / "leaderboards" / "nightly"
EXPERIMENT = "nightly"
KIND = "verity-nightly-night"  # the per-night JSON's "kind"; the trend page reads only these
EXPECTED_SUFFIX = " (expected file)"

__all__ = [
    "DEFAULT_NIGHTS_DIR",
    "DEFAULT_STORE",
    "ENV_VAR",
    "EXPERIMENT",
    "HistoryError",
    "band_of",
    "figure_key",
    "night_from_markdown",
    "night_from_report",
    "record_night",
    "store_uri",
    "write_night",
]


class HistoryError(ValueError):
    """A history store or report that cannot be used; the message is one sentence naming it."""


def store_uri(store: str | Path | None = None) -> str:
    """The ``sqlite:///`` URI of the history store: ``store``, else ``$VERITY_NIGHTLY_HISTORY_STORE``, else the default.

    ``store`` is a file path or a ``sqlite:///`` URI. Raises :class:`HistoryError` (one sentence)
    for a store that cannot be a SQLite file: another scheme, a folder, or a parent that is a file.
    """
    raw = str(store) if store not in (None, "") else os.environ.get(ENV_VAR) or str(DEFAULT_STORE)
    where = (
        "--history-store" if store not in (None, "") else (ENV_VAR if os.environ.get(ENV_VAR) else "default")
    )
    if "://" in raw and not raw.startswith("sqlite:///"):
        raise HistoryError(
            f"{where} {raw}: expected a file path or a sqlite:/// URI for the SQLite history store"
        )
    path = Path(raw.removeprefix("sqlite:///") if raw.startswith("sqlite:///") else raw).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    if path.is_dir():
        raise HistoryError(
            f"{where} {path}: is a folder; expected the SQLite file of the history store (e.g. mlflow.db)"
        )
    parent = next((p for p in [path.parent, *path.parent.parents] if p.exists()), None)
    if parent is None or not parent.is_dir():
        raise HistoryError(
            f"{where} {path}: {parent} is not a folder, so the SQLite history store cannot be created there"
        )
    if not os.access(parent, os.W_OK):
        raise HistoryError(
            f"{where} {path}: {parent} is not writable, so the SQLite history store cannot be written"
        )
    return "sqlite:///" + str(path)


def figure_key(metric: str) -> str:
    """The history's name for a report metric: ``expected/<row>.<m>`` for expected-file checks; MLflow-safe."""
    key = f"expected/{metric[: -len(EXPECTED_SUFFIX)]}" if metric.endswith(EXPECTED_SUFFIX) else metric
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", key)


def _float(v: Any) -> float | None:
    try:
        out = float(v)
    except (TypeError, ValueError):
        return None
    return out if out == out else None  # NaN: not a figure


def band_of(
    metric: str, value: float | None, baseline: float | None, ratio: float | None, threshold: str
) -> tuple[float | None, float | None]:
    """The accepted band ``(low, high)`` of one finding in the figure's own unit (None: unbounded).

    Expected-file checks (``within|at_least|at_most ±tol`` around the target) give target ∓ tol;
    a gate ``>= X`` / ``<= X`` bounds the ratio to the accepted value (so X x accepted), or the
    value itself when the threshold says ``(baseline - tol)`` or there is no ratio.
    """
    threshold = (threshold or "").strip()
    m = re.match(r"(within|at_least|at_most)\s*±\s*([0-9.eE+-]+)", threshold)
    if m and baseline is not None:
        tol = float(m.group(2))
        low = baseline - tol if m.group(1) in ("within", "at_least") else None
        high = baseline + tol if m.group(1) in ("within", "at_most") else None
        return low, high
    m = re.match(r"(>=|<=)\s*([0-9.eE+-]+)", threshold)
    if not m:
        return None, None
    bound = float(m.group(2))
    if ratio is not None and baseline is not None and "baseline" not in threshold:
        bound *= baseline
    return (bound, None) if m.group(1) == ">=" else (None, bound)


def _night(
    when: dt.datetime,
    machine_class: str,
    commit: str | None,
    findings: Sequence[Mapping[str, Any]],
    source: str,
    planted: Sequence[str] = (),
) -> dict[str, Any]:
    figures: dict[str, dict[str, Any]] = {}
    for f in findings:
        value = _float(f.get("value"))
        if value is None:
            continue
        baseline, ratio = _float(f.get("baseline")), _float(f.get("ratio"))
        low, high = band_of(str(f["metric"]), value, baseline, ratio, str(f.get("threshold") or ""))
        figures[figure_key(str(f["metric"]))] = {
            "value": value,
            "accepted": baseline,
            "low": None if low is None else round(low, 6),
            "high": None if high is None else round(high, 6),
            "ok": bool(f.get("ok")),
        }
    failing = [str(f["metric"]) for f in findings if not f.get("ok")]
    return {
        "kind": KIND,
        "finished_at": when.strftime("%Y-%m-%dT%H:%M:00Z"),
        "date": when.strftime("%Y-%m-%d"),
        "commit": commit,
        "machine_class": machine_class,
        "verdict": "REGRESSION" if failing else "OK",
        "failing": failing,
        "planted": list(planted),
        "source": source,
        "figures": figures,
    }


def night_from_report(
    report: Mapping[str, Any], source: str, when: dt.datetime | None = None
) -> dict[str, Any]:
    """One night's history record from a ``report.json`` document (``ci/nightly.py``'s).

    ``when``: the night's end (default: now, UTC). Raises :class:`HistoryError` for a document
    without ``findings``.
    """
    if not isinstance(report, Mapping) or not isinstance(report.get("findings"), list):
        raise HistoryError(f"{source}: expected a nightly report.json with a 'findings' list")
    commit = next(
        (
            r.get("git_commit")
            for r in (report.get("recipes") or {}).values()
            if isinstance(r, Mapping) and r.get("git_commit")
        ),
        None,
    )
    planted = [
        *(report.get("overrides") or []),
        *(f"slowdown {p}" for p in report.get("planted_slowdown") or []),
    ]
    return _night(
        when or dt.datetime.now(dt.UTC),
        str(report.get("machine_class") or "unknown"),
        commit,
        report["findings"],
        source,
        planted,
    )


_HEADING = re.compile(r"^#+ Nightly report — (\d{4}-\d{2}-\d{2}) (\d{2}:\d{2}) UTC", re.M)
_MACHINE = re.compile(r"^machine: (\S+) \(([^,]+), ([^,]+), ", re.M)
_COMMIT = re.compile(r"(?:code|at|commit|of main at) `([0-9a-f]{7,40})`")
_OVERRIDES = re.compile(r"^verdict:.*?(?:overrides|planted): `([^`]*)`", re.M)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def night_from_markdown(text: str, source: str) -> dict[str, Any] | None:
    """One night from a committed Markdown report (``ci/reports/*nightly*.md``), None if it holds no night.

    Reads the ``Nightly report — <date> <time> UTC`` heading (else the date in ``source``'s
    name at 00:00), the ``machine:`` line (older reports have none: machine class
    ``unrecorded``), a commit named in backticks before the report (``code `abc1234```), and the
    first table whose header starts ``| metric |`` (its ``tonight``, ``accepted``, ``ratio``,
    ``threshold`` and ``status`` columns, however many others there are).
    """
    lines = text.splitlines()
    header_at = next((i for i, ln in enumerate(lines) if ln.startswith("| metric |")), None)
    if header_at is None:
        return None
    head = _cells(lines[header_at])
    col = {name: i for i, name in enumerate(head)}
    tonight = col.get("tonight", col.get("tonight (median)"))
    needed = [tonight, col.get("accepted"), col.get("threshold"), col.get("status")]
    if any(c is None for c in needed):
        return None
    findings = []
    for ln in lines[header_at + 2 :]:
        if not ln.startswith("|"):
            break
        cells = _cells(ln)
        if len(cells) != len(head):
            continue
        findings.append(
            {
                "metric": cells[0],
                "value": cells[tonight],
                "baseline": cells[col["accepted"]],
                "ratio": cells[col["ratio"]] if "ratio" in col else None,
                "threshold": cells[col["threshold"]],
                "ok": cells[col["status"]] == "ok",
            }
        )
    heading = _HEADING.search(text)
    if heading:
        when = dt.datetime.strptime(f"{heading.group(1)} {heading.group(2)}", "%Y-%m-%d %H:%M")
    else:
        named = re.search(r"(\d{4}-\d{2}-\d{2})", source)
        if named is None:
            return None
        when = dt.datetime.strptime(named.group(1), "%Y-%m-%d")
    machine = _MACHINE.search(text)
    klass = f"{machine.group(1)}/{machine.group(3)}" if machine else "unrecorded"
    before = text[: heading.start()] if heading else text[: text.find("| metric |")]
    commit = _COMMIT.search(before)
    overrides = _OVERRIDES.search(text)
    return _night(
        when.replace(tzinfo=dt.UTC),
        klass,
        commit.group(1) if commit else None,
        findings,
        source,
        [overrides.group(1)] if overrides else [],
    )


def night_file_name(night: Mapping[str, Any]) -> str:
    """``<date>T<HHMM>-<machine class with / as _>.json``."""
    stamp = str(night["finished_at"])[:16].replace(":", "")
    return f"{stamp}-{str(night['machine_class']).replace('/', '_')}.json"


def write_night(night: Mapping[str, Any], nights_dir: Path) -> Path:
    """Write ``night`` as one small JSON into ``nights_dir`` (created); its path."""
    nights_dir.mkdir(parents=True, exist_ok=True)
    path = nights_dir / night_file_name(night)
    path.write_text(json.dumps(night, indent=1, sort_keys=True) + "\n")
    return path


def log_night(night: Mapping[str, Any], uri: str) -> str:
    """One MLflow run for ``night`` in experiment ``nightly`` of the store ``uri``; the run id.

    Each figure is a metric at step = the number of runs already in the experiment (the night's
    index) and timestamp = the night's time; ``night/failing`` counts its failing figures.
    """
    import mlflow
    from mlflow.entities import Metric

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(EXPERIMENT)
    exp_id = exp.experiment_id if exp is not None else client.create_experiment(EXPERIMENT)
    step = len(client.search_runs([exp_id], max_results=50000))
    when = dt.datetime.strptime(str(night["finished_at"]), "%Y-%m-%dT%H:%M:00Z").replace(tzinfo=dt.UTC)
    stamp_ms = int(when.timestamp() * 1000)
    tags = {
        "date": str(night["date"]),
        "commit": str(night.get("commit") or "unknown"),
        "machine_class": str(night["machine_class"]),
        "verdict": str(night["verdict"]),
        "source": str(night.get("source") or ""),
        "planted": "; ".join(night.get("planted") or []) or "no",
    }
    run = client.create_run(
        exp_id, start_time=stamp_ms, tags=tags, run_name=f"{night['date']} {night['machine_class']}"
    )
    metrics = [Metric(k, float(v["value"]), stamp_ms, step) for k, v in sorted(night["figures"].items())]
    metrics.append(Metric("night/failing", float(len(night.get("failing") or [])), stamp_ms, step))
    for i in range(0, len(metrics), 500):
        client.log_batch(run.info.run_id, metrics=metrics[i : i + 500])
    client.set_terminated(run.info.run_id, end_time=stamp_ms)
    return run.info.run_id


def write_trend(nights_dir: Path, board_dir: Path) -> Path:
    """Rewrite ``board_dir/trend.html`` from the nights in ``nights_dir`` (the harness's trend page); its path."""
    import html

    from verity_harness.leaderboard.pages import _page
    from verity_harness.leaderboard.trend import load_nights, trend_body

    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    where = nights_dir.relative_to(ROOT) if nights_dir.is_relative_to(ROOT) else nights_dir.name
    page = _page(
        "verity nightly trend",
        trend_body(load_nights([nights_dir])),
        stamp,
        f"the nights under <code>{html.escape(str(where))}</code>",
    )
    board_dir.mkdir(parents=True, exist_ok=True)
    path = board_dir / "trend.html"
    path.write_text(page, encoding="utf-8")
    return path


def record_night(
    report_file: Path,
    nights_dir: Path | None = None,
    store: str | Path | None = None,
    board_dir: Path | None = None,
) -> tuple[Path, str]:
    """Record the night in ``report_file`` (a ``report.json``): its per-night JSON and its MLflow run.

    ``board_dir``: also rewrite its ``trend.html`` with this night in it. Returns
    ``(json path, MLflow run id)``. Raises :class:`HistoryError` (one sentence) for an unusable
    store or report.
    """
    uri = store_uri(store)
    try:
        report = json.loads(Path(report_file).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise HistoryError(
            f"{report_file}: expected a nightly report.json, could not read it ({err})"
        ) from err
    when = dt.datetime.fromtimestamp(Path(report_file).stat().st_mtime, dt.UTC)
    night = night_from_report(report, str(report_file), when)
    path = write_night(night, nights_dir or DEFAULT_NIGHTS_DIR)
    run_id = log_night(night, uri)
    if board_dir is not None:
        write_trend(path.parent, board_dir)
    return path, run_id


def backfill(reports_dir: Path, nights_dir: Path, store: str | Path | None = None) -> list[Path]:
    """Every committed Markdown night under ``reports_dir`` (oldest first) into the history; the JSONs written.

    Nights with planted changes (overrides, slowdowns) are left out, as the nightly leaves their
    result files out of the committed leaderboard.
    """
    uri = store_uri(store)
    nights = []
    for md in sorted(Path(reports_dir).glob("*.md")):
        night = night_from_markdown(
            md.read_text(), md.relative_to(ROOT).as_posix() if md.is_relative_to(ROOT) else md.name
        )
        if night is not None and not night["planted"]:
            nights.append(night)
    written = []
    for night in sorted(nights, key=lambda n: n["finished_at"]):
        written.append(write_night(night, nights_dir))
        log_night(night, uri)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", nargs="?", type=Path, help="a finished night's report.json")
    parser.add_argument(
        "--backfill", type=Path, metavar="REPORTS_DIR", help="record the Markdown nights in this folder"
    )
    parser.add_argument("--nights-dir", type=Path, default=DEFAULT_NIGHTS_DIR)
    parser.add_argument("--board-dir", type=Path, help="also rewrite this leaderboard folder's trend.html")
    parser.add_argument(
        "--history-store",
        help=f"SQLite file (or sqlite:/// URI) of the MLflow history; default ${ENV_VAR} or {DEFAULT_STORE}",
    )
    args = parser.parse_args(argv)
    if (args.report is None) == (args.backfill is None):
        print("nightly_history: give one report.json or --backfill REPORTS_DIR", file=sys.stderr)
        return 2
    try:
        if args.backfill is not None:
            for path in backfill(args.backfill, args.nights_dir, args.history_store):
                print(f"wrote {path}")
        else:
            path, run_id = record_night(args.report, args.nights_dir, args.history_store, args.board_dir)
            print(
                f"wrote {path}; MLflow run {run_id} in experiment {EXPERIMENT} of {store_uri(args.history_store)}"
            )
    except HistoryError as err:
        print(f"nightly_history: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
