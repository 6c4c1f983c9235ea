"""Figures that travel between machine classes: which ones, how far they move, and the nearest class.

A night on a machine class with no accepted baseline (``ci/nightly_baselines.py``) is judged
against the nearest accepted class (:func:`nearest_class`) with a wider allowance: the gate's
floor grows by how far each figure was measured to move between classes (``ci/nightly_gates.py``).

**Which figures travel** (:func:`figure_kind`):

- ``same-run ratio``: every ``bench.<ratio>``. verity and its yardstick (plain PyTorch, HF
  ``generate``, TRL's ``GRPOTrainer``, ``load_state_dict``) run in one process, alternating
  round by round, so most of a machine's speed cancels;
- ``absolute``: ``<row>.tokens_per_s_vs_plain_torch``, the row's wall-clock tokens/s over a
  yardstick measured minutes later; it is information only on any class, never judged across;
- ``accuracy``: ``<row>.accuracy_gain`` (accuracy after RL minus before), a fraction of the
  held-out set, which moves with the CPU's floating-point kernels and the warm-start build.

**How far they move** (:func:`measure`): the committed nights (``leaderboards/nightly/*.json``)
grouped by machine class, the class a night recorded or, for a night from before nights recorded
it, the class its report names (:data:`REPORT_CLASSES`; nights whose report names no instruction
set are left out and listed). Per figure and class, the median over the class's nights; a
figure's **move** is the largest gap between two classes' medians: relative
(``max/min - 1``) for a ratio, absolute for a gain. A figure measured on fewer than two classes
(or on fewer than :data:`MIN_NIGHTS` nights of each) has no move and is not judged across classes.

    python -m ci.nightly_cross_class            # print the measurement
    python -m ci.nightly_cross_class --write    # and write it into ci/cross_class.json

The nightly reads ``ci/cross_class.json``; the measurement of 2026-12-06 is in
``ci/reports/2026-12-06-cross-class.md``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_NIGHTS_DIR = ROOT / "leaderboards" / "nightly"
DEFAULT_CROSS_CLASS = ROOT / "ci" / "cross_class.json"
REPORTS_DIR = ROOT / "ci" / "reports"
MIN_NIGHTS = 2  # nights of a class a figure's median needs before it counts in the move

#: ``/proc/cpuinfo`` matrix flags from the widest down, as ``verity.hardware.cpu_peak.MATMUL_ISA_FLAGS``
#: (a unit test keeps the two equal); a CPU class's ISA is one of these or ``none``.
ISA_LADDER = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")
#: the instruction-set family of each flag: AMX tiles, AVX-512, AVX2
ISA_FAMILY = {"amx_bf16": "amx", "avx512_bf16": "avx512", "avx512f": "avx512", "avx2": "avx2"}

#: The class of each committed night from before nights recorded their machine, as its report
#: names it: report file -> (class, the words of the report that name it). Reports that name an
#: AMD EPYC VM without its instruction set (2026-11-22, 2026-11-24) are not listed: those nights
#: are left out of the measurement.
REPORT_CLASSES = {
    "2026-11-25-nightly.md": ("cpu-intel-xeon/amx_bf16", "Intel Xeon VM (AVX-512, AMX)"),
    "2026-11-25-nightly-compute-bound.md": ("cpu-intel-xeon/amx_bf16", "Intel Xeon VM (AVX-512, AMX)"),
    "2026-11-26-nightly.md": ("cpu-intel-xeon/amx_bf16", "2-core Intel Xeon VM"),
    "2026-11-26-nightly-2.md": ("cpu-intel-xeon/amx_bf16", "2-core Intel Xeon VM"),
    "2026-11-26-nightly-3.md": ("cpu-intel-xeon/amx_bf16", "2-core Intel Xeon VM"),
    "2026-11-26-nightly-4.md": ("cpu-intel-xeon/amx_bf16", "2-core Intel Xeon VM"),
    "2026-11-26-nightly-5.md": ("cpu-intel-xeon/amx_bf16", "2-core Intel Xeon VM"),
    "2026-11-26-nightly-6.md": ("cpu-intel-xeon/amx_bf16", "2-core Intel Xeon VM"),
    "2026-11-26-nightly-7.md": ("cpu-amd-epyc/avx512_bf16", "AMD EPYC (AVX-512, avx512_bf16)"),
    "2026-11-26-nightly-8.md": ("cpu-amd-epyc/avx512_bf16", "AMD EPYC (AVX-512, avx512_bf16, no AMX)"),
}

ABOUT = (
    "How far each nightly figure moved between machine classes over the committed nights "
    "(ci/nightly_cross_class.py); a night on a class without a baseline is judged against the "
    "nearest accepted class with its floor raised by the figure's move (ci/nightly_gates.py)."
)


def figure_kind(metric: str) -> str:
    """``"same-run ratio"`` (``bench.*``), ``"absolute"`` (a row's tokens/s) or ``"accuracy"`` (a row's gain)."""
    if metric.startswith("bench."):
        return "same-run ratio"
    if metric.endswith(".accuracy_gain"):
        return "accuracy"
    return "absolute"


def night_class(night: Mapping[str, Any]) -> str | None:
    """The machine class of a committed night: recorded, else named by its report; None when neither."""
    recorded = night.get("machine_class")
    if recorded and recorded not in ("unrecorded", "unknown"):
        return str(recorded)
    named = REPORT_CLASSES.get(Path(str(night.get("source") or "")).name)
    return named[0] if named else None


def load_nights(nights_dir: Path = DEFAULT_NIGHTS_DIR) -> dict[str, dict[str, Any]]:
    """Every committed night in ``nights_dir`` by file name (only ``kind: verity-nightly-night`` files)."""
    nights = {}
    for path in sorted(nights_dir.glob("*.json")):
        doc = json.loads(path.read_text())
        if doc.get("kind") == "verity-nightly-night":
            nights[path.name] = doc
    return nights


def measure(nights: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The cross-class measurement of ``nights`` (file name -> night): per figure its kind, each
    class's median and night count, and its move; plus which nights counted and which were left out.

    Planted nights and nights with no known class are left out; the absolute figures are listed
    with their class medians but get no move (they are never judged across classes).
    """
    values: dict[str, dict[str, list[float]]] = {}
    used: dict[str, list[str]] = {}
    left_out: dict[str, str] = {}
    for name, night in nights.items():
        klass = night_class(night)
        if night.get("planted"):
            left_out[name] = "planted"
            continue
        if klass is None:
            left_out[name] = f"class not recorded nor named by its report ({night.get('source')})"
            continue
        used.setdefault(klass, []).append(name)
        for metric, figure in (night.get("figures") or {}).items():
            value = figure.get("value") if isinstance(figure, Mapping) else None
            if metric.startswith("expected/") or not isinstance(value, int | float):
                continue
            values.setdefault(metric, {}).setdefault(klass, []).append(float(value))
    figures = {}
    for metric, by_class in sorted(values.items()):
        kind = figure_kind(metric)
        classes = {
            k: {"median": round(statistics.median(v), 4), "nights": len(v)}
            for k, v in sorted(by_class.items())
        }
        medians = [c["median"] for c in classes.values() if c["nights"] >= MIN_NIGHTS]
        move = None
        if kind != "absolute" and len(medians) >= 2:
            move = (
                max(medians) / min(medians) - 1 if kind == "same-run ratio" else max(medians) - min(medians)
            )
        figures[metric] = {"kind": kind, "move": None if move is None else round(move, 4), "classes": classes}
    return {
        "nights": {k: sorted(v) for k, v in sorted(used.items())},
        "left_out": left_out,
        "figures": figures,
    }


def load_moves(path: Path = DEFAULT_CROSS_CLASS) -> dict[str, float]:
    """``{metric: move}`` from a cross-class file (figures without a move left out); ``{}`` when there is none."""
    if not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    figures = doc.get("figures") if isinstance(doc, dict) else None
    if not isinstance(figures, dict):
        raise ValueError(f"{path}: expected a cross-class file with a 'figures' object")
    return {m: float(f["move"]) for m, f in figures.items() if f.get("move") is not None}


def _split(klass: str) -> tuple[str, str]:
    hardware, _, isa = klass.partition("/")
    return hardware, isa or "none"


def _rung(isa: str) -> int:
    return ISA_LADDER.index(isa) if isa in ISA_LADDER else len(ISA_LADDER)


def nearest_class(klass: str, accepted: Iterable[str]) -> tuple[str | None, str]:
    """The accepted class a night of ``klass`` is judged against, and one clause saying why.

    CPU classes only (the moves were measured on CPUs): same instruction-set family first
    (:data:`ISA_FAMILY`), then the nearest rung of :data:`ISA_LADDER`, then the same CPU maker
    (``cpu-amd-*``, ``cpu-intel-*``), then name order. ``(None, why)`` when there is none.
    """
    hardware, isa = _split(klass)
    if not hardware.startswith("cpu-"):
        return None, f"{klass} is not a CPU class and the cross-class moves were measured on CPUs only"
    candidates = [c for c in accepted if c != klass and _split(c)[0].startswith("cpu-")]
    if not candidates:
        return None, "no CPU class has an accepted baseline"
    maker = hardware.split("-")[1] if "-" in hardware else hardware

    def key(c: str) -> tuple[bool, int, bool, str]:
        h, i = _split(c)
        same_family = isa in ISA_FAMILY and ISA_FAMILY.get(i) == ISA_FAMILY[isa]
        return (not same_family, abs(_rung(i) - _rung(isa)), h.split("-")[1:2] != [maker], c)

    best = min(candidates, key=key)
    family, rungs, other_maker, _ = key(best)
    why = (
        "the same instruction-set family"
        if not family
        else f"{rungs} rung(s) away on the instruction-set ladder"
    )
    return best, why + (", another CPU maker" if other_maker else ", the same CPU maker")


def cross_class_document(measurement: Mapping[str, Any], nights_dir: Path) -> dict[str, Any]:
    """The ``ci/cross_class.json`` document of a measurement: about, when, how, and the figures."""
    return {
        "about": ABOUT,
        "measured": {
            "date": dt.date.today().isoformat(),
            "command": "python -m ci.nightly_cross_class --write",
            "nights_dir": str(
                nights_dir.relative_to(ROOT) if nights_dir.is_relative_to(ROOT) else nights_dir
            ),
            "nights": measurement["nights"],
            "left_out": measurement["left_out"],
        },
        "figures": measurement["figures"],
    }


def _table(measurement: Mapping[str, Any]) -> list[str]:
    classes = list(measurement["nights"])
    lines = [
        "| figure | kind | " + " | ".join(f"{c} (nights)" for c in classes) + " | move |",
        "|---|---|" + "---|" * len(classes) + "---|",
    ]
    for metric, f in measurement["figures"].items():
        cells = [
            f"{f['classes'][c]['median']:.4g} ({f['classes'][c]['nights']})" if c in f["classes"] else "-"
            for c in classes
        ]
        move = (
            "-"
            if f["move"] is None
            else (f"{f['move']:.1%}" if f["kind"] != "accuracy" else f"{f['move']:.3f}")
        )
        lines.append(f"| {metric} | {f['kind']} | " + " | ".join(cells) + f" | {move} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """Print the cross-class measurement of the committed nights; ``--write`` stores it for the nightly."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nights-dir", type=Path, default=DEFAULT_NIGHTS_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_CROSS_CLASS)
    parser.add_argument("--write", action="store_true", help="write the measurement into --out")
    args = parser.parse_args(argv)
    nights = load_nights(args.nights_dir)
    if not nights:
        print(f"nightly_cross_class: no night files in {args.nights_dir}", file=sys.stderr)
        return 2
    measurement = measure(nights)
    print("\n".join(_table(measurement)))
    for name, why in measurement["left_out"].items():
        print(f"left out {name}: {why}")
    if args.write:
        doc = cross_class_document(measurement, args.nights_dir.resolve())
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"nightly_cross_class: wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
