"""bench.html: ci/bench_gpu.py's results found under a folder, the newest per kind, failures shown."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from verity_harness.leaderboard import build_leaderboard, collect_bench_rows, latest_bench_rows


def _bench(date: str, sides: dict[str, Any], micro_rows: int = 64, sdpa: str = "auto") -> dict[str, Any]:
    """A result in ci/bench_gpu.py's layout (the fields the page reads)."""
    return {
        "environment": {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "date": f"{date}T15:00:00+00:00"},
        "config": {
            "model": "qwen2.5-0.5b",
            "bf16": True,
            "rows": 64,
            "micro_rows": micro_rows,
            "prompt_len": 256,
            "response_len": 768,
            "gen_rows": 128,
            "gen_prompt_len": 256,
            "gen_new_tokens": 256,
            "sdpa_backend": sdpa,
            "compiled_head_kernels": "auto",
        },
        "datasheet_peak_flops": 989.4e12,
        "sides": sides,
        "summary": {},
    }


def _update(seconds: float, mfu: float) -> dict[str, Any]:
    return {
        "step_seconds": [seconds] * 5,
        "median_seconds": seconds,
        "tokens_per_s": 65536 / seconds,
        "mfu_vs_datasheet": mfu,
        "mfu_vs_measured_matmul": mfu * 1.25,
        "max_memory_gib": 99.4,
    }


def _write(folder: Path) -> None:
    (folder / "a" / "b").mkdir(parents=True)
    old = _bench("2026-11-26", {"update-verity-cudagraphs": _update(0.4281, 0.448)})
    new = _bench(
        "2026-11-27",
        {
            "update-verity-cudagraphs": _update(0.4222, 0.454),
            "update-verity-cudagraphs-fused": {"error": "OutOfMemoryError: CUDA out of memory <big>"},
        },
    )
    other_shape = _bench("2026-11-25", {"update-verity-cudagraphs": _update(0.451, 0.425)}, micro_rows=16)
    gen = _bench("2026-11-26", {"generate-verity": {"median_seconds": 4.66, "tokens_per_s": 7030.0}})
    one_step = _bench("2026-11-28", {"update-verity-cudagraphs": _update(0.4102, 0.467)})
    one_step["sides"]["update-verity-cudagraphs"]["step_seconds"] = [0.4102]  # the newest, but one timed step
    (folder / "a" / "one_step.json").write_text(json.dumps(one_step))
    inductor_head = _bench("2026-11-28", {"update-verity-cudagraphs": _update(0.4400, 0.437)})
    inductor_head["config"]["compiled_head_kernels"] = "inductor"  # another kind: a row of its own
    (folder / "a" / "inductor_head.json").write_text(json.dumps(inductor_head))
    del old["config"]["compiled_head_kernels"]  # a run from before the option: the same kind as "auto"
    (folder / "old.json").write_text(json.dumps(old))
    (folder / "a" / "new.json").write_text(json.dumps(new))
    (folder / "a" / "b" / "micro16.json").write_text(json.dumps(other_shape))
    (folder / "a" / "gen.json").write_text(json.dumps(gen))
    (folder / "a" / "summary.json").write_text(json.dumps({"ran": {"rollout": "hf"}}))  # not a bench result
    (folder / "a" / "broken.json").write_text("{not json")


def _table(page: str, table_id: str) -> str:
    table = re.search(rf'<table id="{table_id}">.*?</table>', page, re.S)
    assert table is not None, table_id
    return table.group(0)


def test_rows_are_found_under_the_folder_and_the_newest_per_kind_is_kept(tmp_path: Path, caplog) -> None:
    _write(tmp_path)
    with caplog.at_level(logging.WARNING):
        rows = collect_bench_rows([tmp_path])
    assert "broken.json: not readable JSON" in caplog.text
    assert len(rows) == 7  # 1 + 2 + 1 + 1 + 1 + 1 sides; summary.json is not a bench result
    latest = latest_bench_rows(rows)
    graphs = [r for r in latest if r["side"] == "update-verity-cudagraphs"]
    assert [(r["micro_rows"], r["head_kernels"], r["median_seconds"]) for r in graphs] == [
        (16, "auto", 0.451),
        (64, "auto", 0.4222),
        (64, "inductor", 0.44),
    ]
    fused = next(r for r in latest if r["side"] == "update-verity-cudagraphs-fused")
    assert fused["error"].startswith("OutOfMemoryError") and fused["median_seconds"] is None
    gen = next(r for r in latest if r["kind"] == "generate")
    assert (gen["rows"], gen["prompt_len"], gen["response_len"], gen["micro_rows"]) == (128, 256, 256, None)


def test_the_page_shows_the_newest_figures_the_failures_and_the_history(tmp_path: Path) -> None:
    _write(tmp_path / "reports")
    paths = build_leaderboard(
        tmp_path / "none", tmp_path / "board", generated="test", bench_dirs=[tmp_path / "reports"]
    )
    assert [p.name for p in paths] == ["index.html", "bench.html"]
    assert 'id="bench-link" href="bench.html"' in paths[0].read_text()
    page = paths[1].read_text()
    update = _table(page, "bench-update")
    assert (
        update.count('<tr class="run">') == 4
    )  # graphs at 16 and 64 rows, inductor's head, the failed fused side
    assert "0.4222" in update and "45.4%" in update and "0.4281" not in update  # the newer run replaced it
    assert '<td class="fail" title="OutOfMemoryError: CUDA out of memory &lt;big&gt;">error</td>' in update
    assert "<big>" not in page  # messages are escaped
    generate = _table(page, "bench-generate")
    assert generate.count('<tr class="run">') == 1 and "7,030" in generate
    history = _table(page, "bench-history")
    assert history.count('<tr class="run">') == 7 and "0.4281" in history and "0.4102" in history
    assert "0.4102" not in update  # a one-step run stays in the history while a longer one exists
    assert f"<code>{(tmp_path / 'reports' / 'a' / 'new.json').as_posix()}</code>" in history
    assert f"results under <code>{tmp_path / 'reports'}</code>" in page


def test_no_bench_results_no_page_and_no_link(tmp_path: Path) -> None:
    (tmp_path / "reports").mkdir()
    paths = build_leaderboard(
        tmp_path / "none", tmp_path / "board", generated="test", bench_dirs=[tmp_path / "reports"]
    )
    assert [p.name for p in paths] == ["index.html"] and "bench-link" not in paths[0].read_text()


def test_the_cli_refuses_a_missing_bench_folder(tmp_path: Path, capsys) -> None:
    from verity_harness.cli import main

    (tmp_path / "results").mkdir()
    argv = [
        "leaderboard",
        "--results-dir",
        str(tmp_path / "results"),
        "--out",
        str(tmp_path / "b"),
        "--no-mlflow",
    ]
    code = main([*argv, "--bench-dir", str(tmp_path / "nope")])
    assert code == 2 and "--bench-dir" in capsys.readouterr().err and not (tmp_path / "b").exists()
    _write(tmp_path / "reports")
    assert main([*argv, "--bench-dir", str(tmp_path / "reports")]) == 0
    assert (tmp_path / "b" / "bench.html").is_file()
