"""Opening a page in headless Chromium: what it logged, what its tables hold, whether its plots drew.

Uses playwright-python driving the system Chromium (``/usr/bin/chromium``, or
``$VERITY_CHROMIUM``); no browser is ever downloaded. :func:`browser_unavailable`
says why a check cannot run (for a test's skip reason).

    report = inspect_page(Path("leaderboards/index.html"), screenshot=Path("leaderboards/screenshot.png"))
    report.console_errors      # console.error messages and uncaught page errors
    report.table_rows          # {"latest-grpo": 2, ...}: body rows per table id
    report.plots               # [(width, height), ...] rendered size of each svg.plot
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_ENV = "VERITY_CHROMIUM"
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")


def chromium_path() -> str | None:
    """The Chromium executable to drive: ``$VERITY_CHROMIUM`` or the first one on PATH."""
    env = os.environ.get(CHROMIUM_ENV)
    if env:
        return env if Path(env).is_file() else None
    for name in CHROMIUM_CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


def browser_unavailable() -> str | None:
    """None when a page can be inspected here, else the reason it cannot."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install 'verity-harness[browser]')"
    if chromium_path() is None:
        return "no Chromium found (apt-get install chromium, or set VERITY_CHROMIUM)"
    return None


@dataclass
class PageReport:
    """What a page showed in the browser."""

    title: str
    console_errors: list[str] = field(default_factory=list)
    table_rows: dict[str, int] = field(default_factory=dict)
    plots: list[tuple[float, float]] = field(default_factory=list)
    broken_images: int = 0
    # ids of tables wider than the page (they would need a sideways scroll)
    wide_tables: list[str] = field(default_factory=list)


_MEASURE = """() => ({
  wide: [...document.querySelectorAll('table[id]')].filter(
      t => t.getBoundingClientRect().right > document.documentElement.clientWidth + 1
           || t.scrollWidth > t.parentElement.clientWidth + 1).map(t => t.id),
  tables: Object.fromEntries([...document.querySelectorAll('table[id]')].map(
      t => [t.id, t.querySelectorAll('tbody tr').length])),
  plots: [...document.querySelectorAll('svg.plot')].map(s => {
      const r = s.getBoundingClientRect(); return [r.width, r.height, s.querySelectorAll('path').length]; }),
  broken: [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).length,
})"""


def inspect_page(path: Path, screenshot: Path | None = None, width: int = 1280) -> PageReport:
    """Load ``path`` (a local HTML file) headless; optionally save a full-page PNG screenshot."""
    from playwright.sync_api import sync_playwright

    reason = browser_unavailable()
    if reason is not None:
        raise RuntimeError(f"cannot open {path} in a browser: {reason}")
    errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
            page.goto(Path(path).resolve().as_uri(), wait_until="load")
            measured = page.evaluate(_MEASURE)
            if screenshot is not None:
                Path(screenshot).parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(screenshot), full_page=True)
            title = page.title()
        finally:
            browser.close()
    plots = [(w, h) for w, h, paths in measured["plots"] if paths > 0]
    return PageReport(
        title, errors, dict(measured["tables"]), plots, int(measured["broken"]), list(measured["wide"])
    )
