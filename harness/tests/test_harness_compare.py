"""compare: loading runs from files and run directories, the side-by-side rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from verity_harness.compare import comparison_rows, format_comparison, load_run
from verity_harness.results import write_result


def test_rows_show_difference_and_ratio(result_factory) -> None:
    a = result_factory()
    b = result_factory(backend="vllm", scores={"accuracy_after": 0.8, "only_b": 1.0})
    b["throughput"] = {**a["throughput"], "tokens_per_s": 2500.0, "stage_seconds": {"generate": 0.25}}
    rows = {r[0]: r for r in comparison_rows(a, b)}
    assert rows["backend"][1:3] == ("hf", "vllm")
    assert rows["score accuracy_after"] == ("score accuracy_after", "0.7", "0.8", "+0.1", "1.143")
    assert rows["throughput tokens_per_s"][3:] == ("+1500", "2.500")
    assert rows["seconds generate"][3:] == ("-0.25", "0.500")
    assert rows["seconds update_actor"][1:3] == ("1", "-")  # only A has it
    assert rows["score only_b"][1:4] == ("-", "1", "")
    assert rows["git_commit"][1] == "0123456789"


def test_load_run_from_file_and_run_dir(tmp_path: Path, result_factory) -> None:
    path = write_result(tmp_path / "results", result_factory())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "harness_result.json").write_text(json.dumps(result_factory(backend="sglang")))
    a, b = load_run(str(path)), load_run(str(run_dir))
    assert (a["backend"], b["backend"]) == ("hf", "sglang")
    text = format_comparison(a, b)
    assert f"A: {path}" in text and "sglang" in text
    with pytest.raises(ValueError, match="not a result file"):
        load_run(str(tmp_path / "nothing"))
