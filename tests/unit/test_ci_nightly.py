"""ci/nightly.py: the baseline comparison, the report, and a planted regression failing with its metric named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.ci_scripts import load_ci_script

ROOT = Path(__file__).resolve().parents[2]


nightly = load_ci_script("nightly")

BASELINE = {
    "figures": {
        "bench.train_vs_plain_torch": {"value": 0.8, "min_ratio": 0.7},
        "bench.weight_sync_vs_load_state_dict": {"value": 1.0, "max_ratio": 2.0},
        "grpo.accuracy_gain": {"value": 0.4, "min_ratio": 0.5},
        "grpo.tokens_per_s_vs_plain_torch": {"value": 0.5, "min_ratio": 0.5},
    }
}


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
    return {
        "ratios": {"train_vs_plain_torch": train_ratio, "weight_sync_vs_load_state_dict": sync_ratio},
        "train": {"plain_torch_tokens_per_s": 10_000.0},
        "exit_code": 0,
    }


def _failing(findings: list) -> list[str]:
    return [f.metric for f in findings if not f.ok]


def test_a_good_night_passes_every_figure() -> None:
    findings = nightly.compare_with_baseline({"grpo": _recipe(0.42)}, _bench(), BASELINE)
    assert _failing(findings) == []
    by_metric = {f.metric: f for f in findings}
    assert by_metric["grpo.tokens_per_s_vs_plain_torch"].value == pytest.approx(0.5)
    assert by_metric["grpo.accuracy_gain"].ratio == pytest.approx(0.42 / 0.4)


def test_a_lost_gain_fails_both_the_expected_file_and_the_baseline() -> None:
    findings = nightly.compare_with_baseline({"grpo": _recipe(0.0, passed=False)}, _bench(), BASELINE)
    assert _failing(findings) == ["grpo.accuracy_gain (expected file)", "grpo.accuracy_gain"]


def test_ratios_regress_in_their_own_direction() -> None:
    slow_train = nightly.compare_with_baseline({}, _bench(train_ratio=0.5), BASELINE)
    assert _failing(slow_train) == ["bench.train_vs_plain_torch"]
    slow_sync = nightly.compare_with_baseline({}, _bench(sync_ratio=2.5), BASELINE)
    assert _failing(slow_sync) == ["bench.weight_sync_vs_load_state_dict"]
    # a faster weight sync is never a regression
    assert _failing(nightly.compare_with_baseline({}, _bench(sync_ratio=0.1), BASELINE)) == []


def test_a_crashed_run_and_a_missing_figure_fail() -> None:
    crashed = {"exit_code": 2}
    findings = nightly.compare_with_baseline({"grpo": crashed}, {"exit_code": 3}, BASELINE)
    failing = _failing(findings)
    assert "grpo.run" in failing and "bench.run" in failing
    assert "grpo.accuracy_gain" in failing  # not measured tonight


def test_accepting_keeps_thresholds_and_adds_defaults() -> None:
    figures = {"grpo.accuracy_gain": 0.41234, "ppo.accuracy_gain": 0.3, "bench.weight_sync_x": 1.2, "y": None}
    new = nightly.accepted_baseline(figures, BASELINE, "abc123")
    assert new["accepted"]["commit"] == "abc123"
    assert new["figures"]["grpo.accuracy_gain"] == {"value": 0.4123, "min_ratio": 0.5}
    assert new["figures"]["ppo.accuracy_gain"] == {"value": 0.3, "min_ratio": 0.5}
    assert new["figures"]["bench.weight_sync_x"] == {"value": 1.2, "max_ratio": 2.0}
    assert "y" not in new["figures"]


def test_accepting_part_of_a_night_keeps_the_figures_it_did_not_measure() -> None:
    new = nightly.accepted_baseline({"ppo.accuracy_gain": 0.3}, BASELINE, "abc123")
    assert new["figures"]["ppo.accuracy_gain"]["value"] == 0.3
    for metric, spec in BASELINE["figures"].items():
        if metric != "ppo.accuracy_gain":
            assert new["figures"][metric] == spec, metric


def test_a_planted_regression_exits_1_naming_the_metric(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(BASELINE))
    seen: dict[str, Any] = {}

    def fake_run_recipe(
        name: str, out: Path, results_dir: Path, overrides: list[str], config: str = "cpu"
    ) -> dict[str, Any]:
        seen.update(name=name, results_dir=results_dir, overrides=list(overrides))
        return _recipe(
            0.0 if "actor.optim.lr=0" in overrides else 0.42, passed="actor.optim.lr=0" not in overrides
        )

    monkeypatch.setattr(nightly, "run_recipe", fake_run_recipe)
    monkeypatch.setattr(nightly, "run_bench", lambda out: _bench())
    monkeypatch.setattr(nightly.subprocess, "call", lambda cmd, cwd=None: 0)  # the leaderboard build
    args = [
        "--recipes",
        "grpo",
        "--configs",
        "cpu",
        "--baseline",
        str(baseline),
        "--out",
        str(tmp_path / "night"),
    ]

    assert nightly.main(args + ["--override", "actor.optim.lr=0", "--accept"]) == 1
    err = capsys.readouterr().err
    assert "REGRESSION in grpo.accuracy_gain (expected file), grpo.accuracy_gain" in err
    assert "not accepting" in err
    assert seen["results_dir"] == tmp_path / "night" / "results"  # planted runs stay out of leaderboards/
    assert json.loads(baseline.read_text()) == BASELINE  # nothing already accepted is lost
    report = (tmp_path / "night" / "report.md").read_text()
    assert "REGRESSION" in report and "| grpo.accuracy_gain | 0 | 0.4 | 0 | >= 0.5 | **FAIL** |" in report

    assert nightly.main(args + ["--accept"]) == 0
    accepted = json.loads(baseline.read_text())
    assert accepted["figures"]["grpo.accuracy_gain"]["value"] == 0.42


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
    # the quickstart pair alternates three rounds (a median each side); the compute-bound pair one
    rounds = [i for i, arg in enumerate(calls[-1]) if arg == "--rounds"]
    assert [calls[-1][i + 1] for i in rounds] == ["3"]
    nightly.run_bench_trl(tmp_path, args=nightly.NIGHTLY_COMPUTE_BOUND_ARGS)
    rounds = [i for i, arg in enumerate(calls[-1]) if arg == "--rounds"]
    assert calls[-1][rounds[-1] + 1] == "1"  # the last one is what argparse keeps


XEON = {"hardware": "cpu-intel-xeon", "device_name": "Intel(R) Xeon(R) Processor", "cpu_isa": "amx_bf16",
        "logical_cpus": 2}  # fmt: skip
EPYC = {"hardware": "cpu-amd-epyc", "device_name": "AMD EPYC", "cpu_isa": "avx512_bf16", "logical_cpus": 2}


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


def test_accept_report_writes_a_finished_nights_figures(tmp_path: Path) -> None:
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({"figures": {"grpo.accuracy_gain": {"value": 0.3, "min_ratio": 0.6}}}))
    report = _report(tmp_path, [{"metric": "grpo.accuracy_gain", "ok": True}])
    assert nightly.main(["--accept-report", str(report), "--baseline", str(baseline)]) == 0
    new = json.loads(baseline.read_text())
    assert new["figures"]["grpo.accuracy_gain"] == {"value": 0.4, "min_ratio": 0.6}  # threshold kept
    assert new["figures"]["bench.grpo_step_vs_trl_quickstart"]["value"] == 1.05
    assert new["accepted"]["commit"] == "abc123"
    assert "machine" not in new["accepted"]  # a report from before nights recorded their machine
    report = _report(tmp_path, [{"metric": "grpo.accuracy_gain", "ok": True}], machine=EPYC)
    assert nightly.main(["--accept-report", str(report), "--baseline", str(baseline)]) == 0
    assert json.loads(baseline.read_text())["accepted"]["machine"] == EPYC


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


@pytest.mark.parametrize("accepted_on", ["same", "other", "unrecorded"])
def test_the_report_names_the_machine_and_flags_speed_figures_accepted_on_another(
    tmp_path: Path, accepted_on: str
) -> None:
    accepted_machine = {"same": EPYC, "other": XEON, "unrecorded": None}[accepted_on]
    findings = nightly.compare_with_baseline({"grpo": _recipe(0.42)}, _bench(), BASELINE)
    nightly.note_other_machine(findings, EPYC, accepted_machine)
    assert _failing(findings) == []  # another machine is said, never failed for
    notes = {f.metric: f.note for f in findings}
    flagged = sorted(m for m, note in notes.items() if "accepted on another machine" in note)
    speed = ["bench.train_vs_plain_torch", "bench.weight_sync_vs_load_state_dict", "grpo.tokens_per_s_vs_plain_torch"]
    assert flagged == ([] if accepted_on == "same" else speed)

    report = nightly.write_report(tmp_path, findings, {}, {}, [], 60.0, EPYC, accepted_machine)
    text = report.read_text()
    assert "machine: cpu-amd-epyc (AMD EPYC, avx512_bf16, 2 logical CPUs); accepted night's: " in text
    other_line = [line for line in text.splitlines() if line.startswith("**Another machine")]
    if accepted_on == "same":
        assert other_line == []
    elif accepted_on == "other":
        assert "cpu-intel-xeon (Intel(R) Xeon(R) Processor, amx_bf16, 2 logical CPUs)" in text
        assert other_line and "cpu_isa: avx512_bf16, accepted amx_bf16" in other_line[0]
        assert "logical_cpus" not in other_line[0]  # only what differs is named
    else:
        assert "accepted night's: not recorded" in text
        assert other_line and "is not recorded" in other_line[0]
    assert json.loads((tmp_path / "report.json").read_text())["machine"] == EPYC


def test_a_night_records_its_machine_and_accepting_it_keeps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps({**BASELINE, "accepted": {"date": "2026-11-25", "machine": XEON}}))
    monkeypatch.setattr(nightly, "run_recipe", lambda *a, **k: _recipe(0.42))
    monkeypatch.setattr(nightly, "run_bench", lambda out: _bench())
    monkeypatch.setattr(nightly, "this_machine", lambda: EPYC)
    monkeypatch.setattr(nightly.subprocess, "call", lambda cmd, cwd=None: 0)  # the leaderboard build
    args = ["--recipes", "grpo", "--configs", "cpu", "--skip-trl", "--baseline", str(baseline)]
    assert nightly.main([*args, "--out", str(tmp_path / "night"), "--accept"]) == 0
    report = (tmp_path / "night" / "report.md").read_text()
    assert "**Another machine than the accepted night's**" in report
    assert "| bench.train_vs_plain_torch | 0.8 | 0.8 | 1 | >= 0.7 | ok | accepted on another machine |" in report
    assert json.loads(baseline.read_text())["accepted"]["machine"] == EPYC
