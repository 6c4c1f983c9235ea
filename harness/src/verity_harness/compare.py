"""``verity-harness compare RUN_A RUN_B``: two runs side by side.

A run is named by any of:

- a result file (``leaderboards/results/grpo/2026-11-22-cpu-hf.json``);
- a run directory holding ``harness_result.json`` (what ``verity-harness run`` leaves);
- an MLflow run id of the harness's store (``--tracking-uri``, default the store under
  ``outputs/harness``).

The table lists who ran what (recipe, config, hardware, backend, commit, date), every
score either run has, and the throughput figures, with B - A and B / A columns.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verity_harness.results import load_result
from verity_harness.tracking import find_run

IDENTITY_KEYS = (
    "recipe", "config", "hardware", "device_name", "cpu_isa", "backend", "git_commit", "date", "passed"
)
THROUGHPUT_KEYS = ("tokens_per_s", "generated_tokens_per_s", "train_tokens_per_s", "step_seconds", "mfu")


def load_run(ref: str, tracking_uri: str | None = None) -> dict[str, Any]:
    """A result dict for ``ref`` (see the module docstring); ValueError when nothing matches."""
    path = Path(ref)
    if path.is_file():
        return load_result(path)
    if path.is_dir() and (path / "harness_result.json").is_file():
        result = json.loads((path / "harness_result.json").read_text(encoding="utf-8"))
        result["source"] = str(path)
        return result
    if tracking_uri is not None:
        found = find_run(tracking_uri, ref)
        if found is not None:
            return found
    raise ValueError(
        f"run {ref!r}: not a result file, not a run directory with harness_result.json, "
        f"and not a run id in {tracking_uri or 'the MLflow store'}"
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "pass" if value else "fail"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _delta(a: Any, b: Any) -> tuple[str, str]:
    numbers = all(isinstance(v, int | float) and not isinstance(v, bool) for v in (a, b))
    if not numbers:
        return "", ""
    ratio = f"{b / a:.3f}" if a else ""
    return f"{b - a:+.4g}", ratio


def comparison_rows(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """(name, A, B, B - A, B / A) rows: identity, then scores, then throughput and stage seconds."""
    rows: list[tuple[str, str, str, str, str]] = []
    for key in IDENTITY_KEYS:
        va, vb = a.get(key), b.get(key)
        if key == "git_commit":
            va, vb = (str(v)[:10] if v else None for v in (va, vb))
        rows.append((key, _fmt(va), _fmt(vb), "", ""))
    sa, sb = a.get("scores") or {}, b.get("scores") or {}
    for key in sorted(set(sa) | set(sb)):
        rows.append((f"score {key}", _fmt(sa.get(key)), _fmt(sb.get(key)), *_delta(sa.get(key), sb.get(key))))
    ta, tb = a.get("throughput") or {}, b.get("throughput") or {}
    for key in THROUGHPUT_KEYS:
        rows.append(
            (f"throughput {key}", _fmt(ta.get(key)), _fmt(tb.get(key)), *_delta(ta.get(key), tb.get(key)))
        )
    stages_a, stages_b = ta.get("stage_seconds") or {}, tb.get("stage_seconds") or {}
    for stage in sorted(set(stages_a) | set(stages_b)):
        va, vb = stages_a.get(stage), stages_b.get(stage)
        rows.append((f"seconds {stage}", _fmt(va), _fmt(vb), *_delta(va, vb)))
    return rows


def format_comparison(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    """The side-by-side table as fixed-width text."""
    rows = comparison_rows(a, b)
    head = ("", "A", "B", "B - A", "B / A")
    widths = [max(len(r[i]) for r in [*rows, head]) for i in range(5)]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join([r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in range(1, 5)])

    out = [f"A: {a.get('source', '?')}", f"B: {b.get('source', '?')}", "", line(head)]
    out.append("-" * len(out[-1]))
    out += [line(r) for r in rows]
    return "\n".join(out)
