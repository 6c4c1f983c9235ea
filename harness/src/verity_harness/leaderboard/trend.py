"""The nightly trend page, ``trend.html``: each figure of the nightly over nights.

The nights are the small JSON files ``ci/nightly_history.py`` writes, one per night
(``leaderboards/nightly/<date>T<HHMM>-<machine class>.json``, ``"kind": "verity-nightly-night"``),
each with ``finished_at``, ``machine_class``, ``commit``, ``verdict`` and
``figures: {key: {"value", "accepted", "low", "high", "ok"}}`` (``low``/``high``: the accepted
band the gate judged the value against, None where unbounded).

Speed figures are ratios measured on one machine, so each machine class has its own section.
Each figure is one inline ``<svg class="plot">`` (no scripts, nothing fetched): the values over
nights as a line, the accepted band as a shaded area, each night that failed the figure as a red
point (``circle.regression``). Tables the browser test reads: ``table#trend-nights`` (every night,
newest first) and ``table#trend-regressions`` (every failing figure of every night).
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

KIND = "verity-nightly-night"
WIDTH, HEIGHT, PAD_X, PAD_Y = 320.0, 120.0, 34.0, 12.0

__all__ = ["load_nights", "trend_body", "trend_svg"]


def load_nights(folders: Iterable[Path]) -> list[dict[str, Any]]:
    """Every per-night JSON (``"kind": "verity-nightly-night"``) under ``folders``, oldest first.

    Files that are not nights (unreadable, another kind) are skipped with a warning.
    """
    nights = []
    for folder in folders:
        for path in sorted(Path(folder).glob("*.json")):
            try:
                doc = json.loads(path.read_text())
            except (OSError, json.JSONDecodeError) as err:
                logger.warning("skipping %s: not JSON (%s)", path, err)
                continue
            if (
                not isinstance(doc, dict)
                or doc.get("kind") != KIND
                or not isinstance(doc.get("figures"), dict)
            ):
                logger.warning("skipping %s: not a nightly night (kind %r)", path, KIND)
                continue
            nights.append(doc)
    return sorted(nights, key=lambda n: str(n.get("finished_at")))


def _fmt(v: float | None) -> str:
    return "–" if v is None else f"{v:.4g}"


def trend_svg(label: str, points: Sequence[Mapping[str, Any]]) -> str:
    """One figure over nights as inline SVG (320 x 120 user units).

    ``points``: one per night, oldest first, each ``{"night": str, "value", "low", "high", "ok"}``
    (``value`` None: not measured that night). The band is the area between ``low`` and ``high``
    (the plot's edge where one is None); a failing night is a red ``circle.regression``.
    """
    values = [p["value"] for p in points if p.get("value") is not None]
    bounds = [b for p in points for b in (p.get("low"), p.get("high")) if b is not None]
    lo, hi = min(values + bounds), max(values + bounds)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5 * (abs(lo) or 1.0), hi + 0.5 * (abs(hi) or 1.0)
    span = hi - lo
    lo, hi = lo - 0.08 * span, hi + 0.08 * span
    n = len(points)

    def x(i: int) -> float:
        return PAD_X + (WIDTH - PAD_X - 6) * (0.5 if n == 1 else i / (n - 1))

    def y(v: float) -> float:
        return HEIGHT - PAD_Y - (HEIGHT - 2 * PAD_Y) * (v - lo) / (hi - lo)

    parts = [
        f'<svg role="img" aria-label="{html.escape(label)}" class="plot" viewBox="0 0 {WIDTH:g} {HEIGHT:g}" '
        f'width="{WIDTH:g}" height="{HEIGHT:g}" xmlns="http://www.w3.org/2000/svg">',
        f'<path class="axis" d="M{PAD_X:g} {PAD_Y:g}V{HEIGHT - PAD_Y:g}H{WIDTH - 4:g}" stroke="#8c959f" fill="none"/>',
        f'<text x="{PAD_X - 3:g}" y="{PAD_Y + 4:g}" font-size="9" text-anchor="end">{_fmt(hi)}</text>',
        f'<text x="{PAD_X - 3:g}" y="{HEIGHT - PAD_Y:g}" font-size="9" text-anchor="end">{_fmt(lo)}</text>',
    ]
    banded = [(i, p) for i, p in enumerate(points) if p.get("low") is not None or p.get("high") is not None]
    if banded:
        half = 0.5 * (WIDTH - PAD_X - 6) / max(n - 1, 1)
        top, bottom = [], []
        for i, p in banded:
            x0, x1 = max(PAD_X, x(i) - half), min(WIDTH - 6, x(i) + half)
            top_y = y(p["high"]) if p.get("high") is not None else y(hi)
            bottom_y = y(p["low"]) if p.get("low") is not None else y(lo)
            top += [(x0, top_y), (x1, top_y)]
            bottom += [(x0, bottom_y), (x1, bottom_y)]
        ring = top + bottom[::-1]
        d = "M" + "L".join(f"{a:.1f} {b:.1f}" for a, b in ring) + "Z"
        parts.append(f'<path class="band" d="{d}" fill="#1a7f37" fill-opacity="0.13" stroke="none"/>')
    measured = [(i, p) for i, p in enumerate(points) if p.get("value") is not None]
    if len(measured) > 1:
        d = "M" + "L".join(f"{x(i):.1f} {y(p['value']):.1f}" for i, p in measured)
        parts.append(f'<path class="line" d="{d}" stroke="#0969da" stroke-width="1.5" fill="none"/>')
    for i, p in measured:
        bad = not p.get("ok", True)
        tip = f"{p['night']}: {_fmt(p['value'])} (band {_fmt(p.get('low'))} to {_fmt(p.get('high'))})" + (
            ", REGRESSION" if bad else ""
        )
        parts.append(
            f'<circle class="{"regression" if bad else "night"}" cx="{x(i):.1f}" cy="{y(p["value"]):.1f}" '
            f'r="{4 if bad else 2.2}" fill="{"#cf222e" if bad else "#0969da"}"><title>{html.escape(tip)}</title></circle>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _night_label(night: Mapping[str, Any]) -> str:
    return str(night.get("finished_at", ""))[:16].replace("T", " ")


def _class_section(klass: str, nights: Sequence[Mapping[str, Any]]) -> str:
    keys = sorted({k for n in nights for k in n["figures"]})
    figures = []
    for key in keys:
        points = []
        for night in nights:
            f = night["figures"].get(key) or {}
            points.append(
                {
                    "night": _night_label(night),
                    "value": f.get("value"),
                    "low": f.get("low"),
                    "high": f.get("high"),
                    "ok": f.get("ok", True),
                }
            )
        latest = next((p for p in reversed(points) if p["value"] is not None), None)
        if latest is None:
            continue
        failed = sum(1 for p in points if p["value"] is not None and not p["ok"])
        caption = f"{key}: latest {_fmt(latest['value'])}" + (
            f", {failed} failing night(s)" if failed else ""
        )
        figures.append(
            f'<figure class="plot trend">{trend_svg(f"{klass}: {key}", points)}'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>"
        )
    anchor = html.escape(klass.replace("/", "-"))
    return (
        f'<section id="trend-{anchor}"><h2>{html.escape(klass)}</h2>'
        f'<p class="meta">{len(nights)} night(s), {_night_label(nights[0])} to {_night_label(nights[-1])}.</p>'
        f'<div class="plots">{"".join(figures)}</div></section>'
    )


def _table(table_id: str, caption: str, head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    th = "".join(f'<th class="text">{html.escape(h)}</th>' for h in head)
    body = "".join("<tr>" + "".join(rows_cell for rows_cell in row) + "</tr>" for row in rows)
    return (
        f'<div class="scroll"><table id="{table_id}"><caption>{html.escape(caption)}</caption>'
        f"<thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>"
    )


def _td(text: str, cls: str = "text") -> str:
    return f'<td class="{cls}">{html.escape(text)}</td>'


def trend_body(nights: Sequence[Mapping[str, Any]]) -> str:
    """The trend page's body: the nights, the regressions, and one section of plots per machine class."""
    intro = (
        '<p><a href="index.html">all recipes</a></p><h1>verity nightly trend</h1>'
        '<p class="meta">Each figure the nightly judges (<code>ci/nightly.py</code>), over nights: the value '
        "as a blue line, the accepted band it was judged against shaded green (expected-file checks: "
        "target ± tolerance; speed ratios: the gate's allowed drop from the accepted value), each night "
        "that failed the figure as a red point. Speed figures are ratios measured side by side on one "
        "machine, so each machine class has its own plots; nights recorded before reports named their "
        "machine are under <code>unrecorded</code>. <code>expected/</code> figures are the recipes' "
        "expected-file checks. The same figures are in the MLflow experiment <code>nightly</code> "
        "(<code>mlflow ui --backend-store-uri sqlite:///outputs/nightly/mlflow.db</code>).</p>"
    )
    night_rows = [
        [
            _td(_night_label(n)),
            _td(str(n.get("machine_class"))),
            _td(str(n.get("commit") or "–")),
            _td(str(n.get("verdict")), "pass" if n.get("verdict") == "OK" else "fail"),
            _td(str(len(n["figures"])), "num"),
            _td(", ".join(n.get("failing") or []) or "–"),
        ]
        for n in reversed(nights)
    ]
    regressions = [
        [
            _td(_night_label(n)),
            _td(str(n.get("machine_class"))),
            _td(key),
            _td(_fmt(f.get("value")), "num"),
            _td(f"{_fmt(f.get('low'))} to {_fmt(f.get('high'))}", "num"),
        ]
        for n in reversed(nights)
        for key, f in sorted(n["figures"].items())
        if not f.get("ok", True)
    ]
    classes: dict[str, list[Mapping[str, Any]]] = {}
    for n in nights:
        classes.setdefault(str(n.get("machine_class")), []).append(n)
    return (
        intro
        + _table(
            "trend-nights",
            "every night, newest first",
            ["night (UTC)", "machine class", "commit", "verdict", "figures", "failing"],
            night_rows,
        )
        + _table(
            "trend-regressions",
            "every failing figure, newest night first",
            ["night (UTC)", "machine class", "figure", "value", "accepted band"],
            regressions,
        )
        + "".join(
            _class_section(k, ns)
            for k, ns in sorted(classes.items(), key=lambda kv: kv[1][-1]["finished_at"], reverse=True)
        )
    )
