"""Leaderboard pages built from synthetic result files (and an MLflow store of harness runs)."""

from __future__ import annotations

import re
from pathlib import Path

from verity_harness.leaderboard import build_leaderboard, collect_runs, latest_per_key
from verity_harness.leaderboard.pages import LATEST_COLUMNS
from verity_harness.results import write_result


def _write_runs(results: Path, result_factory) -> None:
    write_result(results, result_factory())  # grpo cpu/hf, 2026-11-20
    write_result(
        results,
        result_factory(
            date="2026-11-21", finished_at="2026-11-21T09:00:00+00:00", scores={"accuracy_after": 0.75}
        ),
    )  # newer grpo cpu/hf
    write_result(
        results,
        result_factory(
            hardware="h100",
            family="cuda",
            device_name="NVIDIA H100 80GB HBM3",
            passed=False,
            throughput={"tokens_per_s": 9000.0, "mfu": 0.31},
        ),
    )
    write_result(results, result_factory(recipe="rloo", backend="hf<script>"))


def _rows(page: str, table_id: str) -> int:
    table = re.search(rf'<table id="{table_id}">.*?</table>', page, re.S)
    assert table is not None, table_id
    return table.group(0).count('<tr class="run">')


def test_latest_keeps_the_newest_run_per_combination(tmp_path: Path, result_factory) -> None:
    _write_runs(tmp_path, result_factory)
    runs = collect_runs(tmp_path)
    assert len(runs) == 4
    latest = latest_per_key(runs)
    assert [(r["recipe"], r["hardware"], r["date"]) for r in latest] == [
        ("grpo", "cpu-test", "2026-11-21"),
        ("grpo", "h100", "2026-11-20"),
        ("rloo", "cpu-test", "2026-11-20"),
    ]
    assert latest[1]["label"] == "h100/hf"


def test_pages_hold_tables_and_plots(tmp_path: Path, result_factory) -> None:
    _write_runs(tmp_path / "results", result_factory)
    paths = build_leaderboard(tmp_path / "results", tmp_path / "board", generated="test")
    assert [p.name for p in paths] == ["index.html", "grpo.html", "rloo.html"]
    index = paths[0].read_text()
    assert _rows(index, "latest-grpo") == 2 and _rows(index, "latest-rloo") == 1
    assert index.count('<svg role="img"') == 6  # accuracy, reward, throughput per recipe
    assert "75.0%" in index and "31.00%" in index  # newest grpo score; the H100 run's MFU
    assert '<td class="fail">fail</td>' in index and '<td class="pass">pass</td>' in index
    assert "<script>" not in index and "hf&lt;script&gt;" in index  # names are escaped
    grpo = paths[1].read_text()
    assert _rows(grpo, "history-grpo") == 3 and _rows(grpo, "latest-grpo") == 2


def test_empty_leaderboard_says_so(tmp_path: Path) -> None:
    paths = build_leaderboard(tmp_path / "none", tmp_path / "board", generated="test")
    assert [p.name for p in paths] == ["index.html"]
    assert 'id="empty"' in paths[0].read_text()


def test_mlflow_runs_join_result_files_once(tmp_path: Path, result_factory) -> None:
    from verity.tracking import Tracker
    from verity_harness.tracking import EXPERIMENT_PREFIX, log_result

    uri = "sqlite:///" + str(tmp_path / "mlflow.db")
    run_ids = []
    for backend in ("hf", "vllm"):
        tracker = Tracker(tmp_path / backend, experiment=f"{EXPERIMENT_PREFIX}grpo", tracking_uri=uri)
        result = result_factory(backend=backend, mlflow={"run_id": tracker.run_id, "tracking_uri": uri})
        log_result(uri, tracker.run_id, result, step=3)
        tracker.finish()
        run_ids.append(tracker.run_id)
    # the hf run also has a committed result file: it must appear once
    write_result(tmp_path / "results", result_factory(mlflow={"run_id": run_ids[0], "tracking_uri": uri}))
    runs = collect_runs(tmp_path / "results", [uri])
    assert sorted(r["backend"] for r in runs) == ["hf", "vllm"]
    from_mlflow = next(r for r in runs if r["backend"] == "vllm")
    assert from_mlflow["source"] == f"mlflow:{run_ids[1]}"
    assert from_mlflow["scores"]["accuracy_after"] == 0.7


def test_runs_that_differ_only_in_their_training_engine_stand_side_by_side(
    tmp_path: Path, result_factory
) -> None:
    from verity_harness.results import write_result

    write_result(tmp_path, result_factory(config="cpu", date="2026-11-21"))
    write_result(
        tmp_path,
        result_factory(config="cpu-megatron", train_engine="megatron", date="2026-11-21",
                       finished_at="2026-11-21T11:00:00+00:00"),
    )  # fmt: skip
    latest = latest_per_key(collect_runs(tmp_path))
    assert [(r["config"], r["train_engine"], r["label"]) for r in latest] == [
        ("cpu", "fsdp2", "cpu-test/hf"),
        ("cpu-megatron", "megatron", "cpu-test/hf/megatron/cpu-megatron"),
    ]
    page = build_leaderboard(tmp_path, tmp_path / "board", generated="test")[1].read_text()
    assert "<th" in page and "train engine" in page and ">megatron<" in page


def test_sampled_scores_show_beside_greedy_accuracy(tmp_path: Path, result_factory) -> None:
    run = result_factory(
        recipe="dapo",
        scores={"accuracy_after": 0.5, "avg_at_k_after": 0.625, "pass_at_k_after": 0.875, "val_k": 8.0},
    )
    run["curves"] = {**run["curves"], "val/avg_at_k": [0.25, 0.625]}  # at val_step 0 and 3
    write_result(tmp_path / "results", run)
    write_result(tmp_path / "results", result_factory())  # a recipe without sampled evaluation
    index = build_leaderboard(tmp_path / "results", tmp_path / "board", generated="test")[0].read_text()
    head = re.search(r'<table id="latest-dapo">.*?</thead>', index, re.S).group(0)
    assert head.index("held-out acc.") < head.index("avg@k") < head.index("pass@k")
    assert "62.5% (k=8)" in index and "87.5% (k=8)" in index
    grpo = re.search(r'<table id="latest-grpo">.*?</table>', index, re.S).group(0)
    assert grpo.count('<td class="none">–</td>') >= 2  # no avg@k, no pass@k: a dash, not a number
    assert 'aria-label="dapo: held-out avg@k (sampled)"' in index
    assert 'aria-label="grpo: held-out avg@k (sampled)"' not in index  # no curve, no plot


def test_cpu_runs_are_told_apart_by_processor_and_old_cpu_labels_join_theirs(
    tmp_path: Path, result_factory
) -> None:
    def run(day: int, **changes):
        return result_factory(date=f"2026-11-2{day}", finished_at=f"2026-11-2{day}T09:00:00+00:00", **changes)

    xeon = {"device_name": "Intel(R) Xeon(R) Processor"}
    # written before CPU labels named the processor: hardware "cpu", no ISA recorded
    write_result(tmp_path, run(1, hardware="cpu", cpu_isa=None, **xeon, scores={"accuracy_after": 0.6}))
    write_result(tmp_path, run(2, hardware="cpu-amd-epyc", device_name="AMD EPYC", cpu_isa="avx512_bf16"))
    runs = collect_runs(tmp_path)
    assert sorted(r["label"] for r in runs) == ["cpu-amd-epyc/hf", "cpu-intel-xeon/hf"]
    assert len(latest_per_key(runs)) == 2  # two processors: two rows, neither replaces the other
    page = build_leaderboard(tmp_path, tmp_path / "board", generated="test")[0].read_text()
    assert 'title="AMD EPYC, avx512_bf16">cpu-amd-epyc<' in page
    assert 'title="Intel(R) Xeon(R) Processor">cpu-intel-xeon<' in page

    # a newer run on the same Xeon replaces the old "cpu" one in the latest table
    write_result(tmp_path, run(3, hardware="cpu-intel-xeon", cpu_isa="amx_bf16", **xeon))
    latest = latest_per_key(collect_runs(tmp_path))
    assert [(r["hardware"], r["date"], r["cpu_isa"]) for r in latest] == [
        ("cpu-amd-epyc", "2026-11-22", "avx512_bf16"),
        ("cpu-intel-xeon", "2026-11-23", "amx_bf16"),
    ]
    # an accelerator's label is its own, whatever its name
    gpu = run(4, hardware="h100", family="cuda", device_name="NVIDIA H100 80GB HBM3", cpu_isa=None)
    write_result(tmp_path, gpu)
    assert "h100/hf" in {r["label"] for r in collect_runs(tmp_path)}


def test_the_footer_names_the_sources_read_and_a_missing_results_folder_is_refused(
    tmp_path: Path, result_factory, capsys
) -> None:
    from verity_harness.cli import main

    _write_runs(tmp_path / "results", result_factory)
    page = build_leaderboard(tmp_path / "results", tmp_path / "board", generated="test")[0].read_text()
    # no local absolute path on a page (issue #49): a folder outside the current one shows its name
    assert "from the result files in <code>results</code>.</p>" in page and "MLflow" not in page
    uri = "sqlite:///" + str(tmp_path / "m.db")
    page = build_leaderboard(tmp_path / "results", tmp_path / "b2", [uri], generated="test")[0].read_text()
    assert "and the MLflow runs in <code>m.db</code>" in page and str(tmp_path) not in page
    code = main(["leaderboard", "--results-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "b3"), "--no-mlflow"])
    assert code == 2 and "--results-dir" in capsys.readouterr().err and not (tmp_path / "b3").exists()


def test_rows_show_the_nodes_that_ran_and_whether_they_were_simulated(tmp_path: Path, result_factory) -> None:
    write_result(tmp_path, result_factory())  # a result from before runs recorded their nodes
    placement = "192.0.2.2/ab12cd34:0,192.0.2.2/ef56ab78:1"
    write_result(
        tmp_path,
        result_factory(config="cpu-2node", nodes=2, simulated_nodes=2, ran={"placement.actor": placement}),
    )
    write_result(tmp_path, result_factory(config="cpu-lora", nodes=1, simulated_nodes=None))
    page = build_leaderboard(tmp_path, tmp_path / "board", generated="test")[0].read_text()
    table = re.search(r'<table id="latest-grpo">.*?</table>', page, re.S).group(0)
    head = re.search(r"<thead>.*?</thead>", table, re.S).group(0)
    assert head.index("train engine") < head.index(">nodes<") < head.index("held-out acc.")
    column = [title for title, _, _ in LATEST_COLUMNS].index("nodes")
    nodes = {}  # config -> its nodes cell
    for row in re.findall(r'<tr class="run">(.*?)</tr>', table, re.S):
        cells = re.findall(r"<td[^>]*>.*?</td>", row)
        nodes[re.sub(r"<[^>]+>", "", cells[0])] = cells[column]
    assert nodes == {
        "cpu": '<td class="none">–</td>',  # unknown: a dash, never a guess
        "cpu-2node": f'<td title="actor: {placement}">2 (simulated)</td>',
        "cpu-lora": "<td>1</td>",
    }
