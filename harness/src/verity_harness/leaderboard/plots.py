"""Leaderboard plots as inline SVG (matplotlib, Agg): curves per run and throughput bars.

Inline SVG keeps each page one self-contained file: nothing to fetch, nothing to
break when the folder is moved or served from elsewhere.
"""

from __future__ import annotations

import io
import re
from collections.abc import Mapping, Sequence
from typing import Any

_XML_HEADER = re.compile(r"^<\?xml[^>]*>\s*(<!DOCTYPE[^>]*>\s*)?", re.S)


def _figure(width: float = 6.4, height: float = 3.2) -> tuple[Any, Any]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    return fig, ax


def _to_svg(fig: Any, label: str) -> str:
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    # Text as <text> (not glyph outlines repeated in every plot); ids salted by the plot's label,
    # so several plots on one page never share an id and the same data gives the same file.
    with plt.rc_context({"svg.fonttype": "none", "svg.hashsalt": f"verity:{label}"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    plt.close(fig)
    svg = _XML_HEADER.sub("", buffer.getvalue())
    return svg.replace("<svg ", f'<svg role="img" aria-label="{label}" class="plot" ', 1)


def curves_svg(
    runs: Sequence[Mapping[str, Any]], key: str, title: str, unit_interval: bool = False
) -> str | None:
    """One line per run of ``curves[key]`` against its step (None when no run has the curve).

    Each run needs ``label`` and ``curves`` with ``step`` (or ``val_step`` for ``val/acc``).
    ``unit_interval`` fixes the y axis to [0, 1] (accuracies).
    """
    step_key = "val_step" if key.startswith("val/") else "step"
    series = []
    for run in runs:
        c = run.get("curves") or {}
        xs, ys = c.get(step_key) or [], c.get(key) or []
        points = [(x, y) for x, y in zip(xs, ys, strict=False) if y is not None]
        if points:
            series.append((run["label"], points))
    if not series:
        return None
    fig, ax = _figure()
    for label, points in series:
        ax.plot(
            [p[0] for p in points],
            [p[1] for p in points],
            marker="o" if len(points) < 12 else None,
            linewidth=1.4,
            markersize=3,
            label=label,
        )
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("RL step")
    if unit_interval:
        ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return _to_svg(fig, title)


def throughput_svg(runs: Sequence[Mapping[str, Any]], title: str = "throughput") -> str | None:
    """Horizontal bars of step tokens/s and generated tokens/s per run (None without figures)."""
    rows = [
        (
            r["label"],
            (r.get("throughput") or {}).get("tokens_per_s"),
            (r.get("throughput") or {}).get("generated_tokens_per_s"),
        )
        for r in runs
    ]
    rows = [(label, a or 0.0, b or 0.0) for label, a, b in rows if a or b]
    if not rows:
        return None
    fig, ax = _figure(height=max(1.6, 0.55 * len(rows) + 1.0))
    ys = range(len(rows))
    ax.barh([y - 0.2 for y in ys], [r[1] for r in rows], height=0.4, label="tokens/s (step)")
    ax.barh([y + 0.2 for y in ys], [r[2] for r in rows], height=0.4, label="generated tokens/s")
    ax.set_yticks(list(ys), [r[0] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens per second")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return _to_svg(fig, title)
