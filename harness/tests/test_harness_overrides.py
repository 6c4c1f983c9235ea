"""Issue #49 finding 11: runs with overrides stay off the committed leaderboard, pages show them and fit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from verity_harness.leaderboard import build_leaderboard, neutral_source
from verity_harness.leaderboard.collect import collect_runs, latest_per_key
from verity_harness.results import write_result
from verity_harness.runner import DEFAULT_RESULTS_DIR, SCRATCH_RESULTS_DIR, RunOutcome, results_dir_for


def test_a_run_with_overrides_goes_to_the_scratch_folder_unless_asked() -> None:
    assert results_dir_for([], None) == (DEFAULT_RESULTS_DIR, None)
    where, why = results_dir_for(["trainer.total_steps=5"], None)
    assert where == SCRATCH_RESULTS_DIR and where != DEFAULT_RESULTS_DIR
    assert "trainer.total_steps=5" in why and str(DEFAULT_RESULTS_DIR) in why
    assert results_dir_for(["trainer.total_steps=5"], Path("mine")) == (Path("mine"), None)


def test_verity_harness_run_with_overrides_writes_to_scratch_and_says_why(
    monkeypatch, capsys, tmp_path
) -> None:
    import verity_harness.runner as runner
    from verity_harness.cli import main

    seen = {}

    def fake_run(name, config, **kwargs):
        seen.update(kwargs)
        return RunOutcome({"recipe": name}, [], None)

    monkeypatch.setattr(runner, "run_recipe", fake_run)
    monkeypatch.setattr(runner, "format_outcome", lambda outcome: "outcome")
    assert main(["run", "grpo", "--config", "cpu", "trainer.total_steps=5"]) == 0
    assert Path(seen["results_dir"]) == SCRATCH_RESULTS_DIR
    out = capsys.readouterr().out
    assert "overrides (trainer.total_steps=5)" in out and str(SCRATCH_RESULTS_DIR) in out
    assert main(["run", "grpo", "--results-dir", str(tmp_path), "trainer.total_steps=5"]) == 0
    assert Path(seen["results_dir"]) == tmp_path
    assert main(["run", "grpo"]) == 0
    assert Path(seen["results_dir"]) == DEFAULT_RESULTS_DIR


def _two_runs(results: Path, result_factory) -> None:
    write_result(
        results, result_factory(date="2026-11-20", finished_at="2026-11-20T10:00:00+00:00", passed=True)
    )
    short = result_factory(
        date="2026-11-21",
        finished_at="2026-11-21T10:00:00+00:00",
        passed=False,
        overrides=["trainer.total_steps=5"],
    )
    write_result(results, short)


def test_a_run_with_overrides_stands_beside_the_recipes_own_and_shows_them(
    tmp_path: Path, result_factory
) -> None:
    _two_runs(tmp_path / "results", result_factory)
    latest = latest_per_key(collect_runs(tmp_path / "results"))
    assert [r.get("overrides") or [] for r in latest] == [[], ["trainer.total_steps=5"]]
    index = build_leaderboard(tmp_path / "results", tmp_path / "board", generated="test")[0].read_text()
    table = re.search(r'<table id="latest-grpo">.*?</table>', index, re.S).group(0)
    assert table.count('<tr class="run">') == 2 and '<td class="pass">pass</td>' in table
    assert '<div class="overrides"' in table and "trainer.total_steps=5</div>" in table


def test_the_footer_names_no_local_absolute_path(tmp_path: Path, result_factory, monkeypatch) -> None:
    _two_runs(tmp_path / "results", result_factory)
    monkeypatch.chdir(tmp_path)
    assert neutral_source(f"sqlite:///{tmp_path}/outputs/mlflow.db") == "outputs/mlflow.db"
    assert neutral_source("sqlite:////elsewhere/secret/mlflow.db") == "mlflow.db"
    assert neutral_source("https://user:pw@mlflow.example.com/x") == "https://mlflow.example.com"
    assert neutral_source("leaderboards/results") == "leaderboards/results"
    index = build_leaderboard(tmp_path / "results", tmp_path / "board", generated="test")[0].read_text()
    footer = index[index.rindex('<p class="meta">') :]
    assert str(tmp_path) not in footer and "<code>results</code>" in footer


def test_the_tables_fit_the_page_in_a_browser(tmp_path: Path, result_factory) -> None:
    from verity_harness.browser import browser_unavailable, inspect_page

    reason = browser_unavailable()
    if reason is not None:
        pytest.skip(f"browser test skipped: {reason}")
    results = tmp_path / "results"
    _two_runs(results, result_factory)
    long = result_factory(
        config="gsm8k-qwen2.5-0.5b-megatron-long",
        hardware="h100",
        family="cuda",
        backend="vllm",
        train_engine="megatron",
        scores={"accuracy_after": 0.5, "avg_at_k_after": 0.625, "pass_at_k_after": 0.875, "val_k": 8.0},
        throughput={"tokens_per_s": 123456.0, "mfu": 0.31, "step_seconds": 12.5},
        overrides=[
            "model.path=/models/qwen2.5-0.5b-instruct",
            "data.train_files=[/data/gsm8k/train.parquet]",
        ],
    )
    write_result(results, long)
    page = build_leaderboard(results, tmp_path / "board", generated="test")[1]
    report = inspect_page(page, width=1280)
    assert report.console_errors == []
    assert report.wide_tables == [], report.wide_tables
