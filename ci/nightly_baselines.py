"""The nightly's accepted baselines, one per machine class, side by side in ``ci/baseline.json``.

A ratio measured side by side cancels most of a machine's speed but not all of it (bf16
matmuls, vLLM's CPU kernels and the decode loop each lean on different instructions), so a
night is compared only with a baseline accepted on its own **machine class**:
``<hardware label>/<matrix instruction set>`` as ``verity diagnose`` and the harness name them
(``cpu-intel-xeon/amx_bf16``, ``cpu-amd-epyc/avx512_bf16``; ``h200/none`` on a GPU). A night on
a class with no baseline is judged against the nearest accepted CPU class with each figure's
floor raised by its measured cross-class move (``ci/nightly_cross_class.py``), or compares
nothing and says why; either way it writes ``proposed-baseline.json`` beside its report (the
baseline file with tonight's class added), which
``python -m ci.nightly --accept-report <out>/report.json`` makes the accepted one.

``ci/baseline.json``::

    {"about": "...", "rule": "<ci/nightly_gates.RULE>",
     "classes": {"cpu-intel-xeon/amx_bf16": {
         "accepted": {"date", "commit", "machine"},
         "figures": {"bench.train_vs_plain_torch": {"value": 0.98, "rounds": [...], "spread": 0.01},
                     "grpo.accuracy_gain": {"value": 0.44, "allowed_drop": 0.06,
                                            "seed_spread": 0.01, "accuracy_before": 0.534}, ...}}}}

An accuracy figure's ``accuracy_before`` is the accepted row's held-out accuracy before RL: it
names the warm-start build, and the gate allows the smaller seed-spread drop only on that build.

A speed figure's ``rounds``/``spread`` are absent for a baseline accepted before nights kept
their rounds (the Intel class's, 2026-11-25); its gate then uses tonight's spread alone.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ci.nightly_gates import RULE, Figure, tonight_figures

ABOUT = (
    "Accepted figures of the nightly (ci/nightly.py), one entry per machine class "
    "(<hardware>/<matrix instruction set>); ratios only. Written by python -m ci.nightly --accept "
    "or --accept-report; the gate rule is ci/nightly_gates.py's."
)


def machine_class(machine: Mapping[str, Any] | None) -> str:
    """``"<hardware>/<cpu_isa>"`` of a nightly machine record (``cpu_isa`` None -> ``none``); ``"unknown"`` for None."""
    if not machine:
        return "unknown"
    return f"{machine.get('hardware') or 'unknown'}/{machine.get('cpu_isa') or 'none'}"


def load_baselines(path: Path) -> dict[str, Any]:
    """The baseline file as ``{"about", "rule", "classes": {...}}``; an empty one when it does not exist.

    Raises ValueError (one sentence naming the file) for a file that is not this layout.
    """
    if not path.is_file():
        return {"about": ABOUT, "rule": RULE, "classes": {}}
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("classes"), dict):
        raise ValueError(
            f"{path}: expected a baseline file with a 'classes' object (one entry per machine class), "
            f"got keys {sorted(doc) if isinstance(doc, dict) else type(doc).__name__}"
        )
    return doc


def class_baseline(baselines: Mapping[str, Any], klass: str) -> dict[str, Any] | None:
    """The accepted entry ``{"accepted", "figures"}`` of a machine class, or None when it has none."""
    return (baselines.get("classes") or {}).get(klass)


def figure_spec(figure: Figure) -> dict[str, Any]:
    """What a baseline keeps of one figure: value, and rounds + spread (speed) or allowed drop, seed
    spread and accuracy before RL (accuracy; each when known)."""
    spec: dict[str, Any] = {"value": round(float(figure.value), 4)} if figure.value is not None else {}
    if figure.kind == "speed" and figure.rounds:
        spec["rounds"] = [round(float(r), 4) for r in figure.rounds]
        spec["spread"] = round(float(figure.spread or 0.0), 4)
    if figure.kind == "accuracy":
        for key in ("allowed_drop", "seed_spread", "accuracy_before"):
            if getattr(figure, key) is not None:
                spec[key] = float(getattr(figure, key))
    return spec


def with_accepted_night(
    baselines: Mapping[str, Any],
    figures: Mapping[str, Figure],
    machine: Mapping[str, Any] | None,
    commit: str | None,
) -> dict[str, Any]:
    """``baselines`` with the night's machine class set to its figures; every other class untouched.

    Figures the night did not measure (a row left out with ``--recipes``/``--configs``, the bench
    skipped) keep the class's accepted value, so accepting part of a night drops nothing.
    """
    klass = machine_class(machine)
    classes = {name: dict(entry) for name, entry in (baselines.get("classes") or {}).items()}
    old = dict((classes.get(klass) or {}).get("figures") or {})
    for metric, figure in figures.items():
        if figure.value is not None:
            old[metric] = figure_spec(figure)
    accepted: dict[str, Any] = {"date": dt.date.today().isoformat(), "commit": commit}
    if machine is not None:
        accepted["machine"] = dict(machine)
    classes[klass] = {"accepted": accepted, "figures": dict(sorted(old.items()))}
    return {"about": ABOUT, "rule": RULE, "classes": dict(sorted(classes.items()))}


def report_figures(report: Mapping[str, Any]) -> dict[str, Figure]:
    """A night's figures from its ``report.json``: its ``figures`` entries (with their rounds), or
    for a report from before nights kept them, rebuilt from its recipes and bench. An accuracy
    figure from before nights kept its seed spread and accuracy before RL takes them from the
    row's result in the report."""
    rebuilt = tonight_figures(report.get("recipes") or {}, report.get("bench") or {})
    if "figures" not in report:
        return rebuilt
    figures = {}
    for metric, f in report["figures"].items():
        old = rebuilt.get(metric) or Figure(None)
        figures[metric] = Figure(
            f.get("value"),
            list(f.get("rounds") or []),
            f.get("kind", "speed"),
            f.get("allowed_drop"),
            f.get("seed_spread", old.seed_spread),
            f.get("accuracy_before", old.accuracy_before),
        )
    return figures


def night_commit(recipes: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The git commit the night's rows recorded (the first that has one)."""
    return next((r.get("git_commit") for r in recipes.values() if r.get("git_commit")), None)


def accept_report(report_file: Path, baseline_file: Path) -> int:
    """Write ``report_file``'s figures (a night's ``report.json``) as its machine class's baseline; 0, or 2 with a sentence.

    Refused when the night had a failing finding or ran planted (overrides or a slowdown).
    """
    if not report_file.is_file():
        print(
            f"nightly: --accept-report {report_file}: no such file (expected a night's report.json)",
            file=sys.stderr,
        )
        return 2
    report = json.loads(report_file.read_text())
    failed = [f["metric"] for f in report.get("findings", []) if not f.get("ok")]
    planted = list(report.get("overrides") or []) + list(report.get("planted_slowdown") or [])
    if failed or planted:
        why = f"it failed {', '.join(failed)}" if failed else f"it ran planted: {planted}"
        print(f"nightly: not accepting {report_file}: {why}", file=sys.stderr)
        return 2
    try:
        baselines = load_baselines(baseline_file)
    except ValueError as err:
        print(f"nightly: {err}", file=sys.stderr)
        return 2
    recipes = report.get("recipes") or {}
    commit = night_commit(recipes)
    new = with_accepted_night(baselines, report_figures(report), report.get("machine"), commit)
    baseline_file.write_text(json.dumps(new, indent=1) + "\n")
    klass = machine_class(report.get("machine"))
    print(f"nightly: wrote {klass}'s baseline into {baseline_file} from {report_file} (commit {commit})")
    return 0
