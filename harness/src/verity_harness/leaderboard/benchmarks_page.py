"""``docs/benchmarks.md``, generated from the committed results so that it cannot go stale.

``nox -s leaderboard`` writes it (``verity-harness leaderboard --benchmarks-page docs/benchmarks.md``)
from three committed sources, each figure with the machine, date, commit and command that
produced it:

- ``leaderboards/bench/<session>/*.json``: ``ci/bench_gpu.py`` results (actor-update MFU,
  generation tokens/s), each with a ``provenance`` object (``machine``, ``date``, ``commit``,
  ``command``, ``report``; ``recorded_from`` says where a field came from when the run did
  not write it itself);
- ``leaderboards/bench/figures.json``: other measured figures (the TRL side-by-side pairs, the
  whole nightly, the quickstart on a GPU), each with the same fields;
- ``ci/baseline.json``: the nightly's accepted figures, with the night's date, commit and machine.

The page is a pure function of those files (no clock, no absolute path):
tests/unit/test_benchmarks_page.py checks that the committed page equals what
:func:`render_benchmarks_page` writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verity_harness.leaderboard.bench import bench_rows, latest_bench_rows

BENCH_DIR = Path("leaderboards/bench")  # relative to the repository root
FIGURES_FILE = "figures.json"
BASELINE = Path("ci/baseline.json")
PAGE = Path("docs/benchmarks.md")
PROVENANCE_FIELDS = ("machine", "date", "commit", "command")
NIGHTLY_COMMAND = "nox -s nightly"  # then `python -m ci.nightly --accept-report ...` writes ci/baseline.json


class BenchmarksPageError(ValueError):
    """A committed source of the page is missing a field or is not what the page reads."""


def _read_json(path: Path, root: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BenchmarksPageError(f"{_rel(path, root)}: not readable JSON ({err})") from None


def _rel(path: Path, root: Path) -> str:
    try:
        return path.resolve().relative_to(root.resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def _check_provenance(record: Mapping[str, Any], where: str) -> None:
    missing = [f for f in PROVENANCE_FIELDS if not str(record.get(f) or "").strip()]
    if missing:
        raise BenchmarksPageError(
            f"{where}: missing {', '.join(missing)}; every figure needs its machine, date, commit and command"
        )


def load_bench_runs(bench_dir: Path, root: Path) -> list[dict[str, Any]]:
    """Every ``ci/bench_gpu.py`` result under ``bench_dir`` (recursively), sorted by path.

    Each is ``{"source": <path relative to root>, "provenance": {...}, "rows": [one per side]}``.
    A bench result without a complete ``provenance`` raises :class:`BenchmarksPageError`
    naming the file; a JSON file of another shape (``figures.json``) is not a bench result.
    """
    runs = []
    for path in sorted(Path(bench_dir).rglob("*.json")):
        if path.name == FIGURES_FILE:
            continue
        data = _read_json(path, root)
        source = _rel(path, root)
        if not (isinstance(data, dict) and isinstance(data.get("sides"), dict) and "config" in data):
            raise BenchmarksPageError(f"{source}: not a ci/bench_gpu.py result (no 'config' and 'sides')")
        provenance = data.get("provenance")
        if not isinstance(provenance, dict):
            raise BenchmarksPageError(f"{source}: no 'provenance' object (machine, date, commit, command)")
        _check_provenance(provenance, f"{source} provenance")
        runs.append({"source": source, "provenance": provenance, "rows": bench_rows(data, source)})
    return runs


def load_figures(bench_dir: Path, root: Path) -> list[dict[str, Any]]:
    """The figures of ``bench_dir/figures.json``, each checked for its machine, date, commit and command."""
    path = Path(bench_dir) / FIGURES_FILE
    data = _read_json(path, root)
    figures = data.get("figures") if isinstance(data, dict) else None
    if not isinstance(figures, list):
        raise BenchmarksPageError(f"{_rel(path, root)}: expected an object with a 'figures' list")
    for i, figure in enumerate(figures):
        where = f"{_rel(path, root)} figures[{i}]"
        if not isinstance(figure, dict) or "value" not in figure or "what" not in figure:
            raise BenchmarksPageError(f"{where}: expected an object with 'what' and 'value'")
        _check_provenance(figure, where)
    return figures


def _short(commit: str) -> str:
    return f"`{commit[:7]}`" if commit else "–"


def _fmt(value: Any, spec: str) -> str:
    return "–" if value is None or value == "" else format(float(value), spec)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _figure_rows(figures: Sequence[Mapping[str, Any]], group: str) -> list[list[str]]:
    units = {"ratio": ".3f", "min": ".1f", "accuracy": ".1%", "GiB": ".2f"}
    rows = []
    for f in figures:
        if f.get("group") != group:
            continue
        value = _fmt(f["value"], units.get(str(f.get("unit")), "g"))
        value += {"min": " min", "GiB": " GiB"}.get(str(f.get("unit")), "")
        row = [str(f["what"]), f"**{value}**"]
        if group == "trl":
            row.append(f"{_fmt(f.get('trl_s_per_step'), '.3f')} / {_fmt(f.get('verity_s_per_step'), '.3f')}")
        row += [str(f["machine"]), f"{str(f['date'])[:10]}, {_short(str(f['commit']))}", f"`{f['command']}`"]
        row.append(f"`{f['report']}`" if f.get("report") else "–")
        rows.append(row)
    return rows


def _bench_sections(runs: Sequence[Mapping[str, Any]]) -> str:
    number = {run["source"]: i + 1 for i, run in enumerate(runs)}
    latest = latest_bench_rows([row for run in runs for row in run["rows"]])

    def ref(row: Mapping[str, Any]) -> str:
        return f"[{number[row['source']]}](#run-{number[row['source']]})"

    update, generate = [], []
    for row in latest:
        when = f"{str(row['date'])[:10]}, {_short(str(_provenance_of(runs, row)['commit']))}"
        tail = [str(row["device"]), when, ref(row)]
        shape = f"{row['rows']} x ({row['prompt_len']} + {row['response_len']})"
        error = "error: " + " ".join(str(row.get("error") or "").split()).replace("|", "/")[:80]
        if row["kind"] == "update":
            kernels = f"{row['sdpa']}, {row.get('head_kernels') or 'auto'}"
            mfu = f"{_fmt(row['mfu_vs_datasheet'], '.1%')} / {_fmt(row['mfu_vs_measured_matmul'], '.1%')}"
            figures = (
                [error, "–", "–"]
                if row.get("error")
                else [
                    f"{_fmt(row['median_seconds'], '.4f')} ({row['steps'] or '–'})",
                    mfu,
                    _fmt(row["max_memory_gib"], ".1f"),
                ]
            )
            update.append([f"`{row['side']}`", shape, str(row["micro_rows"]), kernels, *figures, *tail])
        else:
            figures = [error] if row.get("error") else [_fmt(row["tokens_per_s"], ",.0f")]
            generate.append([f"`{row['side']}`", shape, *figures, *tail])
    runs_list = []
    for run in runs:
        p, n = run["provenance"], number[run["source"]]
        runs_list.append(
            f'{n}. <a id="run-{n}"></a>`{run["source"]}` — {p["machine"]}; {str(p["date"])[:16].replace("T", " ")} UTC;'
            f" commit {_short(str(p['commit']))}; report `{p.get('report', '–')}`.\n"
            f"   Command: `{p['command']}`"
        )
    return (
        "## GPU: actor update MFU\n\n"
        "`ci/bench_gpu.py` on one device: a Qwen2.5-0.5B-shaped model, random init, full-length rows, bf16\n"
        "autocast over float32 master weights; s/step is the median of the timed steps after warm-up; MFU\n"
        "counts the model's FLOPs over the datasheet's bf16 peak and over the matmul rate measured at the\n"
        "start of the run. Each row is the newest run of its kind (side, shape, micro-batch rows, kernels)\n"
        "that timed at least three steps; every run is on the [hardware bench page](leaderboards/bench.html).\n\n"
        + _table(
            [
                "side",
                "rows x tokens",
                "micro-batch rows",
                "SDPA, head kernels",
                "s/step (timed steps)",
                "MFU datasheet / measured matmul",
                "peak GiB",
                "device",
                "date, commit",
                "run",
            ],
            update,
        )
        + "\n\n## GPU: generation tokens/s\n\n"
        "`generate-verity` is verity's HF rollout, `generate-hf` transformers' `generate` on the same prompts.\n\n"
        + _table(["side", "rows x tokens", "generated tokens/s", "device", "date, commit", "run"], generate)
        + "\n\n## Bench runs\n\n"
        "Each run's machine, date, commit and command (every flag it recorded, written out); where the\n"
        "run's JSON did not hold a field, its `provenance.recorded_from` says where it was taken from.\n\n"
        + "\n".join(runs_list)
    )


def _provenance_of(runs: Sequence[Mapping[str, Any]], row: Mapping[str, Any]) -> Mapping[str, Any]:
    return next(run["provenance"] for run in runs if run["source"] == row["source"])


def _baseline_classes(baseline: Any, source: str) -> list[tuple[str, Mapping[str, Any], Mapping[str, Any]]]:
    """``(machine class, accepted, figures)`` per machine class of ``ci/baseline.json``.

    Reads both layouts: one entry per machine class (``classes``) and the older single
    ``accepted`` + ``figures``.
    """
    if isinstance(baseline, dict) and isinstance(baseline.get("classes"), dict):
        entries = sorted(baseline["classes"].items())
    elif isinstance(baseline, dict) and "accepted" in baseline:
        entries = [("", baseline)]
    else:
        raise BenchmarksPageError(f"{source}: expected 'classes', or 'accepted' and 'figures'")
    out = []
    for name, entry in entries:
        accepted = entry.get("accepted") if isinstance(entry, dict) else None
        figures = entry.get("figures") if isinstance(entry, dict) else None
        if not isinstance(accepted, dict) or not isinstance(figures, dict):
            raise BenchmarksPageError(
                f"{source} {name or ''}: expected 'accepted' and 'figures' objects".strip()
            )
        out.append((str(name), accepted, figures))
    return out


def _nightly_section(baseline: Any, source: str) -> str:
    parts = [
        "## The nightly's accepted figures\n\n"
        f"`{source}`: the figures a night is compared with, per machine class (ratios measured side by\n"
        f"side on one machine). Command: `{NIGHTLY_COMMAND}`, accepted with `python -m ci.nightly --accept-report`."
        + (f" Rule: {baseline['rule']}." if isinstance(baseline.get("rule"), str) else "")
    ]
    for name, accepted, figures in _baseline_classes(baseline, source):
        machine = accepted.get("machine") or {}
        machine_text = (
            f"{machine.get('hardware', '?')} ({machine.get('device_name', '?')}, {machine.get('cpu_isa', '?')}, "
            f"{machine.get('logical_cpus', '?')} logical CPUs)"
            if isinstance(machine, dict)
            else str(machine)
        )
        where = f"{source} {name}".strip()
        record = {
            "machine": machine_text if machine else "",
            "date": accepted.get("date"),
            "commit": accepted.get("commit"),
            "command": NIGHTLY_COMMAND,
        }
        _check_provenance(record, f"{where} accepted")
        rows = []
        for figure_name in sorted(figures):
            figure = (
                figures[figure_name]
                if isinstance(figures[figure_name], dict)
                else {"value": figures[figure_name]}
            )
            limit = (
                f">= {figure['min_ratio']} x accepted"
                if "min_ratio" in figure
                else f"<= {figure['max_ratio']} x accepted"
                if "max_ratio" in figure
                else None
            )
            rows.append([f"`{figure_name}`", _fmt(figure.get("value"), ".4g")] + ([limit] if limit else []))
        head = ["figure", "accepted"] + (["a night must keep"] if any(len(r) == 3 for r in rows) else [])
        rows = [r + ["–"] * (len(head) - len(r)) for r in rows]
        recorded = machine.get("recorded_from") if isinstance(machine, dict) else None
        parts.append(
            (f"### {name}\n\n" if name else "")
            + f"Machine: {machine_text}; date: {accepted['date']}; commit {_short(str(accepted['commit']))}."
            + (f" The machine was recorded from: {recorded}." if recorded else "")
            + "\n\n"
            + _table(head, rows)
        )
    return "\n\n".join(parts)


HEAD = """# Benchmarks

*Generated by `nox -s leaderboard` (`harness/src/verity_harness/leaderboard/benchmarks_page.py`) from
the committed results in `leaderboards/bench/` and `ci/baseline.json`: edit those, not this page.*

Every figure here comes from a committed result file and names the machine, date, commit and
command that produced it. The history of how they got here is in the [changelog](changelog.md);
each measurement's write-up is its report under `ci/reports/`.

## Leaderboards: the recipes, run after run

The harness writes one result file per run (`leaderboards/results/<recipe>/<date>-<hardware>-<backend>.json`)
and `nox -s leaderboard` rebuilds static pages from them, copied into this site:

- [all recipes](leaderboards/index.html) — per recipe, the newest run of each (config,
  hardware, backend): score, gain, verdict against the expected file, tokens/s, MFU, nodes,
  date, commit;
- one page per recipe with its accuracy, reward and throughput curves:
  [GRPO](leaderboards/grpo.html), [PPO](leaderboards/ppo.html), [RLOO](leaderboards/rloo.html),
  [DAPO](leaderboards/dapo.html), [PRIME](leaderboards/prime.html), [VLM](leaderboards/vlm.html);
- [hardware bench](leaderboards/bench.html) — every `ci/bench_gpu.py` run under `leaderboards/bench/`.

What each recipe must reach is its expected file (`recipes/*/src/*/expected/*.yaml`,
[Recipes, "Expected files"](recipes.md#expected-files)).
"""

TAIL = """## Running them yourself

```bash
nox -s recipe-grpo        # a recipe's CPU config, checked against its expected file (also -ppo, -rloo, -dapo, -prime, -vlm)
nox -s nightly            # every recipe's CPU configs + ci/bench.py + ci/bench_trl.py against ci/baseline.json
nox -s bench-trl          # verity's GRPO step beside TRL's GRPOTrainer on the same work
python -m ci.bench_gpu    # on a GPU: the actor update's MFU and the rollout's tokens/s
nox -s leaderboard        # rebuild the leaderboard pages and this page from the committed results
```

A new `ci/bench_gpu.py` result joins this page when its JSON, with a `provenance` object
(`machine`, `date`, `commit`, `command`, `report`), is committed under `leaderboards/bench/<session>/`
and `nox -s leaderboard` is run.
"""


def render_benchmarks_page(root: Path, bench_dir: Path = BENCH_DIR, baseline: Path = BASELINE) -> str:
    """The Markdown of ``docs/benchmarks.md`` from the committed sources under ``root`` (the repository).

    ``bench_dir`` and ``baseline`` are relative to ``root`` (or absolute). Raises
    :class:`BenchmarksPageError` naming the file when a source lacks a figure's machine, date,
    commit or command.
    """
    root = Path(root)
    bench = bench_dir if Path(bench_dir).is_absolute() else root / bench_dir
    base = baseline if Path(baseline).is_absolute() else root / baseline
    figures = load_figures(bench, root)
    runs = load_bench_runs(bench, root)
    trl = _table(
        [
            "pair",
            "TRL ÷ verity",
            "TRL / verity s/step",
            "machine",
            "date, commit",
            "command",
            "report",
        ],
        _figure_rows(figures, "trl"),
    )
    other = _table(
        ["what", "figure", "machine", "date, commit", "command", "report"],
        _figure_rows(figures, "nightly") + _figure_rows(figures, "gpu"),
    )
    parts = [
        HEAD,
        "## Side by side with TRL\n\n"
        "verity's GRPO step beside TRL's `GRPOTrainer` on the same work (same model folder, prompts, chat\n"
        'template, batch, learning rate, reward: [Recipes, "Side by side with TRL"](recipes.md#side-by-side-with-trl)),\n'
        "measured in the nightly. CPU timings move with the machine and its load; compare ratios measured\n"
        "side by side, not seconds across days.\n\n" + trl,
        _bench_sections(runs),
        "## Memory per worker\n\n"
        "Per-worker peak memory of a GRPO run (actor, reference and colocated HF rollout in each worker) "
        "as the\nworkers double, measured (resident-set high-water mark on a CPU) beside the memory plan's "
        "estimate;\n`python -m ci.bench_memory_scaling` runs the 1, 2 and 4-worker runs side by side.\n\n"
        + _table(
            ["what", "figure", "machine", "date, commit", "command", "report"],
            _figure_rows(figures, "memory"),
        ),
        "## Tensor-parallel rollout\n\n"
        "The HF rollout split over a replica of ranks (`rollout.tensor_parallel_size`) beside whole-model "
        "replicas on the\nsame ranks and the same prompts, measured side by side in one run; "
        "`transformers`' `generate` is the peer.\n\n"
        + _table(
            ["what", "figure", "machine", "date, commit", "command", "report"],
            _figure_rows(figures, "rollout"),
        ),
        "## Long traces\n\n"
        "Long-tailed response lengths: packed sequences (`fsdp2.packed`), token-balanced ranks\n"
        "(`balance_tokens`) and Ulysses sequence parallelism, each beside the padded layout or the peer on the\n"
        "same rows, measured side by side in one run.\n\n"
        + _table(
            ["what", "figure", "machine", "date, commit", "command", "report"],
            _figure_rows(figures, "long_traces"),
        ),
        "## Agent rollouts\n\n"
        "Multi-turn rollouts at request level (each trajectory's next turn submitted when its tools answer) "
        "beside the\nturn-synchronous barrier, the HF engine's continuous-batching scheduler beside `generate` "
        "in waves, and\ngeneration balanced over replicas by load beside the equal split, each measured side "
        "by side in one run.\n\n"
        + _table(
            ["what", "figure", "machine", "date, commit", "command", "report"],
            _figure_rows(figures, "agents"),
        ),
        "## Mixture of experts\n\n"
        "The Megatron engine's MoE update at expert parallelism 2 beside 1 on the same rows, and MFU counted on "
        "the\nparameters a token runs through beside all of them.\n\n"
        + _table(
            ["what", "figure", "machine", "date, commit", "command", "report"],
            _figure_rows(figures, "moe"),
        ),
        "## The nightly and the quickstart\n\n" + other,
        _nightly_section(_read_json(base, root), _rel(base, root)),
        TAIL,
    ]
    return "\n\n".join(p.strip("\n") for p in parts) + "\n"


def write_benchmarks_page(
    out: Path, root: Path, bench_dir: Path = BENCH_DIR, baseline: Path = BASELINE
) -> Path:
    """Write :func:`render_benchmarks_page` to ``out`` and return it."""
    out = Path(out)
    out.write_text(render_benchmarks_page(root, bench_dir, baseline), encoding="utf-8")
    return out
