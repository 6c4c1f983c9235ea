"""ci/nightly.py: the baseline comparison, the report, and a planted regression failing with its metric named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.ci_scripts import load_ci_script

ROOT = Path(__file__).resolve().parents[2]


nightly = load_ci_script("nightly")

XEON = {"hardware": "cpu-intel-xeon", "device_name": "Intel(R) Xeon(R) Processor", "cpu_isa": "amx_bf16",
        "logical_cpus": 2}  # fmt: skip
EPYC = {"hardware": "cpu-amd-epyc", "device_name": "AMD EPYC", "cpu_isa": "avx512_bf16", "logical_cpus": 2}
EPYC_CLASS = "cpu-amd-epyc/avx512_bf16"

FIGURES = {
    "bench.train_vs_plain_torch": {"value": 0.8, "rounds": [0.79, 0.8, 0.81]},
    "bench.weight_sync_vs_load_state_dict": {"value": 1.0},
    "grpo.accuracy_gain": {"value": 0.4, "allowed_drop": 0.06},
    "grpo.tokens_per_s_vs_plain_torch": {"value": 0.5},
}
ACCEPTED = {"accepted": {"date": "2026-11-25", "machine": EPYC}, "figures": FIGURES}
BASELINE = {"classes": {EPYC_CLASS: ACCEPTED}}


def _recipe(gain: float, tokens_per_s: float = 5000.0, passed: bool = True) -> dict[str, Any]:
    check = {
        "metric": "accuracy_gain",
        "value": gain,
        "target": 0.4,
        "tolerance": 0.1,
        "mode": "at_least",
        "passed": passed,
        "reason": "" if passed else f"accuracy_gain {gain} < 0.3",
    }
    return {
        "scores": {"accuracy_gain": gain, "accuracy_before": 0.5, "accuracy_after": 0.5 + gain},
        "throughput": {"tokens_per_s": tokens_per_s},
        "checks": [check],
        "exit_code": 0 if passed else 1,
    }


def _bench(train_ratio: float = 0.8, sync_ratio: float = 1.0) -> dict[str, Any]:
    jitter = (0.99, 1.0, 1.01)
    return {
        "ratios": {"train_vs_plain_torch": train_ratio, "weight_sync_vs_load_state_dict": sync_ratio},
        "ratio_rounds": {
            "train_vs_plain_torch": [train_ratio * j for j in jitter],
            "weight_sync_vs_load_state_dict": [sync_ratio * j for j in jitter],
        },
        "train": {"plain_torch_tokens_per_s": 10_000.0},
        "exit_code": 0,
    }


def _failing(findings: list) -> list[str]:
    return [f.metric for f in findings if not f.ok]


def _compare(recipes: dict, bench: dict) -> list:
    return nightly.compare_with_baseline(recipes, bench, ACCEPTED, EPYC_CLASS)


def test_a_good_night_passes_every_figure() -> None:
    findings = _compare({"grpo": _recipe(0.42)}, _bench())
    assert _failing(findings) == []
    by_metric = {f.metric: f for f in findings}
    # no run directory: one value, no rounds; information only, so not in the verdict either way
    assert by_metric["grpo.tokens_per_s_vs_plain_torch"].value == pytest.approx(0.5)
    assert by_metric["grpo.tokens_per_s_vs_plain_torch"].threshold == "info"
    gain = by_metric["grpo.accuracy_gain"]
    assert gain.allowed_drop == pytest.approx(0.1)  # tonight's expected-file tolerance
    assert "the accepted night kept no accuracy_before" in gain.note
    assert by_metric["bench.train_vs_plain_torch"].machine_class == EPYC_CLASS


def test_a_rows_rounds_are_blocks_of_its_steps(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    steps = [100.0] + [5000.0 + 10 * (i % 3) for i in range(20)]  # step 1 (start-up) is left out
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"perf/tokens_per_s": v}) + "\n" for v in steps)
    )
    row = {**_recipe(0.42), "run_dir": str(run_dir)}
    findings = {f.metric: f for f in _compare({"grpo": row}, _bench())}
    tps = findings["grpo.tokens_per_s_vs_plain_torch"]
    assert len(tps.rounds) == 5 and tps.ok and tps.value == pytest.approx(0.5, rel=0.01)
    assert tps.spread is not None and tps.threshold == "info"  # measured and kept, not gated


def test_the_gain_gate_uses_the_seed_spread_on_the_accepted_warm_start_build() -> None:
    def row(gain: float, before: float) -> dict[str, Any]:
        r = _recipe(gain)
        r["scores"]["accuracy_before"] = before
        r["checks"][0]["seed_spread"] = 0.01
        return r

    accepted = {**ACCEPTED, "figures": {**FIGURES, "grpo.accuracy_gain": {"value": 0.4, "allowed_drop": 0.1,
                                                                          "accuracy_before": 0.5}}}  # fmt: skip

    def gain(recipe: dict[str, Any]) -> Any:
        findings = nightly.compare_with_baseline({"grpo": recipe}, _bench(), accepted, EPYC_CLASS)
        return next(f for f in findings if f.metric == "grpo.accuracy_gain")

    assert not gain(row(0.36, 0.5)).ok  # same build: 0.4 - max(3 x 0.01, 0.02) = 0.37
    assert gain(row(0.38, 0.5)).ok
    other = gain(row(0.36, 0.48))  # another build: the tolerance 0.1
    assert other.ok and "another warm-start build" in other.note
    figure = nightly.tonight_figures({"grpo": row(0.38, 0.5)}, {})["grpo.accuracy_gain"]
    assert (figure.seed_spread, figure.accuracy_before) == (0.01, 0.5)


def test_a_lost_gain_fails_both_the_expected_file_and_the_baseline() -> None:
    findings = _compare({"grpo": _recipe(0.0, passed=False)}, _bench())
    assert _failing(findings)[:2] == ["grpo.accuracy_gain (expected file)", "grpo.accuracy_gain"]


def test_ratios_regress_in_their_own_direction() -> None:
    slow_train = _compare({}, _bench(train_ratio=0.7))  # 12.5% below 0.8: past the 5% floor
    assert _failing(slow_train) == ["bench.train_vs_plain_torch"]
    slow_sync = _compare({}, _bench(sync_ratio=1.2))
    assert _failing(slow_sync) == ["bench.weight_sync_vs_load_state_dict"]
    # a faster weight sync is never a regression, nor a small move inside the floor
    assert _failing(_compare({}, _bench(sync_ratio=0.1))) == []
    assert _failing(_compare({}, _bench(train_ratio=0.77))) == []


def test_a_crashed_run_and_a_missing_figure_fail() -> None:
    crashed = {"exit_code": 2}
    findings = _compare({"grpo": crashed}, {"exit_code": 3})
    failing = _failing(findings)
    assert "grpo.run" in failing and "bench.run" in failing
    assert "grpo.accuracy_gain" in failing  # not measured tonight


def test_a_class_without_a_baseline_compares_nothing() -> None:
    findings = nightly.compare_with_baseline({"grpo": _recipe(0.0)}, _bench(train_ratio=0.1), None, "x/none")
    figures = [f for f in findings if "expected file" not in f.metric]
    assert figures and all(f.ok and "no accepted value for this machine class" in f.note for f in figures)


def _run_dir(folder: Path, tokens_per_s: float = 5000.0, steps: int = 21) -> str:
    """A run directory whose metrics.jsonl holds ``steps`` steps at about ``tokens_per_s``."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"perf/tokens_per_s": tokens_per_s * (1 + 0.01 * (i % 3 - 1))} for i in range(steps)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def _fake_night(
    monkeypatch: pytest.MonkeyPatch, seen: dict[str, Any], tmp_path: Path, machine: dict = EPYC
) -> None:
    def fake_run_recipe(
        name: str, out: Path, results_dir: Path, overrides: list[str], config: str = "cpu"
    ) -> dict[str, Any]:
        seen.update(name=name, results_dir=results_dir, overrides=list(overrides))
        seen["slow"] = nightly.os.environ.get("VERITY_TEST_SLOW_STAGE")
        lr0 = "actor.optim.lr=0" in overrides
        return {**_recipe(0.0 if lr0 else 0.42, passed=not lr0), "run_dir": _run_dir(tmp_path / "run")}

    monkeypatch.setattr(nightly, "run_recipe", fake_run_recipe)
    monkeypatch.setattr(nightly, "run_bench", lambda out: _bench())
    monkeypatch.setattr(nightly, "this_machine", lambda: machine)
    monkeypatch.setattr(nightly.subprocess, "call", lambda cmd, cwd=None: 0)  # the leaderboard build
    monkeypatch.delenv("VERITY_TEST_SLOW_STAGE", raising=False)


def _args(tmp_path: Path, baseline: Path) -> list[str]:
    out = str(tmp_path / "night")
    return ["--recipes", "grpo", "--configs", "cpu", "--skip-trl", "--baseline", str(baseline), "--out", out]


def test_a_planted_regression_exits_1_naming_the_metric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(BASELINE))
    seen: dict[str, Any] = {}
    _fake_night(monkeypatch, seen, tmp_path)
    args = _args(tmp_path, baseline)

    assert nightly.main(args + ["--override", "actor.optim.lr=0", "--accept"]) == 1
    err = capsys.readouterr().err
    assert "REGRESSION in grpo.accuracy_gain (expected file), grpo.accuracy_gain" in err
    assert "not accepting" in err
    assert seen["results_dir"] == tmp_path / "night" / "results"  # planted runs stay out of leaderboards/
    assert json.loads(baseline.read_text()) == BASELINE  # nothing already accepted is lost
    report = (tmp_path / "night" / "report.md").read_text()
    assert "REGRESSION" in report and "| grpo.accuracy_gain | 0 |  | - | 0.4 | 0 | 0.1 | >= 0.3 " in report


def test_plant_slowdown_reaches_every_process_and_is_never_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(BASELINE))
    seen: dict[str, Any] = {}
    _fake_night(monkeypatch, seen, tmp_path)
    args = _args(tmp_path, baseline)
    nightly.main(args + ["--plant-slowdown", "update_actor:0.1", "--accept"])
    assert seen["slow"] == "update_actor:0.1"
    assert "not accepting" in capsys.readouterr().err
    report = json.loads((tmp_path / "night" / "report.json").read_text())
    assert report["planted_slowdown"] == ["update_actor:0.1"]
    assert json.loads(baseline.read_text()) == BASELINE
    nightly.os.environ.pop("VERITY_TEST_SLOW_STAGE", None)
    assert (
        nightly.main(args + ["--plant-slowdown", "update_actor"]) == 2
    )  # no fraction: refused before running
    assert "update_actor" in capsys.readouterr().err


def test_a_night_on_a_new_machine_class_proposes_a_baseline_beside_the_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline = tmp_path / "baseline.json"
    xeon_only = {"classes": {"cpu-intel-xeon/amx_bf16": {**ACCEPTED, "accepted": {"machine": XEON}}}}
    baseline.write_text(json.dumps(xeon_only))
    _fake_night(monkeypatch, {}, tmp_path)
    args = _args(tmp_path, baseline)
    assert nightly.main(args) == 0
    night = tmp_path / "night"
    text = (night / "report.md").read_text()
    assert f"**No baseline for machine class `{EPYC_CLASS}`**" in text
    assert "**FAIL**" not in text
    proposed = json.loads((night / "proposed-baseline.json").read_text())
    assert proposed["classes"]["cpu-intel-xeon/amx_bf16"] == xeon_only["classes"]["cpu-intel-xeon/amx_bf16"]
    epyc = proposed["classes"][EPYC_CLASS]
    assert epyc["figures"]["bench.train_vs_plain_torch"]["rounds"] == [0.792, 0.8, 0.808]
    assert epyc["figures"]["grpo.accuracy_gain"] == {
        "value": 0.42,
        "allowed_drop": 0.1,
        "accuracy_before": 0.5,
    }
    assert epyc["accepted"]["machine"] == EPYC
    assert json.loads(baseline.read_text()) == xeon_only  # proposing writes nothing into the baseline
    report = json.loads((night / "report.json").read_text())
    assert report["machine_class"] == EPYC_CLASS and report["has_baseline"] is False
    figure = report["figures"]["bench.train_vs_plain_torch"]
    assert figure["value"] == 0.8 and figure["spread"] == pytest.approx(0.008)

    # accepting the report writes the same class entry, the Intel one untouched
    assert nightly.main(["--accept-report", str(night / "report.json"), "--baseline", str(baseline)]) == 0
    accepted = json.loads(baseline.read_text())
    assert accepted["classes"][EPYC_CLASS]["figures"] == epyc["figures"]
    assert accepted["classes"]["cpu-intel-xeon/amx_bf16"] == xeon_only["classes"]["cpu-intel-xeon/amx_bf16"]
    # the next night on this class is compared with it
    assert nightly.main(args) == 0
    assert "No baseline" not in (night / "report.md").read_text()


def test_the_night_runs_every_cpu_config_of_each_recipe(tmp_path: Path) -> None:
    for recipe, configs in {
        "grpo": ["cpu", "cpu-vllm", "gsm8k-x", "cpu-megatron"],
        "ppo": ["gsm8k-x"],
    }.items():
        folder = tmp_path / recipe / "src" / f"verity_recipe_{recipe}" / "configs"
        folder.mkdir(parents=True)
        for c in configs:
            (folder / f"{c}.yaml").write_text("{}\n")
    assert nightly.nightly_rows(tmp_path, ["grpo"]) == [
        ("grpo", "cpu"),
        ("grpo", "cpu-megatron"),
        ("grpo", "cpu-vllm"),
    ]
    assert nightly.nightly_rows(tmp_path, ["grpo"], ["cpu-vllm"]) == [("grpo", "cpu-vllm")]
    assert [nightly.row_name(*r) for r in nightly.nightly_rows(tmp_path, ["grpo"])] == [
        "grpo",
        "grpo/cpu-megatron",
        "grpo/cpu-vllm",
    ]
    with pytest.raises(ValueError, match=r"recipe 'ppo' has no config cpu or cpu-\* .*it has: none"):
        nightly.nightly_rows(tmp_path, ["ppo"])


def test_the_real_recipes_each_have_a_cpu_row() -> None:
    rows = nightly.nightly_rows(nightly.ROOT / "recipes", nightly.recipe_names(nightly.ROOT / "recipes"))
    assert {r for r, c in rows if c == "cpu"} == set(nightly.recipe_names(nightly.ROOT / "recipes"))


def test_the_night_runs_grpo_on_two_nodes() -> None:
    # found like any cpu-* config; the harness simulates its 2 nodes (verity_harness.simulated_cluster)
    rows = nightly.nightly_rows(nightly.ROOT / "recipes", ["grpo"])
    assert ("grpo", "cpu-2node") in rows and nightly.row_name("grpo", "cpu-2node") == "grpo/cpu-2node"


def test_the_night_runs_the_trl_quickstart_shape_unless_asked_for_more(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(nightly.subprocess, "call", lambda cmd, cwd=None: calls.append(cmd) or 3)
    assert nightly.run_bench_trl(tmp_path) == {"exit_code": 3}
    assert calls[-1][calls[-1].index("--shapes") + 1] == "quickstart"
    nightly.run_bench_trl(tmp_path, "quickstart,512x8")
    assert calls[-1][calls[-1].index("--shapes") + 1] == "quickstart,512x8"
    # both pairs alternate three rounds (a median each side; the gate reads their spread)
    rounds = [i for i, arg in enumerate(calls[-1]) if arg == "--rounds"]
    assert [calls[-1][i + 1] for i in rounds] == ["3"]
    nightly.run_bench_trl(tmp_path, args=nightly.NIGHTLY_COMPUTE_BOUND_ARGS)
    rounds = [i for i, arg in enumerate(calls[-1]) if arg == "--rounds"]
    assert calls[-1][rounds[-1] + 1] == "3"  # the last one is what argparse keeps


def _report(
    tmp_path: Path, findings: list[dict], overrides: list[str] | None = None, machine: dict | None = None
) -> Path:
    report = {
        "findings": findings,
        "recipes": {"grpo": {"scores": {"accuracy_gain": 0.4}, "git_commit": "abc123"}},
        "bench": {"ratios": {"grpo_step_vs_trl_quickstart": 1.05}},
        "overrides": overrides or [],
        "machine": machine,
    }
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def test_accept_report_writes_its_machine_class_and_keeps_the_rest(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(BASELINE))
    report = _report(tmp_path, [{"metric": "grpo.accuracy_gain", "ok": True}], machine=EPYC)
    assert nightly.main(["--accept-report", str(report), "--baseline", str(baseline)]) == 0
    new = json.loads(baseline.read_text())["classes"][EPYC_CLASS]
    assert new["figures"]["grpo.accuracy_gain"] == {"value": 0.4}  # a report from before figures kept rounds
    assert new["figures"]["bench.grpo_step_vs_trl_quickstart"] == {"value": 1.05}
    assert new["figures"]["bench.train_vs_plain_torch"] == FIGURES["bench.train_vs_plain_torch"]  # kept
    assert new["accepted"]["commit"] == "abc123" and new["accepted"]["machine"] == EPYC


@pytest.mark.parametrize("failed", [True, False])
def test_accept_report_refuses_a_failed_or_planted_night(tmp_path: Path, failed: bool, capsys) -> None:
    baseline = tmp_path / "baseline.json"
    baseline.write_text("{}")
    if failed:
        report = _report(tmp_path, [{"metric": "grpo.accuracy_gain", "ok": False}])
    else:
        report = _report(tmp_path, [], overrides=["actor.optim.lr=0"])
    assert nightly.main(["--accept-report", str(report), "--baseline", str(baseline)]) == 2
    assert baseline.read_text() == "{}"
    assert "not accepting" in capsys.readouterr().err
    assert nightly.main(["--accept-report", str(tmp_path / "nope.json"), "--baseline", str(baseline)]) == 2


def test_a_baseline_in_the_old_single_machine_layout_is_refused_with_a_sentence(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"figures": FIGURES}))
    assert nightly.main(["--recipes", "grpo", "--baseline", str(baseline), "--out", str(tmp_path / "o")]) == 2
    assert "expected a baseline file with a 'classes' object" in capsys.readouterr().err


@pytest.mark.parametrize("accepted_on", ["same", "other_cores"])
def test_the_report_names_the_machine_and_flags_speed_figures_on_another_machine_of_the_class(
    tmp_path: Path, accepted_on: str
) -> None:
    accepted_machine = {"same": EPYC, "other_cores": {**EPYC, "logical_cpus": 8}}[accepted_on]
    findings = _compare({"grpo": _recipe(0.42)}, _bench())
    nightly.note_other_machine(findings, EPYC, accepted_machine)
    notes = {f.metric: f.note for f in findings}
    flagged = sorted(m for m, note in notes.items() if "accepted on another machine" in note)
    speed = [
        "bench.train_vs_plain_torch",
        "bench.weight_sync_vs_load_state_dict",
        "grpo.tokens_per_s_vs_plain_torch",
    ]
    assert flagged == ([] if accepted_on == "same" else speed)

    report = nightly.write_report(tmp_path, findings, {}, {}, [], 60.0, EPYC, accepted_machine)
    text = report.read_text()
    assert f"machine class: `{EPYC_CLASS}`" in text
    assert "machine: cpu-amd-epyc (AMD EPYC, avx512_bf16, 2 logical CPUs); accepted night's: " in text
    other_line = [line for line in text.splitlines() if line.startswith("**Another machine")]
    if accepted_on == "same":
        assert other_line == []
    else:
        assert other_line and "logical_cpus: 2, accepted 8" in other_line[0]
    doc = json.loads((tmp_path / "report.json").read_text())
    assert doc["machine"] == EPYC
    train = next(f for f in doc["findings"] if f["metric"] == "bench.train_vs_plain_torch")
    assert set(train) >= {"value", "rounds", "spread", "baseline", "allowed_drop", "ok", "machine_class"}


# A night on a class with no baseline of its own, judged against the committed baselines and moves
# (ci/baseline.json, ci/cross_class.json): the nightly a fresh clone runs on such a machine.
AVX2_EPYC = {"hardware": "cpu-amd-epyc", "device_name": "AMD EPYC", "cpu_isa": "avx2", "logical_cpus": 2}
COMMITTED_BASELINE = ROOT / "ci" / "baseline.json"
COMMITTED_MOVES = ROOT / "ci" / "cross_class.json"


def _unseen_night(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    machine: dict,
    update_slowdown: float = 0.0,
    gain: float = 0.422,
    classes: list[str] | None = None,
) -> tuple[int, dict[str, Any], str]:
    """One fake night on ``machine`` against the committed baselines (only ``classes``' when given).

    The bench reads the nearest class's accepted ratios, the training pair's slowed by
    ``update_slowdown`` (its verity side is the update stage); grpo's gain is ``gain`` on a
    warm-start build of its own (accuracy before 0.516). Returns the exit code, report.json, report.md.
    """
    doc = json.loads(COMMITTED_BASELINE.read_text())
    if classes is not None:
        doc["classes"] = {k: v for k, v in doc["classes"].items() if k in classes}
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(doc))
    nearest, _ = nightly.nearest_class(nightly.machine_class(machine), doc["classes"])
    accepted = doc["classes"][nearest]["figures"]
    train = accepted["bench.train_vs_plain_torch"]["value"] / (1 + update_slowdown)
    bench = _bench(train, accepted["bench.weight_sync_vs_load_state_dict"]["value"])
    row = _recipe(gain)
    row["scores"].update(accuracy_before=0.516, accuracy_after=0.516 + gain)
    row["checks"][0].update(tolerance=0.06, seed_spread=0.01)  # grpo's expected file
    monkeypatch.setattr(nightly, "run_recipe", lambda *a, **k: row)
    monkeypatch.setattr(nightly, "run_bench", lambda out: bench)
    monkeypatch.setattr(nightly, "this_machine", lambda: machine)
    monkeypatch.setattr(nightly.subprocess, "call", lambda cmd, cwd=None: 0)
    code = nightly.main(_args(tmp_path, baseline) + ["--cross-class", str(COMMITTED_MOVES)])
    night = tmp_path / "night"
    return code, json.loads((night / "report.json").read_text()), (night / "report.md").read_text()


def test_an_unchanged_night_on_a_new_class_is_judged_against_the_nearest_and_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code, report, text = _unseen_night(tmp_path, monkeypatch, AVX2_EPYC)
    assert code == 0, [f["metric"] for f in report["findings"] if not f["ok"]]
    assert report["has_baseline"] is False and report["compared_with"] == EPYC_CLASS
    assert "the same CPU maker" in report["compared_with_why"]
    judged = {f["metric"]: f for f in report["findings"] if f.get("compared_with") == EPYC_CLASS}
    assert judged["bench.train_vs_plain_torch"]["allowed_drop"] is not None  # judged, not only shown
    assert judged["grpo.accuracy_gain"]["allowed_drop"] is not None
    assert f"its figures were judged against `{EPYC_CLASS}`, the nearest accepted class" in text
    assert (tmp_path / "night" / "proposed-baseline.json").is_file()  # it still proposes its own


def test_a_planted_update_slowdown_on_a_new_class_is_caught_naming_the_class_compared_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, text = _unseen_night(tmp_path, monkeypatch, AVX2_EPYC, update_slowdown=0.10)
    assert code == 1
    assert "REGRESSION in bench.train_vs_plain_torch" in capsys.readouterr().err
    failed = [f for f in report["findings"] if not f["ok"]]
    assert [f["metric"] for f in failed] == ["bench.train_vs_plain_torch"]
    assert failed[0]["compared_with"] == EPYC_CLASS and f"judged against {EPYC_CLASS}" in failed[0]["note"]
    assert "**FAIL**" in text and f"judged against `{EPYC_CLASS}`" in text


def test_a_halved_learning_rate_on_a_new_class_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # grpo's gain with actor.optim.lr halved: 0.362 (ci/reports/2026-11-28-nightly-gates.md, night D)
    code, report, _ = _unseen_night(tmp_path, monkeypatch, AVX2_EPYC, gain=0.362)
    assert code == 1
    assert [f["metric"] for f in report["findings"] if not f["ok"]] == ["grpo.accuracy_gain"]


@pytest.mark.parametrize(
    ("slowdown", "gain", "failing"),
    [(0.0, 0.422, []), (0.10, 0.362, ["bench.train_vs_plain_torch", "grpo.accuracy_gain"])],
)
def test_with_only_the_intel_class_accepted_an_epyc_night_is_judged_against_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, slowdown: float, gain: float, failing: list[str]
) -> None:
    code, report, _ = _unseen_night(
        tmp_path, monkeypatch, EPYC, slowdown, gain, classes=["cpu-intel-xeon/amx_bf16"]
    )
    assert report["compared_with"] == "cpu-intel-xeon/amx_bf16"
    assert [f["metric"] for f in report["findings"] if not f["ok"]] == failing
    assert code == (1 if failing else 0)


def test_a_gpu_class_without_a_baseline_compares_nothing_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = {"hardware": "h200", "device_name": "NVIDIA H200", "cpu_isa": None, "logical_cpus": 16}
    _fake_night(monkeypatch, {}, tmp_path, machine=gpu)
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(BASELINE))
    assert nightly.main(_args(tmp_path, baseline)) == 0
    text = (tmp_path / "night" / "report.md").read_text()
    why = "h200/none is not a CPU class and the cross-class moves were measured on CPUs only"
    assert f"no class was compared with ({why}), so its figures were not judged" in text
    assert "**FAIL**" not in text
