"""Static leaderboard pages: ``index.html`` (every recipe) and ``<recipe>.html`` (one recipe).

Each page is one self-contained HTML file (inline CSS and SVG plots, no scripts,
nothing fetched). Tables carry ids the browser test reads:

- ``table#latest-<recipe>``: newest run per (config, hardware, backend), side by side —
  the Ray nodes its pools used ("–" for results that do not say; "2 (simulated)" where the
  harness simulated them on one machine, the actor's placement as the cell's tooltip),
  ``trainer.mode`` as the run reported it ran (``ran.mode``: sync or async; "–" for results that do
  not say), held-out accuracy (the score, greedy), its gain, avg@k and pass@k of the sampled
  evaluation (``rollout.val_n = k > 1``; "–" for runs without), check verdict,
  throughput (generation and training tokens/s in its tooltip), MFU, s/step, date and
  commit (one cell). A run with overrides shows them under its config
  (``div.overrides``); the tables fit a 1280-pixel page without a sideways scroll;
- ``table#history-<recipe>`` (recipe pages): every run, newest first;
- ``figure.plot`` holds one inline ``<svg class="plot">``.

With bench results (:mod:`verity_harness.leaderboard.bench`) there is also ``bench.html``,
linked from the index (``a#bench-link``); with nightly nights (:mod:`verity_harness.leaderboard.trend`),
``trend.html`` (``a#trend-link``).
"""

from __future__ import annotations

import html
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verity_harness.leaderboard.bench import bench_body
from verity_harness.leaderboard.collect import by_recipe, latest_per_key, sort_time
from verity_harness.leaderboard.plots import curves_svg, throughput_svg
from verity_harness.leaderboard.trend import trend_body
from verity_harness.machine import device_text

STYLE = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2rem auto;max-width:1200px;color:#1f2328;padding:0 1rem}
h1{font-size:1.6rem;margin-bottom:.2rem} h2{font-size:1.25rem;margin-top:2rem;border-bottom:1px solid #d0d7de}
p.meta{color:#59636e;margin-top:0}
.scroll{overflow-x:auto} table{border-collapse:collapse;width:100%;font-size:.72rem;margin:.6rem 0}
th,td{border:1px solid #d0d7de;padding:.2rem .3rem;text-align:right}
td{white-space:nowrap} th{white-space:normal;vertical-align:bottom}
td.text{white-space:normal;overflow-wrap:anywhere;max-width:11rem}
div.overrides{font-size:.9em;color:#9a6700;white-space:normal;overflow-wrap:anywhere}
span.commit{display:block;color:#59636e}
caption{text-align:left;color:#59636e;padding-bottom:.2rem}
th{background:#f6f8fa} td.text,th.text{text-align:left}
td.pass{color:#1a7f37;font-weight:600} td.fail{color:#cf222e;font-weight:600} td.none{color:#59636e}
.plots{display:flex;flex-wrap:wrap;gap:1rem} figure.plot{margin:0;flex:1 1 480px;max-width:640px}
figure.plot svg{width:100%;height:auto} figcaption{font-size:.8rem;color:#59636e}
figure.plot.trend{flex:0 0 330px;max-width:330px} figure.plot.trend svg{width:320px;height:120px}
figure.plot.trend figcaption{overflow-wrap:anywhere}
code{font-size:.85em}
"""

LATEST_COLUMNS = (
    ("config", "config", "config"),
    ("hardware", "hardware", "hardware"),
    ("rollout", "backend", "text"),
    ("train engine", "train_engine", "text"),
    ("mode", "ran:mode", "text"),
    ("nodes", "nodes", "nodes"),
    ("held-out acc.", "score:accuracy_after", "pct"),
    ("gain", "score:accuracy_gain", "pts"),
    ("avg@k", "score:avg_at_k_after", "pct_k"),
    ("pass@k", "score:pass_at_k_after", "pct_k"),
    ("reward (last 10)", "score:reward/mean_last10", "num3"),
    ("check", "passed", "verdict"),
    ("tokens/s", "tp:tokens_per_s", "tokens"),
    ("MFU", "tp:mfu", "mfu"),
    ("s/step", "tp:step_seconds", "num2"),
    ("peak mem. GiB", "tp:max_memory_gb", "num2"),
    ("date, commit", "date", "date"),
)


def _value(run: Mapping[str, Any], key: str) -> Any:
    if key.startswith("score:"):
        return (run.get("scores") or {}).get(key[6:])
    if key.startswith("tp:"):
        return (run.get("throughput") or {}).get(key[3:])
    if key.startswith("ran:"):  # what the run reported running (trainer.mode: ran.mode), not its config
        return (run.get("ran") or {}).get(key[4:])
    return run.get(key)


def _cell(value: Any, kind: str, run: Mapping[str, Any]) -> str:
    """One ``<td>``: the formatted value, with a class for text/verdict colouring."""
    if kind == "config":
        overrides = [str(o) for o in run.get("overrides") or ()]
        extra = ""
        if overrides:
            shown = html.escape(" ".join(overrides))
            extra = f'<div class="overrides" title="run with overrides: {shown}">{shown}</div>'
        return f'<td class="text">{html.escape(str(value))}{extra}</td>'
    if kind == "date":
        commit = run.get("git_commit")
        code = f'<span class="commit"><code>{html.escape(str(commit)[:10])}</code></span>' if commit else ""
        return f'<td class="text">{html.escape(str(value or "–"))}{code}</td>'
    if kind == "tokens" and value is not None:
        t = run.get("throughput") or {}
        parts = [
            f"{name} {float(t[key]):,.0f}"
            for name, key in (("generation", "generated_tokens_per_s"), ("training", "train_tokens_per_s"))
            if isinstance(t.get(key), int | float)
        ]
        title = f' title="tokens/s: {html.escape(", ".join(parts), quote=True)}"' if parts else ""
        return f"<td{title}>{html.escape(f'{float(value):,.0f}')}</td>"
    if kind == "hardware":
        device = html.escape(device_text(run), quote=True)
        return f'<td class="text" title="{device}">{html.escape(str(value))}</td>'
    if kind == "nodes" and value is not None:
        text = f"{int(value)} (simulated)" if run.get("simulated_nodes") else str(int(value))
        placement = (run.get("ran") or {}).get("placement.actor")
        title = f' title="actor: {html.escape(str(placement), quote=True)}"' if placement else ""
        return f"<td{title}>{html.escape(text)}</td>"
    if kind == "verdict":
        text, cls = {True: ("pass", "pass"), False: ("fail", "fail")}.get(value, ("unchecked", "none"))
        return f'<td class="{cls}">{text}</td>'
    if value is None or value == "":
        return '<td class="none">–</td>' if kind != "text" else '<td class="text none">–</td>'
    if kind == "text":
        return f'<td class="text">{html.escape(str(value))}</td>'
    if kind == "pct_k":  # a sampled-evaluation score, with the k it was measured at
        k = (run.get("scores") or {}).get("val_k")
        suffix = f" (k={int(k)})" if isinstance(k, int | float) else ""
        return f"<td>{html.escape(f'{float(value):.1%}{suffix}')}</td>"
    if kind == "commit":
        return f'<td class="text"><code>{html.escape(str(value)[:10])}</code></td>'
    formats = {
        "pct": lambda v: f"{v:.1%}",
        "pts": lambda v: f"{v * 100:+.1f} pts",
        "int": lambda v: f"{v:,.0f}",
        "tokens": lambda v: f"{v:,.0f}",
        "num2": lambda v: f"{v:.2f}",
        "num3": lambda v: f"{v:.3f}",
        "mfu": lambda v: f"{v:.2%}",
    }
    return f"<td>{html.escape(formats[kind](float(value)))}</td>"


def runs_table(runs: Sequence[Mapping[str, Any]], table_id: str, caption: str) -> str:
    """A table of ``runs`` with :data:`LATEST_COLUMNS`; one ``tr.run`` per run."""
    head = "".join(
        f'<th class="{"text" if kind in ("text", "config", "date", "hardware") else ""}">{html.escape(title)}</th>'
        for title, _, kind in LATEST_COLUMNS
    )
    body = "".join(
        '<tr class="run">'
        + "".join(_cell(_value(r, key), kind, r) for _, key, kind in LATEST_COLUMNS)
        + "</tr>"
        for r in runs
    )
    return (
        f'<div class="scroll"><table id="{html.escape(table_id)}"><caption>{html.escape(caption)}</caption>'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"
    )


def _figure(svg: str | None, caption: str) -> str:
    if svg is None:
        return ""
    return f'<figure class="plot">{svg}<figcaption>{html.escape(caption)}</figcaption></figure>'


def recipe_plots(recipe: str, latest: Sequence[Mapping[str, Any]]) -> str:
    """Held-out accuracy and training reward curves, and throughput bars, of the latest runs."""
    figures = [
        _figure(
            curves_svg(latest, "val/acc", f"{recipe}: held-out accuracy (greedy)", unit_interval=True),
            "held-out accuracy after each evaluation (step 0 = before training)",
        ),
        _figure(
            curves_svg(latest, "val/avg_at_k", f"{recipe}: held-out avg@k (sampled)", unit_interval=True),
            "mean correctness of k sampled responses per held-out prompt, after each evaluation",
        ),
        _figure(
            curves_svg(latest, "reward/mean", f"{recipe}: training reward"),
            "mean sequence reward of each RL step's samples",
        ),
        _figure(
            throughput_svg(latest, f"{recipe}: throughput"),
            "tokens/s over a whole step and generated tokens/s of the generate stage",
        ),
    ]
    return '<div class="plots">' + "".join(f for f in figures if f) + "</div>"


DEFAULT_SOURCES = "the result files in <code>leaderboards/results</code>"


def _page(title: str, body: str, generated: str, sources: str = DEFAULT_SOURCES) -> str:
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"
        f'{body}<p class="meta">Generated {html.escape(generated)} by <code>verity-harness leaderboard</code> '
        f"from {sources}.</p>"
        "</body></html>\n"
    )


def recipe_section(recipe: str, runs: Sequence[Mapping[str, Any]], link: bool) -> str:
    latest = latest_per_key(runs)
    title = f'<a href="{html.escape(recipe)}.html">{html.escape(recipe)}</a>' if link else html.escape(recipe)
    return (
        f'<section id="recipe-{html.escape(recipe)}"><h2>{title}</h2>'
        + runs_table(latest, f"latest-{recipe}", "latest run per config, hardware and rollout backend")
        + recipe_plots(recipe, latest)
        + "</section>"
    )


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def index_page(
    runs: Sequence[Mapping[str, Any]],
    generated: str,
    sources: str = DEFAULT_SOURCES,
    bench_link: bool = False,
    trend_link: bool = False,
) -> str:
    """The overview: one section per recipe with its latest runs and plots.

    ``bench_link``: a link to ``bench.html``; ``trend_link``: a link to ``trend.html``.
    """
    grouped = by_recipe(runs)
    intro = (
        "<h1>verity leaderboards</h1>"
        f'<p class="meta">{_count(len(runs), "run")} of {_count(len(grouped), "recipe")}. Held-out accuracy is greedy '
        "accuracy on the recipe's validation set after training; the check compares a run with the "
        "recipe's expected file for its hardware and backend. avg@k and pass@k score k sampled responses "
        "per held-out prompt (the mean correctness of one sample, and the share of prompts with a correct "
        "one among the k), for recipes that evaluate that way. MFU is shown where the device's peak "
        "FLOP/s is known.</p>"
    )
    if bench_link:
        intro += (
            '<p><a id="bench-link" href="bench.html">Hardware bench</a>: the actor update\'s MFU and '
            "generation tokens/s of a Qwen2.5-0.5B-shaped model on accelerators, verity beside plain "
            "PyTorch and HF <code>generate</code>.</p>"
        )
    if trend_link:
        intro += (
            '<p><a id="trend-link" href="trend.html">Nightly trend</a>: each figure the nightly judges, '
            "over nights, with its accepted band and the regressions marked.</p>"
        )
    sections = "".join(recipe_section(name, rs, link=True) for name, rs in grouped.items())
    if not grouped:
        sections = '<p id="empty">No runs yet: run <code>verity-harness run RECIPE</code>.</p>'
    return _page("verity leaderboards", intro + sections, generated, sources)


def recipe_page(
    recipe: str, runs: Sequence[Mapping[str, Any]], generated: str, sources: str = DEFAULT_SOURCES
) -> str:
    """One recipe: latest runs side by side, plots, and the full history."""
    history = sorted(runs, key=sort_time, reverse=True)
    body = (
        f'<p><a href="index.html">all recipes</a></p><h1>{html.escape(recipe)}</h1>'
        + recipe_section(recipe, runs, link=False)
        + "<h2>history</h2>"
        + runs_table(history, f"history-{recipe}", "every run, newest first")
    )
    return _page(f"verity leaderboard: {recipe}", body, generated, sources)


def write_pages(
    runs: Sequence[Mapping[str, Any]],
    out_dir: Path,
    generated: str,
    sources: str = DEFAULT_SOURCES,
    bench: Sequence[Mapping[str, Any]] = (),
    bench_sources: str = "",
    nights: Sequence[Mapping[str, Any]] = (),
    nights_sources: str = "",
) -> list[Path]:
    """Write ``index.html``, one page per recipe, with ``bench`` rows ``bench.html`` and with ``nights`` ``trend.html``.

    ``sources``, ``bench_sources``, ``nights_sources``: the footers' words for where the runs came
    from (HTML); ``nights``: :func:`verity_harness.leaderboard.trend.load_nights`'s.
    Returns the paths written, the index first.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "index.html"]
    index = index_page(runs, generated, sources, bench_link=bool(bench), trend_link=bool(nights))
    written[0].write_text(index, encoding="utf-8")
    for recipe, recipe_runs in by_recipe(runs).items():
        path = out_dir / f"{recipe}.html"
        path.write_text(recipe_page(recipe, recipe_runs, generated, sources), encoding="utf-8")
        written.append(path)
    if bench:
        path = out_dir / "bench.html"
        path.write_text(
            _page("verity hardware bench", bench_body(bench), generated, bench_sources), encoding="utf-8"
        )
        written.append(path)
    if nights:
        path = out_dir / "trend.html"
        page = _page("verity nightly trend", trend_body(nights), generated, nights_sources)
        path.write_text(page, encoding="utf-8")
        written.append(path)
    return written
