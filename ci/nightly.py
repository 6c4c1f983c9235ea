"""Nightly: every recipe's CPU configs, the benchmark, a comparison with the accepted baseline, a report.

    python ci/nightly.py                          # all recipes under recipes/, then bench, report, leaderboard
    python ci/nightly.py --recipes grpo --skip-bench
    python ci/nightly.py --skip-trl               # the bench without the TRL side-by-side (needs `trl`)
    python ci/nightly.py --recipes grpo --configs cpu   # one row
    python ci/nightly.py --override actor.optim.lr=0   # a planted regression: must exit 1 naming the metric
    python ci/nightly.py --accept                 # after a good night: make its figures the new baseline

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
3. comparison with ``ci/baseline.json`` — ratios only, never absolute times:

   - ``bench.<ratio>``: this night's ratio / the accepted one must stay above
     ``min_ratio`` (or below ``max_ratio`` for a lower-is-better figure);
   - ``<row>.accuracy_gain``: this night's gain / the accepted gain >= ``min_ratio``;
   - ``<row>.tokens_per_s_vs_plain_torch``: the row's step tokens/s divided by the
     bench's plain-PyTorch training tokens/s measured the same night (a yardstick of the
     machine's speed), relative to the accepted value, >= ``min_ratio``;

   plus every recipe's own expected-file checks;
4. ``report.md`` and ``report.json`` in ``--out``; the leaderboard pages rebuilt. Both
   name the machine the night ran on and the accepted night's; on another machine the
   report says so above the table and beside each speed figure (``ci/nightly_machine.py``);
5. exit 1 when anything regressed, naming each metric; 0 otherwise.

With ``--override`` (a deliberate change) result files go to ``<out>/results`` and the
leaderboard to ``<out>/leaderboard`` so committed pages only show unmodified runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling nightly_machine.py, imported as a file
from nightly_machine import machine_lines, note_other_machine, this_machine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BASELINE = ROOT / "ci" / "baseline.json"


@dataclass
class Finding:
    """One compared figure: its value now, the accepted value, the ratio and whether it holds."""

    metric: str
    value: float | None
    baseline: float | None
    ratio: float | None
    threshold: str
    ok: bool
    note: str = ""


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
    code = subprocess.call([sys.executable, str(ROOT / "ci" / "bench.py"), "--out", str(path)], cwd=ROOT)
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

# The compute-bound shape a night does run: one pair, 4 steps a side (~3 minutes): TRL's default bf16
# beside verity in bf16 with compiled layers, both training every row. Its ratio is
# bench.grpo_step_vs_trl_bf16_512x8_verity_bf16_all_rows_compiled. It needs a CPU that multiplies
# bf16 in hardware to mean what the accepted value means, and a C++ compiler (inductor).
NIGHTLY_COMPUTE_BOUND_ARGS = (
    "--shapes", "512x8", "--steps-512x8", "4", "--rounds", "1", "--bf16", "--compile", "--verity-all-rows",
    "--sides", "trl-bf16,verity-bf16-all-rows-compiled",
)  # fmt: skip


def run_bench_trl(
    out: Path, shapes: str = NIGHTLY_TRL_SHAPES, args: Sequence[str] = (), name: str = "bench_trl"
) -> dict[str, Any]:
    """``ci/bench_trl.py --shapes SHAPES [ARGS]`` in a child process, writing ``<name>.json``; its document plus ``exit_code``.

    ``args`` may name its own ``--shapes`` or ``--rounds`` (they come after, so they win); the
    default is :data:`NIGHTLY_TRL_ROUNDS` alternating rounds.
    """
    path = out / f"{name}.json"
    print(f"\n=== {name.replace('_', '-')}", flush=True)
    cmd = [sys.executable, str(ROOT / "ci" / "bench_trl.py"), "--shapes", shapes, "--out", str(path)]
    cmd += ["--rounds", str(NIGHTLY_TRL_ROUNDS), *args]
    code = subprocess.call(cmd, cwd=ROOT)
    if code != 0 or not path.is_file():
        return {"exit_code": code}
    return {**json.loads(path.read_text()), "exit_code": code}


def merge_trl(bench: Mapping[str, Any], trl: Mapping[str, Any], key: str = "trl") -> dict[str, Any]:
    """``bench`` with the TRL document under ``key`` and its ratios added to ``bench["ratios"]``."""
    merged = dict(bench)
    merged["ratios"] = {**(bench.get("ratios") or {}), **(trl.get("ratios") or {})}
    merged[key] = dict(trl)
    return merged


TRL_KEYS = ("trl", "trl_compute_bound")  # the TRL documents merged into a night's bench


def _compare(metric: str, value: float | None, spec: Mapping[str, Any] | None) -> Finding:
    """``value`` against ``spec = {"value": accepted, "min_ratio"|"max_ratio": threshold}``."""
    if spec is None:
        return Finding(metric, value, None, None, "-", True, "no accepted value yet")
    accepted = float(spec["value"])
    if value is None:
        return Finding(metric, None, accepted, None, "-", False, "not measured tonight")
    if accepted == 0:
        return Finding(metric, value, accepted, None, "-", True, "accepted value is 0: no ratio")
    ratio = value / accepted
    if "max_ratio" in spec:
        limit = float(spec["max_ratio"])
        return Finding(metric, value, accepted, ratio, f"<= {limit}", ratio <= limit)
    limit = float(spec["min_ratio"])
    return Finding(metric, value, accepted, ratio, f">= {limit}", ratio >= limit)


def tonight_figures(
    recipes: Mapping[str, Mapping[str, Any]], bench: Mapping[str, Any]
) -> dict[str, float | None]:
    """The figures compared with the baseline, by metric name."""
    figures: dict[str, float | None] = {}
    ratios = bench.get("ratios") or {}
    for key, value in ratios.items():
        figures[f"bench.{key}"] = value
    plain = (bench.get("train") or {}).get("plain_torch_tokens_per_s")
    for name, result in recipes.items():
        scores = result.get("scores") or {}
        figures[f"{name}.accuracy_gain"] = scores.get("accuracy_gain")
        tps = (result.get("throughput") or {}).get("tokens_per_s")
        figures[f"{name}.tokens_per_s_vs_plain_torch"] = tps / plain if tps and plain else None
    return figures


def compare_with_baseline(
    recipes: Mapping[str, Mapping[str, Any]], bench: Mapping[str, Any], baseline: Mapping[str, Any]
) -> list[Finding]:
    """Every finding of the night: harness exit codes and checks, then each baseline figure."""
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
    specs = baseline.get("figures") or {}
    for metric, value in tonight_figures(recipes, bench).items():
        findings.append(_compare(metric, value, specs.get(metric)))
    return findings


def write_report(
    out: Path,
    findings: Sequence[Finding],
    recipes: Mapping[str, Any],
    bench: Mapping[str, Any],
    overrides: Sequence[str],
    seconds: float,
    machine: Mapping[str, Any] | None = None,
    accepted_machine: Mapping[str, Any] | None = None,
) -> Path:
    """``report.md`` (a table a person reads) and ``report.json`` (everything) in ``out``.

    ``machine``: tonight's (:func:`nightly_machine.this_machine`); ``accepted_machine``: the
    baseline's, compared with it in the report's header.
    """
    failed = [f for f in findings if not f.ok]
    lines = [
        f"# Nightly report — {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        "",
        f"verdict: **{'REGRESSION' if failed else 'OK'}**, {len(findings)} figures, {len(failed)} failing; "
        f"{seconds / 60:.1f} min" + (f"; overrides: `{' '.join(overrides)}`" if overrides else ""),
        "",
        *(machine_lines(machine, accepted_machine) + [""] if machine is not None else []),
        "| metric | tonight | accepted | ratio | threshold | status | note |",
        "|---|---|---|---|---|---|---|",
    ]

    def num(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    for f in findings:
        status = "ok" if f.ok else "**FAIL**"
        lines.append(
            f"| {f.metric} | {num(f.value)} | {num(f.baseline)} | {num(f.ratio)} | {f.threshold} | "
            f"{status} | {f.note} |"
        )
    lines += ["", "| row | seconds | exit | held-out acc. before → after |", "|---|---|---|---|"]
    for name, r in recipes.items():
        s = r.get("scores") or {}
        lines.append(
            f"| {name} | {r.get('seconds', 0):.0f} | {r.get('exit_code')} | "
            f"{num(s.get('accuracy_before'))} → {num(s.get('accuracy_after'))} |"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(
        json.dumps(
            {
                "findings": [asdict(f) for f in findings],
                "recipes": recipes,
                "bench": bench,
                "overrides": list(overrides),
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


def accepted_baseline(
    figures: Mapping[str, float | None],
    previous: Mapping[str, Any],
    commit: str | None,
    machine: Mapping[str, Any] | None = None,
) -> dict:
    """A new baseline: tonight's figures with the previous thresholds (defaults for new ones).

    Figures the night did not measure (a row left out with ``--recipes``/``--configs``,
    the bench skipped) keep their accepted value, so accepting part of a night never
    drops the rest of the baseline. ``machine``: the night's (``report.json``'s
    ``machine``), recorded as ``accepted.machine``; None (a report from before nights
    recorded it) records none.
    """
    old = previous.get("figures") or {}
    new: dict[str, Any] = {metric: dict(spec) for metric, spec in old.items()}
    for metric, value in sorted(figures.items()):
        if value is None:
            continue
        spec = dict(old.get(metric) or default_threshold(metric))
        spec["value"] = round(float(value), 4)
        new[metric] = spec
    new = dict(sorted(new.items()))
    accepted: dict[str, Any] = {"date": dt.date.today().isoformat(), "commit": commit}
    if machine is not None:
        accepted["machine"] = dict(machine)
    return {"about": previous.get("about", ""), "accepted": accepted, "figures": new}


def accept_report(report_file: Path, baseline_file: Path) -> int:
    """Write ``report_file``'s figures (a night's ``report.json``) into ``baseline_file``; 0, or 2 with a sentence.

    Refused when the night had a failing finding or ran with overrides (a planted run).
    """
    if not report_file.is_file():
        print(
            f"nightly: --accept-report {report_file}: no such file (expected a night's report.json)",
            file=sys.stderr,
        )
        return 2
    report = json.loads(report_file.read_text())
    failed = [f["metric"] for f in report.get("findings", []) if not f.get("ok")]
    if failed or report.get("overrides"):
        why = f"it failed {', '.join(failed)}" if failed else f"it ran with overrides {report['overrides']}"
        print(f"nightly: not accepting {report_file}: {why}", file=sys.stderr)
        return 2
    recipes, bench = report.get("recipes") or {}, report.get("bench") or {}
    baseline = json.loads(baseline_file.read_text()) if baseline_file.is_file() else {}
    commit = next((r.get("git_commit") for r in recipes.values() if r.get("git_commit")), None)
    new = accepted_baseline(tonight_figures(recipes, bench), baseline, commit, report.get("machine"))
    baseline_file.write_text(json.dumps(new, indent=1) + "\n")
    print(f"nightly: wrote the new baseline {baseline_file} from {report_file} (commit {commit})")
    return 0


def default_threshold(metric: str) -> dict[str, float]:
    if metric.startswith("bench.weight_sync"):
        return {"max_ratio": 2.0}
    if metric.startswith("bench."):
        return {"min_ratio": 0.7}
    if metric.endswith("accuracy_gain"):
        return {"min_ratio": 0.5}
    return {"min_ratio": 0.5}


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
    parser.add_argument("--accept", action="store_true", help="write tonight's figures as the new baseline")
    parser.add_argument(
        "--accept-report",
        type=Path,
        help="accept a finished night's report.json as the baseline (nothing runs); refused if it failed",
    )
    args = parser.parse_args(argv)
    if args.accept_report is not None:
        return accept_report(args.accept_report, args.baseline)

    planted = bool(args.override)
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
    baseline = json.loads(args.baseline.read_text()) if args.baseline.is_file() else {}
    findings = compare_with_baseline(recipes, bench, baseline)
    accepted_machine = (baseline.get("accepted") or {}).get("machine")
    note_other_machine(findings, machine, accepted_machine)
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
        args.out, findings, recipes, bench, args.override, seconds, machine, accepted_machine
    )
    print("\n" + report.read_text())
    failed = [f for f in findings if not f.ok]
    if args.accept:
        if failed or planted:
            print("nightly: not accepting a night with regressions or overrides", file=sys.stderr)
        else:
            commit = next((r.get("git_commit") for r in recipes.values() if r.get("git_commit")), None)
            new = accepted_baseline(tonight_figures(recipes, bench), baseline, commit, machine)
            args.baseline.write_text(json.dumps(new, indent=1) + "\n")
            print(f"nightly: wrote the new baseline {args.baseline}")
    if failed:
        print("nightly: REGRESSION in " + ", ".join(f.metric for f in failed), file=sys.stderr)
        return 1
    print("nightly: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
