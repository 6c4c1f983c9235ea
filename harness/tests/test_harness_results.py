"""Result files: names, round trip, validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from verity_harness.results import load_result, load_results, result_filename, write_result


def test_file_names(result_factory) -> None:
    assert result_filename(result_factory()) == "2026-11-20-cpu-test-hf.json"
    # two processors on one day: two files (hardware labels name the processor, machine.cpu_label)
    epyc = result_factory(hardware="cpu-amd-epyc", device_name="AMD EPYC")
    assert result_filename(epyc) == "2026-11-20-cpu-amd-epyc-hf.json"
    other = result_factory(config="gsm8k-qwen2.5-0.5b", hardware="h100")
    assert result_filename(other) == "2026-11-20-h100-hf-gsm8k-qwen2.5-0.5b.json"


def test_round_trip_turns_nan_into_null(tmp_path: Path, result_factory) -> None:
    result = result_factory()
    result["scores"]["val/acc"] = float("nan")
    path = write_result(tmp_path, result)
    assert path == tmp_path / "grpo" / "2026-11-20-cpu-test-hf.json"
    loaded = load_result(path)
    assert loaded["scores"]["val/acc"] is None
    assert loaded["schema"] == 1 and loaded["source"] == str(path)
    assert json.loads(path.read_text())["throughput"]["tokens_per_s"] == 1000.0


def test_load_results_sorts_by_time(tmp_path: Path, result_factory) -> None:
    write_result(tmp_path, result_factory(date="2026-11-21", finished_at="2026-11-21T00:00:00+00:00"))
    write_result(tmp_path, result_factory(recipe="rloo"))
    assert [r["recipe"] for r in load_results(tmp_path)] == ["rloo", "grpo"]
    assert load_results(tmp_path / "none") == []


def test_invalid_results_are_refused(tmp_path: Path, result_factory) -> None:
    bad = result_factory()
    del bad["scores"]
    with pytest.raises(ValueError, match=r"missing keys \['scores'\]"):
        write_result(tmp_path, bad)
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_result(path)
    path.write_text(json.dumps({**result_factory(), "schema": 7}))
    with pytest.raises(ValueError, match="schema 7"):
        load_result(path)
