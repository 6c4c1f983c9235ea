"""``verity-harness``: run recipes against their promises, compare runs, build the leaderboards.

    verity-harness list
    verity-harness run RECIPE [--config NAME] [--hardware NAME] [key=value ...]
    verity-harness compare RUN_A RUN_B
    verity-harness leaderboard [--screenshot] [--benchmarks-page docs/benchmarks.md]

Exit codes: 0 success; 1 a run missed its expected metrics (the failing metrics are
named); 2 bad arguments or configuration.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from verity_harness.recipes import DEFAULT_CONFIG, RecipeNotFoundError, list_recipes
from verity_harness.runner import DEFAULT_OUTPUT_ROOT, DEFAULT_RESULTS_DIR, SCRATCH_RESULTS_DIR

DEFAULT_LEADERBOARD_DIR = Path("leaderboards")
DEFAULT_BENCH_DIR = Path("leaderboards/bench")  # the committed ci/bench_gpu.py results, with their provenance
DEFAULT_NIGHTLY_DIR = Path("leaderboards/nightly")  # one JSON per night (ci/nightly_history.py): trend.html


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verity-harness", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("list", help="recipes, their configs and expected files")

    run = sub.add_parser("run", help="rerun a recipe config, check it against its expected file")
    run.add_argument("recipe")
    run.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"config name under configs/ (default {DEFAULT_CONFIG})"
    )
    run.add_argument(
        "--hardware",
        help="cpu|cuda|rocm|npu to force a device family, or a label (e.g. h100) naming this machine's "
        "expected and result files; default: detected",
    )
    run.add_argument(
        "--output-root", type=Path, default=DEFAULT_OUTPUT_ROOT, help="run directories and MLflow store"
    )
    run.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help=f"where the result JSON goes (default {DEFAULT_RESULTS_DIR}; {SCRATCH_RESULTS_DIR} for a run "
        "with overrides, which is not the recipe as it is)",
    )
    run.add_argument("--no-result-file", action="store_true", help="do not write a result JSON file")
    run.add_argument("--result-out", type=Path, help="also write the result document to this path")
    run.add_argument("--tracking-uri", help="MLflow tracking URI (default: the store under --output-root)")
    run.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. trainer.total_steps=10")

    compare = sub.add_parser("compare", help="two runs side by side")
    compare.add_argument("run_a", help="result file, run directory or MLflow run id")
    compare.add_argument("run_b")
    compare.add_argument(
        "--tracking-uri", help="MLflow store for run ids (default: outputs/harness/mlflow.db)"
    )

    board = sub.add_parser("leaderboard", help="build the static leaderboard pages")
    board.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS_DIR)
    board.add_argument("--out", type=Path, default=DEFAULT_LEADERBOARD_DIR)
    board.add_argument(
        "--tracking-uri",
        action="append",
        default=None,
        help="MLflow store(s) of harness runs (default: outputs/harness/mlflow.db when it exists)",
    )
    board.add_argument("--no-mlflow", action="store_true", help="only the committed result files")
    board.add_argument(
        "--bench-dir",
        type=Path,
        action="append",
        default=None,
        help="folder(s) searched for ci/bench_gpu.py results for bench.html (default: leaderboards/bench when it exists)",
    )
    board.add_argument(
        "--nightly-dir",
        type=Path,
        action="append",
        default=None,
        help="folder(s) of per-night JSONs (ci/nightly_history.py) for trend.html "
        "(default: leaderboards/nightly when it exists)",
    )
    board.add_argument(
        "--benchmarks-page",
        type=Path,
        default=None,
        help="also write this Markdown page (docs/benchmarks.md) from leaderboards/bench and ci/baseline.json",
    )
    board.add_argument(
        "--screenshot", action="store_true", help="save <out>/screenshot.png of index.html (Chromium)"
    )
    return parser


def _default_store() -> list[str]:
    db = DEFAULT_OUTPUT_ROOT / "mlflow.db"
    return ["sqlite:///" + str(db.resolve())] if db.is_file() else []


def cmd_list() -> int:
    recipes = list_recipes()
    if not recipes:
        print("no recipes found (install recipes/<name> or run from a checkout)")
        return 0
    for recipe in recipes.values():
        configs = ", ".join(recipe.configs()) or "none"
        expected = ", ".join(p.stem for p in recipe.expected_files()) or "none"
        print(f"{recipe.name:8} configs: {configs}\n{'':8} expected: {expected}\n{'':8} {recipe.folder}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from verity.config import ConfigError

    from verity_harness.runner import format_outcome, results_dir_for, run_recipe

    results_dir, why = results_dir_for(args.overrides, args.results_dir)
    try:
        outcome = run_recipe(
            args.recipe,
            args.config,
            hardware=args.hardware,
            overrides=args.overrides,
            output_root=args.output_root,
            results_dir=None if args.no_result_file else results_dir,
            tracking_uri=args.tracking_uri,
        )
    except (RecipeNotFoundError, ConfigError) as err:
        print(f"verity-harness run: {err}", file=sys.stderr)
        return 2
    if args.result_out is not None:
        args.result_out.parent.mkdir(parents=True, exist_ok=True)
        args.result_out.write_text(json.dumps(outcome.result, indent=1) + "\n", encoding="utf-8")
    print()
    print(format_outcome(outcome))
    if why is not None and not args.no_result_file:
        print(f"verity-harness run: {why}")
    if outcome.passed is False:
        failed = ", ".join(c.metric for c in outcome.checks if not c.passed)
        print(
            f"verity-harness run: {args.recipe}/{args.config} missed its expected metrics: {failed}",
            file=sys.stderr,
        )
        return 1
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from verity_harness.compare import format_comparison, load_run

    uri = args.tracking_uri or (_default_store() or [None])[0]
    try:
        a, b = load_run(args.run_a, uri), load_run(args.run_b, uri)
    except ValueError as err:
        print(f"verity-harness compare: {err}", file=sys.stderr)
        return 2
    print(format_comparison(a, b))
    return 0


def cmd_leaderboard(args: argparse.Namespace) -> int:
    from verity_harness.leaderboard import build_leaderboard

    if not Path(args.results_dir).is_dir():
        print(
            f"verity-harness leaderboard: --results-dir {args.results_dir}: no such folder "
            "(the committed result files are in leaderboards/results)",
            file=sys.stderr,
        )
        return 2
    uris = [] if args.no_mlflow else (args.tracking_uri or _default_store())
    if args.bench_dir is not None:
        bench_dirs = args.bench_dir
    else:
        bench_dirs = [DEFAULT_BENCH_DIR] if DEFAULT_BENCH_DIR.is_dir() else []
    missing = [d for d in bench_dirs if not d.is_dir()]
    if missing:
        print(f"verity-harness leaderboard: --bench-dir {missing[0]}: no such folder", file=sys.stderr)
        return 2
    nightly_dirs = args.nightly_dir or ([DEFAULT_NIGHTLY_DIR] if DEFAULT_NIGHTLY_DIR.is_dir() else [])
    missing = [d for d in nightly_dirs if not d.is_dir()]
    if missing:
        print(f"verity-harness leaderboard: --nightly-dir {missing[0]}: no such folder", file=sys.stderr)
        return 2
    page = None
    if args.benchmarks_page is not None:
        from verity_harness.leaderboard.benchmarks_page import BenchmarksPageError, render_benchmarks_page

        try:
            page = render_benchmarks_page(Path.cwd())
        except BenchmarksPageError as err:
            print(f"verity-harness leaderboard: --benchmarks-page: {err}", file=sys.stderr)
            return 2
    paths = build_leaderboard(
        args.results_dir, args.out, uris, bench_dirs=bench_dirs, nightly_dirs=nightly_dirs
    )
    for path in paths:
        print(f"wrote {path}")
    if page is not None:
        args.benchmarks_page.write_text(page, encoding="utf-8")
        print(f"wrote {args.benchmarks_page}")
    if args.screenshot:
        from verity_harness.browser import browser_unavailable, inspect_page

        reason = browser_unavailable()
        if reason is not None:
            print(f"verity-harness leaderboard: no screenshot: {reason}", file=sys.stderr)
            return 2
        shot = args.out / "screenshot.png"
        report = inspect_page(paths[0], screenshot=shot)
        print(f"wrote {shot} (tables {report.table_rows}, {len(report.plots)} plots)")
        if report.console_errors:
            print(f"console errors: {report.console_errors}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = _parser()
    # overrides may follow options (run grpo --config cpu a.b=1): collect the leftovers
    args, extra = parser.parse_known_args(argv)
    if extra:
        if args.command != "run" or any(not arg or arg.startswith("-") or "=" not in arg for arg in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if args.command == "list":
        return cmd_list()
    if args.command == "run":
        return cmd_run(args)
    if args.command == "compare":
        return cmd_compare(args)
    return cmd_leaderboard(args)


if __name__ == "__main__":
    sys.exit(main())
