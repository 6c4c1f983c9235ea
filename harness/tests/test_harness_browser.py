"""The leaderboard in a real headless Chromium: no console errors, tables hold the runs, plots render."""

from __future__ import annotations

from pathlib import Path

import pytest
from verity_harness.browser import browser_unavailable, inspect_page
from verity_harness.leaderboard import build_leaderboard
from verity_harness.results import write_result

REASON = browser_unavailable()


@pytest.mark.skipif(REASON is not None, reason=f"browser test skipped: {REASON}")
def test_leaderboard_page_in_headless_chromium(tmp_path: Path, result_factory) -> None:
    results = tmp_path / "results"
    write_result(results, result_factory())
    write_result(
        results, result_factory(hardware="h100", family="cuda", throughput={"tokens_per_s": 9e3, "mfu": 0.3})
    )
    write_result(results, result_factory(recipe="ppo", backend="vllm"))
    index = build_leaderboard(results, tmp_path / "board", generated="test")[0]

    report = inspect_page(index, screenshot=tmp_path / "shot.png")

    assert report.console_errors == []
    assert report.title == "verity leaderboards"
    assert report.table_rows == {"latest-grpo": 2, "latest-ppo": 1}
    assert len(report.plots) == 6  # accuracy, reward and throughput for each recipe
    assert all(w > 100 and h > 50 for w, h in report.plots), report.plots
    assert report.broken_images == 0
    assert (tmp_path / "shot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(REASON is not None, reason=f"browser test skipped: {REASON}")
def test_a_console_error_is_reported(tmp_path: Path) -> None:
    page = tmp_path / "bad.html"
    page.write_text(
        "<html><body><table id='t'><tbody><tr><td>1</td></tr></tbody></table>"
        "<script>console.error('boom')</script></body></html>"
    )
    report = inspect_page(page)
    assert report.console_errors == ["boom"]
    assert report.table_rows == {"t": 1}
