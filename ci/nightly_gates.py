"""The nightly's gates: which figure regressed, judged against the noise measured with it.

A fixed threshold (a speed figure passing down to 0.7x its accepted value) lets a 25% slower
step land green; a tight one turns a shared machine's noise into false alarms. So each figure
carries its own noise and the gate is sized from it.

**Speed figures** (``bench.<ratio>``): every figure is the median of at least :data:`MIN_ROUNDS` rounds measured inside the night, and its spread is
the rounds' median absolute deviation (MAD). With ``rel = max(MAD / median tonight,
MAD / median of the accepted night's rounds)``:

    allowed drop = max(MAD_FACTOR x rel, floor)          (MAD_FACTOR = 3)
    higher is better: regression when  median < baseline x (1 - allowed drop)
    lower is better (bench.weight_sync_*): regression when median > baseline x (1 + allowed drop)

The floor is :data:`SIDE_BY_SIDE_FLOOR` (5%): the bench's rounds alternate verity and its peer
in one process (A B A B ...) so the machine's speed cancels. A speed figure with fewer than
:data:`MIN_ROUNDS` rounds fails: its spread is not measured.

**A row's tokens/s** (``<row>.tokens_per_s_vs_plain_torch``) is reported and trended as
**information only**, never in the verdict (:data:`INFO_ONLY_SUFFIXES`): it divides the row's
wall-clock tokens/s (one training run, minutes long) by the bench's plain-PyTorch tokens per
CPU second measured minutes apart, so it reads the load of two different moments as much as
the code. On unchanged code it read 0.82, 1.08, 0.87 and 1.52 over four nights of 2026-11-28
(``ci/reports/2026-11-28-nightly-gates.md``), and timing the yardstick in wall seconds would
not make the two run side by side. The update's speed is gated by ``bench.train_vs_plain_torch``,
which caught the planted 10% slowdown that this figure did not.

**Accuracy figures** (``<row>.accuracy_gain``): one run per night (one seed), so their noise is
the seed spread of the row's expected file. The accepted baseline keeps the row's
``accuracy_before`` (the held-out accuracy of the embedded warm-start, which identifies the
warm-start build: two machines built 0.534 and 0.516). Regression when
``gain < baseline - allowed drop``, with

    allowed drop = max(SEED_FACTOR x seed_spread, ACCURACY_FLOOR)    (SEED_FACTOR = 3, floor 0.02)

when tonight's ``accuracy_before`` equals the accepted one (``|diff| < 1e-9``: the same build)
and the expected file records the metric's ``seed_spread`` (max - min over seeds on one build,
e.g. ``grpo``'s 0.010); otherwise the expected file's ``accuracy_gain`` tolerance (e.g. ``grpo``'s
0.06, which covers two builds on two machines), with a note saying why. The tolerance and seed
spread are tonight's expected-file check's, else the ones stored with the baseline.

**Across machine classes** (a night on a class with no baseline, judged against the nearest
accepted class: ``ci/nightly_cross_class.py``), each figure's floor grows by its **move**, how
far it was measured to move between classes (``ci/cross_class.json``):

    speed:    allowed drop = max(MAD_FACTOR x rel, SIDE_BY_SIDE_FLOOR + move)       (move relative)
    accuracy: allowed drop = max(SEED_FACTOR x seed_spread, ACCURACY_FLOOR + move)  (move absolute)

The noise term is what tonight and the accepted night measured, as within a class; the move is a
systematic shift that one night's rounds or seeds cannot show, which is what the floor is for.
An accuracy gain is judged this way on its own class too when the warm-start build is not the
accepted one and the row has a measured move (the gain, not its end points: a build moves the
accuracy before RL). Without a seed spread the noise term is the expected file's tolerance. A
speed figure with no measured move is not judged across classes, and its note says so.

Every figure is a :class:`Finding`; ``report.json`` keeps, per figure, its value (the median),
rounds, spread (MAD), baseline, allowed drop, ok, the machine class it was measured in and the
class whose baseline judged it (``compared_with``, None for its own).

Two bench documents (``python -m ci.bench --out``) judged against each other, the first as accepted::

    python -m ci.nightly_gates accepted-bench.json tonight-bench.json   # exit 1 if a ratio regressed
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAD_FACTOR = 3.0
SIDE_BY_SIDE_FLOOR = 0.05
MIN_ROUNDS = 3
SEED_FACTOR = 3.0
ACCURACY_FLOOR = 0.02
SAME_BUILD_EPS = 1e-9  # accuracy_before values are exact eval fractions: equal means the same build
#: figures reported and trended but never in the verdict (module docstring)
INFO_ONLY_SUFFIXES = (".tokens_per_s_vs_plain_torch",)
ROW_BLOCKS = 5  # a row's measured steps are cut into this many consecutive blocks, one round each

RULE = (
    f"speed: regression when median < baseline x (1 - max({MAD_FACTOR:g} x MAD/median, floor)), "
    f"MAD/median the larger of tonight's and the accepted night's, floor {SIDE_BY_SIDE_FLOOR:.0%} for "
    f"bench ratios, >= {MIN_ROUNDS} rounds (mirrored for lower-is-better figures); a row's tokens/s vs "
    "plain torch is information only (its yardstick runs minutes apart, in CPU seconds); accuracy: "
    f"regression when gain < baseline - max({SEED_FACTOR:g} x seed_spread, {ACCURACY_FLOOR:g}) when "
    "tonight's accuracy_before equals the accepted one (same warm-start build) and the expected file "
    "records the metric's seed_spread, else baseline - the expected file's tolerance; across machine "
    "classes (and for a gain on another build) the floor grows by the figure's measured move "
    "(ci/cross_class.json)"
)


@dataclass
class Figure:
    """One figure measured tonight: its ``value`` (median of ``rounds``) and what its gate needs.

    ``kind``: ``"speed"`` or ``"accuracy"``; for an accuracy figure ``allowed_drop`` is the
    absolute tolerance from the expected file (None if the row had no such check),
    ``seed_spread`` the expected file's seed spread of the metric on one build (None: not
    recorded) and ``accuracy_before`` the row's held-out accuracy before RL (the warm-start
    build's identity; None: not reported).
    """

    value: float | None
    rounds: list[float] = field(default_factory=list)
    kind: str = "speed"
    allowed_drop: float | None = None
    seed_spread: float | None = None
    accuracy_before: float | None = None

    @property
    def spread(self) -> float | None:
        """The rounds' median absolute deviation (None for a speed figure without rounds, or accuracy)."""
        return mad(self.rounds) if self.kind == "speed" and self.rounds else None


@dataclass
class Finding:
    """One judged figure or check. ``allowed_drop`` is relative for speed figures, absolute for accuracy."""

    metric: str
    value: float | None
    baseline: float | None
    ratio: float | None
    threshold: str
    ok: bool
    note: str = ""
    rounds: list[float] = field(default_factory=list)
    spread: float | None = None
    allowed_drop: float | None = None
    machine_class: str | None = None
    compared_with: str | None = None


def mad(values: Sequence[float]) -> float:
    """Median absolute deviation from the median of ``values`` (same unit as the values); 0.0 for one value."""
    if not values:
        raise ValueError("mad: expected at least one value")
    centre = statistics.median(values)
    return statistics.median(abs(v - centre) for v in values)


def lower_is_better(metric: str) -> bool:
    """Whether a smaller value is the better one (the weight-sync ratio: verity's seconds over the peer's)."""
    return metric.startswith("bench.weight_sync")


def info_only(metric: str) -> bool:
    """Whether a figure is reported and trended but never fails the night (:data:`INFO_ONLY_SUFFIXES`)."""
    return metric.endswith(INFO_ONLY_SUFFIXES)


def relative_spread(rounds: Sequence[float]) -> float:
    """MAD / median of ``rounds`` (0.0 for none, or a median of 0)."""
    if not rounds:
        return 0.0
    centre = statistics.median(rounds)
    return mad(rounds) / abs(centre) if centre else 0.0


def allowed_speed_drop(
    metric: str, rounds: Sequence[float], baseline_rounds: Sequence[float] = (), move: float = 0.0
) -> float:
    """The relative drop a speed figure may show before it counts as a regression (see the module docstring).

    ``move``: the figure's measured move between machine classes, added to the floor when the
    baseline is another class's (0 within a class).
    """
    rel = max(relative_spread(rounds), relative_spread(baseline_rounds))
    return max(MAD_FACTOR * rel, SIDE_BY_SIDE_FLOOR + move)


def no_value_note(compared_with: str | None) -> str:
    """The note of a figure with no accepted value to compare with (its own class's, or ``compared_with``'s)."""
    if compared_with is None:
        return "no accepted value for this machine class yet"
    return f"not judged: {compared_with} has no accepted value for this figure"


def judge_speed(
    metric: str,
    figure: Figure,
    spec: Mapping[str, Any] | None,
    machine_class: str | None = None,
    compared_with: str | None = None,
    move: float | None = None,
) -> Finding:
    """``figure`` against the accepted ``spec = {"value", "rounds"?}`` of its machine class, or of
    ``compared_with`` (another class) with the floor raised by the figure's ``move``."""
    rounds = list(figure.rounds)
    base = Finding(
        metric, figure.value, None, None, "-", True, "", rounds, figure.spread, None, machine_class
    )
    base.compared_with = compared_with
    if spec is None:
        base.note = no_value_note(compared_with)
        return base
    accepted = float(spec["value"])
    base.baseline = accepted
    if compared_with is not None and not info_only(metric) and move is None:
        base.note = (
            f"not judged: no move between machine classes was measured for this figure, so "
            f"{compared_with}'s value is shown only"
        )
        return base
    if info_only(metric):
        base.ratio = figure.value / accepted if accepted and figure.value is not None else None
        base.threshold = "info"
        base.note = (
            "information only: the row's wall-clock tokens/s over a yardstick timed in CPU seconds "
            "minutes apart reads the load as much as the code"
        )
        return base
    if figure.value is None:
        base.ok, base.note = False, "not measured tonight"
        return base
    if len(rounds) < MIN_ROUNDS:
        base.ok = False
        base.note = f"{len(rounds)} round(s): the gate needs >= {MIN_ROUNDS} to measure the spread"
        return base
    if accepted == 0:
        base.note = "accepted value is 0: no ratio"
        return base
    allowed = allowed_speed_drop(metric, rounds, spec.get("rounds") or (), move or 0.0)
    base.ratio = figure.value / accepted
    base.allowed_drop = allowed
    if compared_with is not None:
        base.note = (
            f"judged against {compared_with}: floor {SIDE_BY_SIDE_FLOOR:.0%} + cross-class move {move:.1%}"
        )
    if lower_is_better(metric):
        base.threshold = f"<= {1 + allowed:.3f}"
        base.ok = base.ratio <= 1 + allowed
    else:
        base.threshold = f">= {1 - allowed:.3f}"
        base.ok = base.ratio >= 1 - allowed
    return base


def judge_accuracy(
    metric: str,
    figure: Figure,
    spec: Mapping[str, Any] | None,
    machine_class: str | None = None,
    compared_with: str | None = None,
    move: float | None = None,
) -> Finding:
    """An accuracy gain against the accepted one ``spec = {"value", "allowed_drop"?, "seed_spread"?,
    "accuracy_before"?}``: allowed to drop by ``max(3 x seed_spread, 0.02)`` on the accepted
    warm-start build; on another build or against another class (``compared_with``) by
    ``max(3 x seed_spread, 0.02 + move)`` when the row's ``move`` was measured; else by the
    expected file's tolerance (module docstring)."""
    rounds = [figure.value] if figure.value is not None else []
    tolerance = figure.allowed_drop if figure.allowed_drop is not None else (spec or {}).get("allowed_drop")
    base = Finding(metric, figure.value, None, None, "-", True, "", rounds, None, tolerance, machine_class)
    base.compared_with = compared_with
    if spec is None:
        base.note = no_value_note(compared_with)
        return base
    accepted = float(spec["value"])
    base.baseline = accepted
    if figure.value is None:
        base.ok, base.note = False, "not measured tonight"
        return base
    allowed, base.note = accuracy_allowed_drop(figure, spec, tolerance, compared_with, move)
    if allowed is None:
        base.ok = False
        return base
    base.allowed_drop = allowed
    base.ratio = figure.value / accepted if accepted else None
    base.threshold = f">= {accepted - allowed:.4g} (baseline - {allowed:g})"
    base.ok = figure.value >= accepted - allowed - 1e-12
    return base


def accuracy_allowed_drop(
    figure: Figure,
    spec: Mapping[str, Any],
    tolerance: float | None,
    compared_with: str | None = None,
    move: float | None = None,
) -> tuple[float | None, str]:
    """The absolute drop an accuracy gain may show and a note saying which rule gave it.

    ``max(SEED_FACTOR x seed_spread, ACCURACY_FLOOR)`` on the accepted warm-start build with a
    recorded seed spread; against another class (``compared_with``), or on another build when the
    row's cross-class ``move`` was measured, ``max(SEED_FACTOR x seed_spread (else the tolerance),
    ACCURACY_FLOOR + move)``; else the expected file's ``tolerance`` (None when there is none either).
    """
    spread = figure.seed_spread if figure.seed_spread is not None else spec.get("seed_spread")
    before, accepted_before = figure.accuracy_before, spec.get("accuracy_before")
    if compared_with is not None:
        return _across(f"judged against {compared_with} (no baseline of its own)", spread, tolerance, move)
    other_build = (
        before is not None
        and accepted_before is not None
        and abs(float(before) - float(accepted_before)) >= SAME_BUILD_EPS
    )
    if other_build and move is not None:
        reason = f"another warm-start build (accuracy before {before:g}, accepted {float(accepted_before):g})"
        return _across(reason, spread, tolerance, move)
    if before is None or accepted_before is None:
        why = (
            "the accepted night kept no accuracy_before"
            if accepted_before is None
            else "tonight reported none"
        )
        reason = f"warm-start build not comparable ({why})"
    elif abs(float(before) - float(accepted_before)) >= SAME_BUILD_EPS:
        reason = f"another warm-start build (accuracy before {before:g}, accepted {float(accepted_before):g})"
    elif spread is None:
        reason = "same warm-start build, but the expected file records no seed_spread for this metric"
    else:
        allowed = max(SEED_FACTOR * float(spread), ACCURACY_FLOOR)
        return (
            allowed,
            f"same warm-start build: max({SEED_FACTOR:g} x seed spread {float(spread):g}, {ACCURACY_FLOOR:g})",
        )
    if tolerance is None:
        return None, f"{reason}; no tolerance: the row's expected file has no check of this figure"
    return float(tolerance), f"{reason}: the expected file's tolerance"


def _across(
    reason: str, spread: float | None, tolerance: float | None, move: float | None
) -> tuple[float | None, str]:
    """The allowed drop of a gain judged across classes or builds (:func:`accuracy_allowed_drop`)."""
    if move is None:
        if tolerance is None:
            return None, f"{reason}; no cross-class move measured and no expected-file tolerance"
        return float(tolerance), f"{reason}; no cross-class move measured: the expected file's tolerance"
    if spread is not None:
        noise, noise_text = SEED_FACTOR * float(spread), f"{SEED_FACTOR:g} x seed spread {float(spread):g}"
    elif tolerance is not None:
        noise, noise_text = float(tolerance), f"the expected file's tolerance {float(tolerance):g}"
    else:
        noise, noise_text = 0.0, "no seed spread or tolerance"
    allowed = max(noise, ACCURACY_FLOOR + float(move))
    return allowed, f"{reason}: max({noise_text}, {ACCURACY_FLOOR:g} + cross-class move {float(move):g})"


def judge(
    metric: str,
    figure: Figure,
    spec: Mapping[str, Any] | None,
    machine_class: str | None = None,
    compared_with: str | None = None,
    move: float | None = None,
) -> Finding:
    """The gate of ``figure``'s kind; ``compared_with`` names the class whose ``spec`` it is when
    not ``machine_class``'s own, ``move`` the figure's measured cross-class move (None: not measured)."""
    if figure.kind == "accuracy":
        return judge_accuracy(metric, figure, spec, machine_class, compared_with, move)
    return judge_speed(metric, figure, spec, machine_class, compared_with, move)


def row_step_rounds(run_dir: str | Path | None, blocks: int = ROW_BLOCKS) -> list[float]:
    """A row's tokens/s per round: the mean ``perf/tokens_per_s`` of consecutive blocks of its steps.

    Step 1 (start-up) is left out, as in the harness's throughput. Fewer measured steps than
    ``blocks``: one round per step. ``[]`` when the run's ``metrics.jsonl`` cannot be read.
    """
    if not run_dir:
        return []
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    values = []
    for line in path.read_text().splitlines():
        if line.strip():
            v = json.loads(line).get("perf/tokens_per_s")
            if isinstance(v, int | float) and v == v:
                values.append(float(v))
    values = values[1:] if len(values) > 1 else values
    if len(values) <= blocks:
        return values
    size = len(values) / blocks
    cuts = [round(i * size) for i in range(blocks + 1)]
    return [statistics.fmean(values[cuts[i] : cuts[i + 1]]) for i in range(blocks)]


def tonight_figures(recipes: Mapping[str, Mapping[str, Any]], bench: Mapping[str, Any]) -> dict[str, Figure]:
    """The figures compared with the baseline, by metric name.

    Bench ratios with their ``ratio_rounds`` (``ci/bench.py``, ``ci/bench_trl.py``); per row
    ``<row>.accuracy_gain`` (its tolerance from the row's expected-file check) and
    ``<row>.tokens_per_s_vs_plain_torch`` (the row's tokens/s over the bench's plain-PyTorch
    training tokens/s, per block of steps: :func:`row_step_rounds`; left out when the bench
    was skipped, ``bench == {}``).
    """
    figures: dict[str, Figure] = {}
    ratio_rounds = bench.get("ratio_rounds") or {}
    for key, value in (bench.get("ratios") or {}).items():
        figures[f"bench.{key}"] = Figure(value, [float(v) for v in ratio_rounds.get(key) or []])
    plain = (bench.get("train") or {}).get("plain_torch_tokens_per_s")
    for name, result in recipes.items():
        scores = result.get("scores") or {}
        check = next((c for c in result.get("checks") or [] if c.get("metric") == "accuracy_gain"), {})
        figures[f"{name}.accuracy_gain"] = Figure(
            scores.get("accuracy_gain"),
            kind="accuracy",
            allowed_drop=check.get("tolerance"),
            seed_spread=check.get("seed_spread"),
            accuracy_before=scores.get("accuracy_before"),
        )
        tps = (result.get("throughput") or {}).get("tokens_per_s")
        if not bench:  # --skip-bench: no yardstick tonight, so no speed figure to judge
            continue
        if tps and plain:
            rounds = [r / plain for r in row_step_rounds(result.get("run_dir"))]
            value = statistics.median(rounds) if rounds else tps / plain
            figures[f"{name}.tokens_per_s_vs_plain_torch"] = Figure(value, rounds)
        else:
            figures[f"{name}.tokens_per_s_vs_plain_torch"] = Figure(None)
    return figures


def main(argv: list[str] | None = None) -> int:
    """Judge the ratios of one bench document against another's; print a line per ratio; 1 if any regressed."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m ci.nightly_gates ACCEPTED_BENCH.json TONIGHT_BENCH.json", file=sys.stderr)
        return 2
    accepted, tonight = (json.loads(Path(a).read_text()) for a in args)
    specs = {m: {"value": f.value, "rounds": f.rounds} for m, f in tonight_figures({}, accepted).items()}
    failed = 0
    for metric, figure in tonight_figures({}, tonight).items():
        f = judge(metric, figure, specs.get(metric))
        failed += not f.ok
        print(
            f"{metric}: {f.value:.4f} (MAD {f.spread or 0:.4f}, {len(f.rounds)} rounds) vs "
            f"{f.baseline if f.baseline is None else round(f.baseline, 4)}: ratio "
            f"{'-' if f.ratio is None else round(f.ratio, 4)}, allowed drop "
            f"{'-' if f.allowed_drop is None else f'{f.allowed_drop:.1%}'} -> {'ok' if f.ok else 'REGRESSION'}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
