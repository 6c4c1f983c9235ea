"""Nightly: every recipe's CPU configs, the benchmark, a comparison with the accepted baseline, a report.

    python -m ci.nightly                          # all recipes under recipes/, then bench, report, leaderboard
    python -m ci.nightly --recipes grpo --skip-bench
    python -m ci.nightly --skip-trl               # the bench without the TRL side-by-side (needs `trl`)
    python -m ci.nightly --recipes grpo --configs cpu   # one row
    python -m ci.nightly --override actor.optim.lr=0   # a planted regression: must exit 1 naming the metric
    python -m ci.nightly --plant-slowdown update_actor:0.10   # a planted slowdown: must flag the update's figure
    python -m ci.nightly --accept                 # after a good night: its machine class's new baseline

Steps:

1. ``verity-harness run <recipe> --config <c>`` for each recipe folder and each of its
   CPU configs (``cpu`` and every ``cpu-<variant>``, e.g. ``cpu-vllm``, ``cpu-megatron``;
   ``cpu-2node`` on the 2-node Ray cluster the harness simulates on this machine), one after
   the other in its own process (each checks its expected file). A row is named ``<recipe>``
   for the ``cpu`` config and ``<recipe>/<config>`` for the others;
2. ``ci/bench.py`` (generation, training and weight-sync ratios against baselines
   measured in the same process), then ``ci/bench_trl.py`` (verity's GRPO step beside TRL's
   ``GRPOTrainer`` on the same work: ``trl s/step / verity s/step`` per shape, its ratios merged
   into the bench's as ``grpo_step_vs_trl_<shape>``; the quickstart shape by default,
   ``--trl-shapes`` for more), and one compute-bound pair (:data:`NIGHTLY_COMPUTE_BOUND_ARGS`:
   512x8, TRL's default bf16 beside verity's compiled bf16, every row trained;
   ``--skip-trl-compute-bound`` leaves it out);
3. comparison with the baseline of tonight's **machine class** in ``ci/baseline.json``
   (``ci/nightly_baselines.py``: ``<hardware>/<matrix instructions>``, one entry per class side
   by side) — ratios only, never absolute times — through the noise-aware gates of
   ``ci/nightly_gates.py`` (the rule is stated there and in ``docs/recipes.md``):

   - ``bench.<ratio>``: the median of its rounds (verity and its peer alternating in one
     process) must not fall below the accepted value by more than
     ``max(3 x MAD/median, 5%)`` (above it, for the lower-is-better weight-sync ratio);
   - ``<row>.tokens_per_s_vs_plain_torch``: the row's step tokens/s per block of steps divided
     by the bench's plain-PyTorch training tokens/s measured the same night: reported and
     trended as information only, never in the verdict (the row's wall clock and its yardstick's
     CPU seconds, minutes apart, read the load as much as the code);
   - ``<row>.accuracy_gain``: may drop below the accepted gain by ``max(3 x seed_spread, 0.02)``
     when tonight's ``accuracy_before`` equals the accepted one (the same warm-start build) and
     the expected file records the metric's ``seed_spread``, else by the expected file's tolerance;

   plus every recipe's own expected-file checks. A machine class with no baseline is judged
   against the nearest accepted CPU class (``ci/nightly_cross_class.py``: the same
   instruction-set family first), each figure's floor raised by how far it was measured to move
   between classes (``ci/cross_class.json``); the report names the class it compared with, and
   says so when there is none to compare with. Either way ``<out>/proposed-baseline.json`` holds
   tonight's figures as that class's own baseline (``--accept-report <out>/report.json`` accepts it);
4. ``report.md`` and ``report.json`` in ``--out``; the leaderboard pages rebuilt. Both
   name the machine the night ran on and the accepted night's; on another machine the
   report says so above the table and beside each speed figure (``ci/nightly_machine.py``);
   then the night joins the history (``ci/nightly_history.py``): one JSON in
   ``<leaderboard>/nightly``, one MLflow run in experiment ``nightly`` of ``--history-store``
   (default ``outputs/nightly/mlflow.db``), and ``trend.html`` rewritten;
5. exit 1 when anything regressed, naming each metric; 0 otherwise.

Planted regressions (``ci/reports/2026-11-28-nightly-gates.md``)::

    python -m ci.nightly --plant-slowdown update_actor:0.10   # every process's update stage 10% slower
    python -m ci.nightly --override actor.optim.lr=1.5e-5      # grpo's learning rate halved

``--plant-slowdown STAGE:FRACTION`` sets ``VERITY_TEST_SLOW_STAGE`` (:mod:`verity.testing.slow_stage`)
for every row and bench. With ``--override`` or ``--plant-slowdown`` (a deliberate change) result
files go to ``<out>/results`` and the leaderboard to ``<out>/leaderboard`` so committed pages only
show unmodified runs, and the night cannot be accepted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from verity.testing.slow_stage import ENV_VAR as SLOW_STAGE_VAR
from verity.testing.slow_stage import parse_slowdowns

from ci.nightly_baselines import (
    accept_report,
    class_baseline,
    load_baselines,
    machine_class,
    night_commit,
    with_accepted_night,
)
from ci.nightly_cross_class import DEFAULT_CROSS_CLASS, load_moves, nearest_class
from ci.nightly_gates import RULE, Figure, Finding, judge, tonight_figures
from ci.nightly_history import HistoryError, store_uri
from ci.nightly_machine import machine_lines, note_other_machine, this_machine

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = ROOT / "ci" / "baseline.json"
PROPOSED_BASELINE = (
    "proposed-baseline.json"  # written beside the report on a machine class without a baseline
)


def recipe_names(recipes_dir: Path) -> list[str]:
    """Every recipe folder (one holding a pyproject.toml), sorted."""
    return sorted(p.parent.name for p in recipes_dir.glob("*/pyproject.toml"))


def cpu_configs(recipe_dir: Path) -> list[str]:
    """A recipe's CPU configs: ``cpu`` first, then every ``cpu-<variant>`` in name order."""
    names = sorted(p.stem for p in (recipe_dir / "src").glob("*/configs/cpu*.yaml"))
    return sorted((n for n in names if n == "cpu" or n.startswith("cpu-")), key=lambda n: (n != "cpu", n))


def row_name(recipe: str, config: str) -> str:
    """The nightly's name for one run: ``grpo`` for grpo's ``cpu`` config, ``grpo/cpu-vllm`` otherwise."""
    return recipe if config == "cpu" else f"{recipe}/{config}"


def nightly_rows(
    recipes_dir: Path, recipes: Sequence[str], configs: Sequence[str] | None = None
) -> list[tuple[str, str]]:
    """``(recipe, config)`` pairs the night runs, in order; ``configs`` keeps only those names.

    Raises ValueError naming a recipe that has none of the asked-for configs.
    """
    rows: list[tuple[str, str]] = []
    for recipe in recipes:
        found = cpu_configs(recipes_dir / recipe)
        chosen = [c for c in found if configs is None or c in configs]
        if not chosen:
            wanted = ", ".join(configs) if configs else "cpu or cpu-*"
            raise ValueError(
                f"recipe {recipe!r} has no config {wanted} under {recipes_dir / recipe}; it has: "
                + (", ".join(found) or "none")
            )
        rows += [(recipe, c) for c in chosen]
    return rows


def run_recipe(
    name: str, out: Path, results_dir: Path, overrides: Sequence[str], config: str = "cpu"
) -> dict[str, Any]:
    """Run ``verity-harness run NAME --config CONFIG`` in a child process; its result document plus ``exit_code``."""
    row = row_name(name, config)
    result_file = out / "runs" / f"{row.replace('/', '--')}.json"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    result_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "verity_harness.cli",
        "run",
        name,
        "--config",
        config,
        "--output-root",
        str(out / "harness"),
        "--results-dir",
        str(results_dir),
        "--result-out",
        str(result_file),
        *overrides,
    ]
    print(f"\n=== {row}: {' '.join(cmd[2:])}", flush=True)
    started = time.perf_counter()
    code = subprocess.call(cmd, cwd=ROOT)
    result = json.loads(result_file.read_text()) if result_file.is_file() else {}
    result.update(exit_code=code, seconds=time.perf_counter() - started)
    return result


def run_bench(out: Path) -> dict[str, Any]:
    path = out / "bench.json"
    print("\n=== bench", flush=True)
    code = subprocess.call([sys.executable, "-m", "ci.bench", "--out", str(path)], cwd=ROOT)
    if code != 0 or not path.is_file():
        return {"exit_code": code}
    return {**json.loads(path.read_text()), "exit_code": code}


# The TRL shapes a night runs in full. The 512x8 shape with every side (25M parameters, 64 new
# tokens) takes 15 minutes on the 2-core machine, which the nightly's 60-minute budget cannot hold
# beside every recipe; `nox -s bench-trl` runs it, and `--trl-shapes quickstart,512x8` puts it back.
NIGHTLY_TRL_SHAPES = "quickstart"

# The quickstart pair's rounds: the sides alternate and each side's figure is its median over them.
# One round read 1.64-2.35 over five nights on the 2-core VM; three cost ~90 s more than one.
NIGHTLY_TRL_ROUNDS = 3

# The compute-bound shape a night does run: one pair, 4 steps a side, 3 alternating rounds so the gate
# can measure its spread (~3 minutes a round on 2 cores): TRL's default bf16
# beside verity in bf16 with compiled layers, both training every row. Its ratio is
# bench.grpo_step_vs_trl_bf16_512x8_verity_bf16_all_rows_compiled. It needs a CPU that multiplies
# bf16 in hardware to mean what the accepted value means, and a C++ compiler (inductor).
NIGHTLY_COMPUTE_BOUND_ARGS = (
    "--shapes", "512x8", "--steps-512x8", "4", "--rounds", "3", "--bf16", "--compile", "--verity-all-rows",
    "--sides", "trl-bf16,verity-bf16-all-rows-compiled",
)  # fmt: skip


def run_bench_trl(
    out: Path, shapes: str = NIGHTLY_TRL_SHAPES, args: Sequence[str] = (), name: str = "bench_trl"
) -> dict[str, Any]:
    """``python -m ci.bench_trl --shapes SHAPES [ARGS]`` in a child process, writing ``<name>.json``; its document plus ``exit_code``.

    ``args`` may name its own ``--shapes`` or ``--rounds`` (they come after, so they win); the
    default is :data:`NIGHTLY_TRL_ROUNDS` alternating rounds.
    """
    path = out / f"{name}.json"
    print(f"\n=== {name.replace('_', '-')}", flush=True)
    cmd = [sys.executable, "-m", "ci.bench_trl", "--shapes", shapes, "--out", str(path)]
    cmd += ["--rounds", str(NIGHTLY_TRL_ROUNDS), *args]
    code = subprocess.call(cmd, cwd=ROOT)
    if code != 0 or not path.is_file():
        return {"exit_code": code}
    return {**json.loads(path.read_text()), "exit_code": code}


def merge_trl(bench: Mapping[str, Any], trl: Mapping[str, Any], key: str = "trl") -> dict[str, Any]:
    """``bench`` with the TRL document under ``key``, its ratios (and their rounds) added to the bench's."""
    merged = dict(bench)
    merged["ratios"] = {**(bench.get("ratios") or {}), **(trl.get("ratios") or {})}
    merged["ratio_rounds"] = {**(bench.get("ratio_rounds") or {}), **(trl.get("ratio_rounds") or {})}
    merged[key] = dict(trl)
    return merged


TRL_KEYS = ("trl", "trl_compute_bound")  # the TRL documents merged into a night's bench


def compare_with_baseline(
    recipes: Mapping[str, Mapping[str, Any]],
    bench: Mapping[str, Any],
    accepted: Mapping[str, Any] | None,
    machine_class: str | None = None,
    compared_with: str | None = None,
    moves: Mapping[str, float] | None = None,
) -> list[Finding]:
    """Every finding of the night: harness exit codes and checks, then each figure through its gate.

    ``accepted``: the machine class's baseline entry (``{"figures": {...}}``,
    :func:`nightly_baselines.class_baseline`), or the entry of ``compared_with`` (the nearest
    accepted class) when the class has none; None when there is neither (each figure then passes
    with a note saying so). ``moves``: each figure's measured cross-class move
    (:func:`nightly_cross_class.load_moves`), used across classes and for a gain on another build.
    """
    findings: list[Finding] = []
    for name, result in recipes.items():
        for check in result.get("checks") or []:
            findings.append(
                Finding(
                    f"{name}.{check['metric']} (expected file)",
                    check.get("value"),
                    check.get("target"),
                    None,
                    f"{check['mode']} ±{check['tolerance']}",
                    bool(check["passed"]),
                    check.get("reason", ""),
                )
            )
        if result.get("exit_code") not in (0, 1):
            findings.append(
                Finding(
                    f"{name}.run",
                    None,
                    None,
                    None,
                    "-",
                    False,
                    f"verity-harness run exited {result.get('exit_code')}",
                )
            )
    if bench.get("exit_code", 0) != 0:
        findings.append(
            Finding("bench.run", None, None, None, "-", False, f"bench exited {bench['exit_code']}")
        )
    for key in TRL_KEYS:
        trl_code = (bench.get(key) or {}).get("exit_code", 0)
        if trl_code != 0:
            run = "bench_trl.run" if key == "trl" else f"bench_{key}.run"
            findings.append(Finding(run, None, None, None, "-", False, f"ci/bench_trl.py exited {trl_code}"))
    specs = (accepted or {}).get("figures") or {}
    moves = moves or {}
    for metric, figure in tonight_figures(recipes, bench).items():
        findings.append(
            judge(metric, figure, specs.get(metric), machine_class, compared_with, moves.get(metric))
        )
    return findings


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.4g}"


def _figure_row(f: Finding) -> str:
    rounds = ", ".join(f"{r:.3g}" for r in f.rounds) if len(f.rounds) > 1 else ""
    allowed = (
        "-"
        if f.allowed_drop is None
        else (f"{f.allowed_drop:.1%}" if f.spread is not None else f"{f.allowed_drop:g}")
    )
    return (
        f"| {f.metric} | {_num(f.value)} | {rounds} | {_num(f.spread)} | {_num(f.baseline)} | {_num(f.ratio)} | "
        f"{allowed} | {f.threshold} | {'ok' if f.ok else '**FAIL**'} | {f.note} |"
    )


def write_report(
    out: Path,
    findings: Sequence[Finding],
    recipes: Mapping[str, Any],
    bench: Mapping[str, Any],
    overrides: Sequence[str],
    seconds: float,
    machine: Mapping[str, Any] | None = None,
    accepted_machine: Mapping[str, Any] | None = None,
    figures: Mapping[str, Figure] | None = None,
    planted_slowdown: Sequence[str] = (),
    has_baseline: bool = True,
    compared_with: tuple[str | None, str] = (None, ""),
) -> Path:
    """``report.md`` (a table a person reads) and ``report.json`` (everything) in ``out``.

    ``machine``: tonight's (:func:`nightly_machine.this_machine`); ``accepted_machine``: the
    baseline's of the same machine class, compared with it in the report's header; ``figures``:
    tonight's (:func:`nightly_gates.tonight_figures`), kept with their rounds for ``--accept-report``;
    ``has_baseline``: False when the machine class has no accepted baseline (the report says so);
    ``compared_with``: then the class its figures were judged against and why that one
    (:func:`nightly_cross_class.nearest_class`), ``(None, why)`` when none was.
    """
    failed = [f for f in findings if not f.ok]
    klass = machine_class(machine)
    planted = [*overrides, *(f"slowdown {p}" for p in planted_slowdown)]
    lines = [
        f"# Nightly report — {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        f"verdict: **{'REGRESSION' if failed else 'OK'}**, {len(findings)} figures, {len(failed)} failing; "
        f"{seconds / 60:.1f} min" + (f"; planted: `{'; '.join(planted)}`" if planted else ""),
        "",
        f"machine class: `{klass}`; gate: {RULE}",
        "",
        *(machine_lines(machine, accepted_machine) + [""] if machine is not None and has_baseline else []),
        *([no_baseline_line(klass, compared_with, out), ""] if not has_baseline else []),
        "| metric | tonight (median) | rounds | MAD | accepted | ratio | allowed drop | threshold | status | note |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *(_figure_row(f) for f in findings),
        "",
        "| row | seconds | exit | held-out acc. before → after |",
        "|---|---|---|---|",
    ]
    for name, r in recipes.items():
        sc = r.get("scores") or {}
        lines.append(
            f"| {name} | {r.get('seconds', 0):.0f} | {r.get('exit_code')} | "
            f"{_num(sc.get('accuracy_before'))} → {_num(sc.get('accuracy_after'))} |"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(
        json.dumps(
            {
                "machine_class": klass,
                "has_baseline": has_baseline,
                "compared_with": compared_with[0],
                "compared_with_why": compared_with[1],
                "rule": RULE,
                "findings": [asdict(f) for f in findings],
                "figures": {m: {**asdict(f), "spread": f.spread} for m, f in (figures or {}).items()},
                "recipes": recipes,
                "bench": bench,
                "overrides": list(overrides),
                "planted_slowdown": list(planted_slowdown),
                "seconds": seconds,
                "machine": dict(machine) if machine is not None else None,
            },
            indent=1,
            default=str,
        )
        + "\n"
    )
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def no_baseline_line(klass: str, compared_with: tuple[str | None, str], out: Path) -> str:
    """The report's sentence for a machine class with no baseline: which class judged it, or that none did."""
    other, why = compared_with
    if other is None:
        judged = f"no class was compared with ({why}), so its figures were not judged"
    else:
        judged = (
            f"its figures were judged against `{other}`, the nearest accepted class ({why}), each floor "
            f"raised by the figure's measured cross-class move (`ci/cross_class.json`)"
        )
    return (
        f"**No baseline for machine class `{klass}`**: {judged}. Proposed baseline: "
        f"`{out / PROPOSED_BASELINE}`; accept it with `python -m ci.nightly --accept-report {out / 'report.json'}`."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", help="comma-separated recipe names (default: every folder in recipes/)")
    parser.add_argument(
        "--configs", help="comma-separated config names to run (default: each recipe's cpu and cpu-* configs)"
    )
    parser.add_argument("--override", action="append", default=[], help="Hydra override for every recipe run")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "nightly")
    parser.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    parser.add_argument(
        "--cross-class",
        type=Path,
        default=DEFAULT_CROSS_CLASS,
        help="the figures' measured moves between machine classes (python -m ci.nightly_cross_class --write)",
    )
    parser.add_argument(
        "--results-dir", type=Path, help="default: leaderboards/results (<out>/results with --override)"
    )
    parser.add_argument(
        "--leaderboard-dir", type=Path, help="default: leaderboards (<out>/leaderboard with --override)"
    )
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--skip-trl", action="store_true", help="run ci/bench.py but not ci/bench_trl.py")
    parser.add_argument(
        "--skip-trl-compute-bound",
        action="store_true",
        help="leave out the 512x8 bf16 pair (TRL bf16 beside verity bf16 with compiled layers)",
    )
    parser.add_argument(
        "--trl-shapes",
        default=NIGHTLY_TRL_SHAPES,
        help=f"ci/bench_trl.py shapes (default {NIGHTLY_TRL_SHAPES}; the 512x8 shape is `nox -s bench-trl`)",
    )
    parser.add_argument(
        "--plant-slowdown",
        action="append",
        default=[],
        metavar="STAGE:FRACTION",
        help="a planted regression: every row and bench runs with that stage slowed (e.g. update_actor:0.10); "
        f"sets {SLOW_STAGE_VAR} for the night's processes",
    )
    parser.add_argument(
        "--accept", action="store_true", help="write tonight's figures as its machine class's baseline"
    )
    parser.add_argument(
        "--accept-report",
        type=Path,
        help="accept a finished night's report.json as the baseline (nothing runs); refused if it failed",
    )
    parser.add_argument(
        "--history-store",
        help="SQLite file of the MLflow history (experiment nightly; ci/nightly_history.py), "
        "default $VERITY_NIGHTLY_HISTORY_STORE or outputs/nightly/mlflow.db",
    )
    args = parser.parse_args(argv)
    if args.accept_report is not None:
        return accept_report(args.accept_report, args.baseline)
    try:
        history_store = store_uri(args.history_store)
    except HistoryError as err:
        print(f"nightly: {err}", file=sys.stderr)
        return 2

    try:
        parse_slowdowns(",".join(args.plant_slowdown))
        baselines = load_baselines(args.baseline)
        moves = load_moves(args.cross_class)
    except ValueError as err:
        print(f"nightly: --plant-slowdown / --baseline / --cross-class: {err}", file=sys.stderr)
        return 2
    if args.plant_slowdown:  # every child process (rows, benches) inherits it
        os.environ[SLOW_STAGE_VAR] = ",".join(args.plant_slowdown)
    planted = bool(args.override or args.plant_slowdown)
    results_dir = args.results_dir or (args.out / "results" if planted else ROOT / "leaderboards" / "results")
    board_dir = args.leaderboard_dir or (args.out / "leaderboard" if planted else ROOT / "leaderboards")
    names = args.recipes.split(",") if args.recipes else recipe_names(ROOT / "recipes")
    try:
        rows = nightly_rows(ROOT / "recipes", names, args.configs.split(",") if args.configs else None)
    except ValueError as err:
        print(f"nightly: {err}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    machine = this_machine()
    recipes = {
        row_name(name, config): run_recipe(name, args.out, results_dir, args.override, config)
        for name, config in rows
    }
    bench = {} if args.skip_bench else run_bench(args.out)
    if not args.skip_bench and not args.skip_trl:
        bench = merge_trl(bench, run_bench_trl(args.out, args.trl_shapes))
        if not args.skip_trl_compute_bound:
            pair = run_bench_trl(args.out, args=NIGHTLY_COMPUTE_BOUND_ARGS, name="bench_trl_compute_bound")
            bench = merge_trl(bench, pair, key="trl_compute_bound")
    klass = machine_class(machine)
    accepted = class_baseline(baselines, klass)
    nearest: tuple[str | None, str] = (None, "")
    if accepted is None:
        nearest = nearest_class(klass, (baselines.get("classes") or {}).keys())
    reference = accepted if accepted is not None else class_baseline(baselines, nearest[0] or "")
    findings = compare_with_baseline(recipes, bench, reference, klass, nearest[0], moves)
    accepted_machine = (accepted or {}).get("accepted", {}).get("machine")
    if accepted is not None:
        note_other_machine(findings, machine, accepted_machine)
    figures = tonight_figures(recipes, bench)
    proposed = with_accepted_night(baselines, figures, machine, night_commit(recipes))
    if accepted is None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / PROPOSED_BASELINE).write_text(json.dumps(proposed, indent=1) + "\n")
    print("\n=== leaderboard", flush=True)
    board_cmd = [
        sys.executable,
        "-m",
        "verity_harness.cli",
        "leaderboard",
        "--results-dir",
        str(results_dir),
        "--out",
        str(board_dir),
        "--tracking-uri",
        "sqlite:///" + str((args.out / "harness" / "mlflow.db").resolve()),
    ]
    if subprocess.call(board_cmd, cwd=ROOT) != 0:
        findings.append(
            Finding("leaderboard.build", None, None, None, "-", False, "verity-harness leaderboard failed")
        )
    seconds = time.perf_counter() - started
    report = write_report(
        args.out,
        findings,
        recipes,
        bench,
        args.override,
        seconds,
        machine,
        accepted_machine,
        figures,
        args.plant_slowdown,
        has_baseline=accepted is not None,
        compared_with=nearest,
    )
    print("\n" + report.read_text())
    # the night's JSON (committed unless planted), its MLflow run and trend.html: ci/nightly_history.py
    history = [sys.executable, "-m", "ci.nightly_history", str(args.out / "report.json")]
    history += ["--nights-dir", str(board_dir / "nightly"), "--history-store", history_store]
    if subprocess.call([*history, "--board-dir", str(board_dir)], cwd=ROOT) != 0:
        print(f"nightly: the night's history was not recorded: {' '.join(history)}", file=sys.stderr)
        return 1
    failed = [f for f in findings if not f.ok]
    if args.accept:
        if failed or planted:
            print("nightly: not accepting a night with regressions or planted changes", file=sys.stderr)
        else:
            args.baseline.write_text(json.dumps(proposed, indent=1) + "\n")
            print(f"nightly: wrote {klass}'s baseline into {args.baseline}")
    if failed:
        print("nightly: REGRESSION in " + ", ".join(f.metric for f in failed), file=sys.stderr)
        return 1
    print("nightly: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
