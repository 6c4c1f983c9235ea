"""trend.html: each nightly figure over nights, its accepted band, the failing nights marked; and ran.mode."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from verity_harness.browser import browser_unavailable, inspect_page
from verity_harness.cli import main as harness_main
from verity_harness.leaderboard import build_leaderboard, load_nights
from verity_harness.leaderboard.pages import LATEST_COLUMNS
from verity_harness.leaderboard.trend import trend_svg
from verity_harness.results import write_result


def _night(when: str, klass: str, gain: float, ratio: float, ok_ratio: bool = True) -> dict[str, Any]:
    figures = {
        "expected/grpo.accuracy_gain": {
            "value": gain,
            "accepted": 0.4,
            "low": 0.34,
            "high": None,
            "ok": gain >= 0.34,
        },
        "bench.train_vs_plain_torch": {
            "value": ratio,
            "accepted": 0.8,
            "low": 0.76,
            "high": None,
            "ok": ok_ratio,
        },
    }
    failing = [k for k, f in figures.items() if not f["ok"]]
    return {
        "kind": "verity-nightly-night",
        "finished_at": when,
        "date": when[:10],
        "commit": "abc1234",
        "machine_class": klass,
        "verdict": "REGRESSION" if failing else "OK",
        "failing": failing,
        "planted": [],
        "source": "test",
        "figures": figures,
    }


def _nights(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    nights = [
        _night("2026-11-25T01:00:00Z", "cpu-a/avx2", 0.41, 0.80),
        _night("2026-11-26T01:00:00Z", "cpu-a/avx2", 0.30, 0.70, ok_ratio=False),  # both fail
        _night("2026-11-27T01:00:00Z", "cpu-a/avx2", 0.42, 0.81),
        _night("2026-11-27T02:00:00Z", "cpu-b/amx", 0.40, 0.90),
    ]
    for i, night in enumerate(nights):
        (folder / f"n{i}.json").write_text(json.dumps(night))
    (folder / "other.json").write_text(json.dumps({"kind": "something else"}))  # skipped
    return folder


def test_nights_are_read_oldest_first_and_other_files_skipped(tmp_path: Path) -> None:
    nights = load_nights([_nights(tmp_path / "nightly")])
    assert [n["finished_at"][:13] for n in nights] == [
        "2026-11-25T01",
        "2026-11-26T01",
        "2026-11-27T01",
        "2026-11-27T02",
    ]


def test_the_trend_page_plots_each_figure_per_machine_class_with_its_band_and_regressions(
    tmp_path: Path, result_factory
) -> None:
    results = tmp_path / "results"
    write_result(results, result_factory())
    paths = build_leaderboard(
        results, tmp_path / "board", generated="test", nightly_dirs=[_nights(tmp_path / "n")]
    )
    trend = tmp_path / "board" / "trend.html"
    assert trend in paths
    index = paths[0].read_text()
    assert '<a id="trend-link" href="trend.html">' in index
    page = trend.read_text()
    nights_table = re.search(r'<table id="trend-nights">.*?</table>', page, re.S).group(0)
    assert nights_table.count("<tr><td") == 4
    regressions = re.search(r'<table id="trend-regressions">.*?</table>', page, re.S).group(0)
    assert regressions.count("<tr><td") == 2
    assert "bench.train_vs_plain_torch" in regressions and "expected/grpo.accuracy_gain" in regressions
    # 2 figures x 2 machine classes, each with its band and a line; the failing night's points are red
    assert page.count('<svg role="img"') == 4
    assert page.count('class="band"') == 4
    assert page.count('<circle class="regression"') == 2
    assert page.index('id="trend-cpu-b-amx"') < page.index('id="trend-cpu-a-avx2"')  # newest class first


def test_no_nights_no_trend_page_and_no_link(tmp_path: Path, result_factory) -> None:
    write_result(tmp_path / "r", result_factory())
    paths = build_leaderboard(tmp_path / "r", tmp_path / "board", generated="test", nightly_dirs=[tmp_path])
    assert [p.name for p in paths] == ["index.html", "grpo.html"]
    assert "trend-link" not in paths[0].read_text()


def test_a_band_drawn_within_the_plot_and_a_value_outside_it_is_marked() -> None:
    points = [
        {"night": "a", "value": 1.0, "low": 0.9, "high": 1.1, "ok": True},
        {"night": "b", "value": 0.5, "low": 0.9, "high": 1.1, "ok": False},
    ]
    svg = trend_svg("x", points)
    band = re.search(r'class="band" d="M([^"]+)Z"', svg).group(1)
    ys = [float(pair.split()[1]) for pair in band.split("L")]
    assert all(0 <= y <= 120 for y in ys)
    cy = [float(v) for v in re.findall(r'cy="([0-9.]+)"', svg)]
    assert cy[1] > max(ys)  # the failing value lies below the band's floor (SVG y grows downwards)
    assert "REGRESSION" in svg


def test_the_cli_refuses_a_missing_nightly_folder(tmp_path: Path, capsys) -> None:
    (tmp_path / "r").mkdir()
    code = harness_main(
        ["leaderboard", "--results-dir", str(tmp_path / "r"), "--out", str(tmp_path / "b"), "--no-mlflow"]
        + ["--nightly-dir", str(tmp_path / "none")]
    )
    assert code == 2
    assert "--nightly-dir" in capsys.readouterr().err


def test_the_mode_column_shows_what_the_run_reported_running(tmp_path: Path, result_factory) -> None:
    write_result(tmp_path, result_factory(config="cpu-async", ran={"mode": "async"}))
    write_result(tmp_path, result_factory(config="cpu", ran={"mode": "sync"}))
    write_result(tmp_path, result_factory(config="cpu-lora"))  # a result from before runs recorded it
    page = build_leaderboard(tmp_path, tmp_path / "board", generated="test")[0].read_text()
    table = re.search(r'<table id="latest-grpo">.*?</table>', page, re.S).group(0)
    column = [title for title, _, _ in LATEST_COLUMNS].index("mode")
    modes = {}
    for row in re.findall(r'<tr class="run">(.*?)</tr>', table, re.S):
        cells = re.findall(r"<td[^>]*>.*?</td>", row)
        modes[re.sub(r"<[^>]+>", "", cells[0])] = re.sub(r"<[^>]+>", "", cells[column])
    assert modes == {"cpu-async": "async", "cpu": "sync", "cpu-lora": "–"}


REASON = browser_unavailable()


@pytest.mark.skipif(REASON is not None, reason=f"browser test skipped: {REASON}")
def test_the_trend_page_in_headless_chromium(tmp_path: Path, result_factory) -> None:
    write_result(tmp_path / "r", result_factory())
    build_leaderboard(
        tmp_path / "r", tmp_path / "board", generated="test", nightly_dirs=[_nights(tmp_path / "n")]
    )
    report = inspect_page(tmp_path / "board" / "trend.html", screenshot=tmp_path / "trend.png")
    assert report.console_errors == []
    assert report.title == "verity nightly trend"
    assert report.table_rows == {"trend-nights": 4, "trend-regressions": 2}
    assert len(report.plots) == 4 and all(w > 100 and h > 40 for w, h in report.plots), report.plots
    assert report.wide_tables == [] and report.broken_images == 0
