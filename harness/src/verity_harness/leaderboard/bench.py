"""The hardware bench page, ``bench.html``: ``ci/bench_gpu.py``'s results, verity beside its peers.

``ci/bench_gpu.py`` times the actor update (MFU) and generation (tokens/s) of a
Qwen2.5-0.5B-shaped model on one device, verity's engine beside a plain PyTorch loop and HF
``generate`` on the same work, and writes one JSON per run; the GPU sessions commit theirs,
with a ``provenance`` object (machine, date, commit, command), under ``leaderboards/bench/``
(:mod:`.benchmarks_page` reads the same files for ``docs/benchmarks.md``). This module finds those JSONs (any ``*.json`` under the folders given
whose shape is bench_gpu's: ``environment.device``, ``config.model``, ``sides``), turns each
side of each run into one row, and composes the page (:mod:`.pages` writes it):

- ``table#bench-update``: the newest run per (device, model, side, batch shape, micro-batch
  rows, SDPA kernel, the compiled loss head's kernels, precision) of the update sides: s/step (median), the number of timed
  steps, MFU against the datasheet peak and against the matmul rate measured in that run,
  training tokens/s, peak memory;
- ``table#bench-generate``: the same for the generation sides (generated tokens/s);
- ``table#bench-history``: every row, newest first, with its source file.

A failed side (no timed steps) or a run of one or two timed steps stands for its kind only
while no run of at least three exists.

A side that failed (out of memory, no kernel) is a row saying ``error``, its message in the
cell's title: a run's failure is shown, not dropped.
"""

from __future__ import annotations

import html
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MIN_STEPS = 3  # timed steps a run needs to stand for its kind in the "latest" tables
KEY_FIELDS = (
    "device",
    "model",
    "side",
    "rows",
    "prompt_len",
    "response_len",
    "micro_rows",
    "sdpa",
    "head_kernels",
    "bf16",
)


def _is_bench_result(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("environment"), dict)
        and "device" in data["environment"]
        and isinstance(data.get("config"), dict)
        and "model" in data["config"]
        and isinstance(data.get("sides"), dict)
    )


def bench_rows(data: Mapping[str, Any], source: str) -> list[dict[str, Any]]:
    """One row per side of one bench_gpu result ``data`` (read from ``source``, a path for the page)."""
    env, config = data["environment"], data["config"]
    rows = []
    for side, figures in data["sides"].items():
        figures = figures if isinstance(figures, dict) else {"error": f"not a side's figures: {figures!r}"}
        generate = side.startswith("generate")  # generation sides have their own batch options
        shape = (
            ("gen_rows", "gen_prompt_len", "gen_new_tokens")
            if generate
            else ("rows", "prompt_len", "response_len")
        )
        n_rows, prompt_len, response_len = (config.get(k) for k in shape)
        rows.append(
            {
                "device": env["device"],
                "torch": env.get("torch"),
                "date": env.get("date", ""),
                "model": config["model"],
                "side": side,
                "kind": "generate" if generate else "update",
                "rows": n_rows,
                "prompt_len": prompt_len,
                "response_len": response_len,
                "micro_rows": None if generate else config.get("micro_rows"),
                "sdpa": config.get("sdpa_backend", "auto"),
                "head_kernels": config.get("compiled_head_kernels"),  # absent: the run predates the option
                "bf16": config.get("bf16", True),
                "steps": len(figures.get("step_seconds") or []) or None,
                "median_seconds": figures.get("median_seconds"),
                "tokens_per_s": figures.get("tokens_per_s"),
                "mfu_vs_datasheet": figures.get("mfu_vs_datasheet"),
                "mfu_vs_measured_matmul": figures.get("mfu_vs_measured_matmul"),
                "max_memory_gib": figures.get("max_memory_gib"),
                "error": figures.get("error"),
                "source": source,
            }
        )
    return rows


def collect_bench_rows(folders: Iterable[Path]) -> list[dict[str, Any]]:
    """Every side of every bench_gpu JSON under ``folders`` (recursively); other JSON files are not bench results.

    A file that is not valid JSON is skipped with a warning naming it.
    """
    rows: list[dict[str, Any]] = []
    for folder in folders:
        folder = Path(folder)
        for path in sorted(folder.rglob("*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
                logger.warning("bench page: skipping %s: not readable JSON (%s)", path, err)
                continue
            if _is_bench_result(data):
                rows.extend(bench_rows(data, path.as_posix()))
    return rows


def latest_bench_rows(rows: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The newest row per :data:`KEY_FIELDS` that timed at least :data:`MIN_STEPS` steps (the newest
    of any when none did), ordered by device, model, side and micro-batch rows.

    A run of one or two timed steps (a profiling run's) stands for its kind only until a
    longer one exists; the history keeps every run.
    """

    def rank(row: Mapping[str, Any]) -> tuple[bool, str]:
        return (row.get("steps") or 0) >= MIN_STEPS, str(row["date"])

    def key_of(row: Mapping[str, Any]) -> tuple[str, ...]:
        # a run from before the head-kernel option ran that day's default: the same kind as ``auto``
        return tuple(
            str(row.get(f) or "auto") if f == "head_kernels" else str(row.get(f)) for f in KEY_FIELDS
        )

    latest: dict[tuple, Mapping[str, Any]] = {}
    for row in rows:
        key = key_of(row)
        if key not in latest or rank(row) > rank(latest[key]):
            latest[key] = row
    return sorted(latest.values(), key=key_of)


UPDATE_COLUMNS = (
    ("device", "device", "text"),
    ("model", "model", "text"),
    ("side", "side", "text"),
    ("rows x tokens", "shape", "text"),
    ("micro-batch rows", "micro_rows", "int"),
    ("SDPA", "sdpa", "text"),
    ("head kernels", "head_kernels", "text"),
    ("s/step (median)", "median_seconds", "num4"),
    ("steps", "steps", "int"),
    ("MFU (datasheet)", "mfu_vs_datasheet", "pct"),
    ("MFU (measured matmul)", "mfu_vs_measured_matmul", "pct"),
    ("tokens/s", "tokens_per_s", "int"),
    ("peak memory GiB", "max_memory_gib", "num1"),
    ("torch", "torch", "text"),
    ("date", "date", "date"),
)
GENERATE_COLUMNS = tuple(
    c
    for c in UPDATE_COLUMNS
    if c[1] not in ("micro_rows", "head_kernels", "mfu_vs_datasheet", "mfu_vs_measured_matmul")
)
HISTORY_COLUMNS = UPDATE_COLUMNS + (("source", "source", "code"),)


def _shape(row: Mapping[str, Any]) -> str:
    return f"{row.get('rows')} x ({row.get('prompt_len')} + {row.get('response_len')})"


def _cell(row: Mapping[str, Any], key: str, kind: str, first: bool) -> str:
    if row.get("error") and first:  # the first figure's cell says the side failed
        return f'<td class="fail" title="{html.escape(str(row["error"]), quote=True)}">error</td>'
    value = _shape(row) if key == "shape" else row.get(key)
    if value is None or value == "":
        return '<td class="none">–</td>'
    if kind in ("text", "date"):
        text = str(value)[:10] if kind == "date" else str(value)
        return f'<td class="text">{html.escape(text)}</td>'
    if kind == "code":
        return f'<td class="text"><code>{html.escape(str(value))}</code></td>'
    formats = {"int": "{:,.0f}", "num4": "{:.4f}", "num1": "{:.1f}", "pct": "{:.1%}"}
    return f"<td>{html.escape(formats[kind].format(float(value)))}</td>"


def bench_table(
    rows: Sequence[Mapping[str, Any]], columns: Sequence[tuple[str, str, str]], table_id: str, caption: str
) -> str:
    """A table of ``rows``; one ``tr.run`` per row. A failed side fills its figures with one ``error`` cell."""
    head = "".join(
        f'<th class="{"text" if kind in ("text", "date", "code") else ""}">{html.escape(title)}</th>'
        for title, _, kind in columns
    )
    first_figure = next(i for i, (_, key, _) in enumerate(columns) if key == "median_seconds")
    body = []
    for row in rows:
        cells = []
        for i, (_, key, kind) in enumerate(columns):
            if row.get("error") and i > first_figure and key not in ("torch", "date", "source"):
                cells.append('<td class="none">–</td>')
            else:
                cells.append(_cell(row, key, kind, first=i == first_figure))
        body.append('<tr class="run">' + "".join(cells) + "</tr>")
    return (
        f'<div class="scroll"><table id="{html.escape(table_id)}"><caption>{html.escape(caption)}</caption>'
        f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table></div>"
    )


INTRO = (
    "<h1>verity hardware bench</h1>"
    '<p class="meta"><code>ci/bench_gpu.py</code> on one device: a Qwen2.5-0.5B-shaped model, random init, '
    "full-length rows (no padding), bf16 autocast over float32 master weights. <code>update-verity*</code> "
    "sides are verity's FSDP2 engine taking a GRPO step (<code>-compiled</code>: decoder layers and loss head "
    "compiled; <code>-cudagraphs</code>: the layers' training passes replayed as CUDA graphs; <code>-fused</code>: "
    "stacked projections); <code>update-torch*</code> is a plain PyTorch loop on the same work; "
    "<code>generate-verity</code> is verity's HF rollout beside <code>generate-hf</code>, transformers' "
    "<code>generate</code>. s/step is the median of the timed steps after warm-up; MFU counts the model's "
    "FLOPs (forward + backward, causal attention) over the device's datasheet bf16 peak and over the matmul "
    "rate measured at the start of the run. Each row is the newest run of its kind that timed at least "
    f"{MIN_STEPS} steps; the history below keeps every run with its source file. "
    '<a href="index.html">Recipe leaderboards</a>.</p>'
)


def bench_body(rows: Sequence[Mapping[str, Any]]) -> str:
    """The page's body (HTML): the intro, the latest update and generation tables, the history."""
    latest = latest_bench_rows(rows)
    history = sorted(rows, key=lambda r: (str(r["date"]), str(r["source"]), str(r["side"])), reverse=True)
    return (
        INTRO
        + "<h2>actor update</h2>"
        + bench_table(
            [r for r in latest if r["kind"] == "update"],
            UPDATE_COLUMNS,
            "bench-update",
            "newest run per device, model, side, batch shape, micro-batch rows, SDPA kernel, head kernels, precision",
        )
        + "<h2>generation</h2>"
        + bench_table(
            [r for r in latest if r["kind"] == "generate"],
            GENERATE_COLUMNS,
            "bench-generate",
            "newest run per device, model, side and batch shape: generated tokens/s",
        )
        + "<h2>history</h2>"
        + bench_table(history, HISTORY_COLUMNS, "bench-history", "every side of every run, newest first")
    )
