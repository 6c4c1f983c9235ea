"""ci/nightly_history.py: a night's figures into a per-night JSON and an MLflow run of experiment ``nightly``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers.ci_scripts import load_ci_script

history = load_ci_script("nightly_history")

REPORT: dict[str, Any] = {
    "machine_class": "cpu-amd-epyc/avx512_bf16",
    "findings": [
        {
            "metric": "grpo.accuracy_gain (expected file)",
            "value": 0.42,
            "baseline": 0.403,
            "ratio": None,
            "threshold": "at_least ±0.06",
            "ok": True,
        },
        {
            "metric": "bench.train_vs_plain_torch",
            "value": 0.7,
            "baseline": 0.8,
            "ratio": 0.875,
            "threshold": ">= 0.950",
            "ok": False,
        },
        {
            "metric": "bench.weight_sync_vs_load_state_dict",
            "value": 1.0,
            "baseline": 1.1,
            "ratio": 0.909,
            "threshold": "<= 1.050",
            "ok": True,
        },
        {"metric": "grpo.run", "value": None, "baseline": None, "ratio": None, "threshold": "-", "ok": True},
    ],
    "recipes": {"grpo": {"git_commit": "abc1234def"}},
    "overrides": [],
    "planted_slowdown": [],
}


def _report(tmp_path: Path, doc: dict[str, Any] = REPORT) -> Path:
    path = tmp_path / "night" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))
    return path


def _runs(uri: str) -> list[Any]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("nightly")
    assert exp is not None
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def test_a_night_recorded_twice_is_two_runs_in_the_nightly_experiment(tmp_path: Path) -> None:
    report, store = _report(tmp_path), tmp_path / "hist" / "mlflow.db"
    nights = tmp_path / "nights"
    first, run_a = history.record_night(report, nights, store)
    second, run_b = history.record_night(report, nights, str(store))

    assert first == second and first.parent == nights  # one JSON per night, named by its time and machine
    assert first.name.endswith("-cpu-amd-epyc_avx512_bf16.json")
    night = json.loads(first.read_text())
    assert night["kind"] == "verity-nightly-night" and night["verdict"] == "REGRESSION"
    assert night["commit"] == "abc1234def" and night["failing"] == ["bench.train_vs_plain_torch"]
    figures = night["figures"]
    assert set(figures) == {
        "expected/grpo.accuracy_gain",
        "bench.train_vs_plain_torch",
        "bench.weight_sync_vs_load_state_dict",
    }  # a finding without a value is no figure
    assert figures["expected/grpo.accuracy_gain"]["low"] == pytest.approx(0.343)
    assert figures["expected/grpo.accuracy_gain"]["high"] is None
    assert figures["bench.train_vs_plain_torch"]["low"] == pytest.approx(0.95 * 0.8)  # the ratio's floor
    assert figures["bench.weight_sync_vs_load_state_dict"]["high"] == pytest.approx(1.05 * 1.1)
    assert figures["bench.train_vs_plain_torch"]["ok"] is False

    # both runs carry the night's own time, so they are told apart by id, not by start time
    runs = {r.info.run_id: r for r in _runs("sqlite:///" + str(store))}
    assert set(runs) == {run_a, run_b} and run_a != run_b
    assert runs[run_a].data.tags["machine_class"] == "cpu-amd-epyc/avx512_bf16"
    assert runs[run_a].data.tags["verdict"] == "REGRESSION" and runs[run_a].data.tags["commit"] == "abc1234def"
    assert runs[run_b].data.metrics["bench.train_vs_plain_torch"] == pytest.approx(0.7)
    assert runs[run_b].data.metrics["night/failing"] == 1.0
    import mlflow

    steps = mlflow.MlflowClient(tracking_uri="sqlite:///" + str(store)).get_metric_history(
        run_b, "expected/grpo.accuracy_gain"
    )
    assert [m.step for m in steps] == [1]  # the second night in the experiment


def test_the_store_comes_from_the_option_then_the_environment_then_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(history.ENV_VAR, raising=False)
    assert history.store_uri(None) == "sqlite:///" + str(history.DEFAULT_STORE)
    monkeypatch.setenv(history.ENV_VAR, str(tmp_path / "env.db"))
    assert history.store_uri(None) == "sqlite:///" + str(tmp_path / "env.db")
    assert history.store_uri(f"sqlite:///{tmp_path}/opt.db") == f"sqlite:///{tmp_path}/opt.db"


@pytest.mark.parametrize("kind", ["folder", "under_a_file", "scheme"])
def test_a_bad_store_is_refused_in_one_sentence_before_anything_is_written(
    tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("x")
    store = {
        "folder": str(tmp_path),
        "under_a_file": str(tmp_path / "afile" / "mlflow.db"),
        "scheme": "http://example.org/mlflow",
    }[kind]
    report = _report(tmp_path)
    code = history.main([str(report), "--history-store", store, "--nights-dir", str(tmp_path / "nights")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("nightly_history: --history-store ") and err.count("\n") == 0
    assert "SQLite" in err
    assert not (tmp_path / "nights").exists()


def test_the_nightly_refuses_a_bad_store_before_it_runs_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    nightly = load_ci_script("nightly")
    code = nightly.main(["--recipes", "grpo", "--history-store", str(tmp_path), "--out", str(tmp_path / "o")])
    assert code == 2
    assert "is a folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


MARKDOWN = """# Nightly, 2026-11-27: a night at `4e938aa`

# Nightly report — 2026-11-27 17:31 UTC

verdict: **REGRESSION**, 2 figures, 1 failing; 21.0 min

machine: cpu-amd-epyc (AMD EPYC, avx512_bf16, 2 logical CPUs); accepted night's: cpu-intel-xeon (...)

| metric | tonight | accepted | ratio | threshold | status | note |
|---|---|---|---|---|---|---|
| grpo.accuracy_after (expected file) | 0.956 | 0.93 | - | within ±0.05 | ok |  |
| bench.generate_vs_hf_generate | 0.5 | 1.0 | 0.5 | >= 0.7 | **FAIL** | |

| row | seconds | exit | held-out acc. before → after |
|---|---|---|---|
| grpo | 113 | 0 | 0.516 → 0.9 |
"""


def test_a_committed_markdown_night_is_read_with_its_bands_and_failures() -> None:
    night = history.night_from_markdown(MARKDOWN, "ci/reports/2026-11-27-nightly.md")
    assert night is not None
    assert night["finished_at"] == "2026-11-27T17:31:00Z" and night["commit"] == "4e938aa"
    assert night["machine_class"] == "cpu-amd-epyc/avx512_bf16" and night["verdict"] == "REGRESSION"
    after = night["figures"]["expected/grpo.accuracy_after"]
    assert (after["low"], after["high"], after["ok"]) == (pytest.approx(0.88), pytest.approx(0.98), True)
    gen = night["figures"]["bench.generate_vs_hf_generate"]
    assert gen["low"] == pytest.approx(0.7) and gen["ok"] is False
    assert "grpo" not in night["figures"]  # the rows table is not a findings table
    older = MARKDOWN.replace("machine: cpu-amd-epyc", "host: x")
    assert history.night_from_markdown(older, "x.md")["machine_class"] == "unrecorded"
    assert history.night_from_markdown("# notes\n\nno table here\n", "x.md") is None


def test_the_committed_nights_are_the_history_the_trend_page_reads() -> None:
    nights = sorted(history.DEFAULT_NIGHTS_DIR.glob("*.json"))
    assert nights, "leaderboards/nightly holds the committed nights"
    for path in nights:
        night = json.loads(path.read_text())
        assert night["kind"] == "verity-nightly-night" and night["figures"], path
        assert path.name == history.night_file_name(night)


def test_the_script_records_a_night_from_the_command_line(tmp_path: Path) -> None:
    report, store, nights = _report(tmp_path), tmp_path / "h.db", tmp_path / "nights"
    board = tmp_path / "board"
    done = subprocess.run(
        [sys.executable, "-m", "ci.nightly_history", str(report)]
        + ["--history-store", str(store), "--nights-dir", str(nights), "--board-dir", str(board)],
        cwd=history.ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert len(list(nights.glob("*.json"))) == 1
    assert 'id="trend-regressions"' in (board / "trend.html").read_text()
