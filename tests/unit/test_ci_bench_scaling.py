"""ci/bench_scaling.py: arguments, configurations, the figures of a run, the goal check, the table.

Made-up figures only: no training runs, no Ray cluster starts, no timed assertion.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
from helpers.ci_scripts import load_ci_script

bench = load_ci_script("bench_scaling")


def _run(workers: int, nodes: int, window: list[float], wait: list[float]) -> dict:
    steps = [
        {
            "step": i + 1,
            "step_s": w - 0.001,
            "window_s": w,
            "wait_s": x,
            "waits": 10.0,
            "bytes_sent": 2048.0 * (i + 1),
            "bytes_received": 1024.0,
            "weight_sync_s": 0.01 * (i + 1),
        }
        for i, (w, x) in enumerate(zip(window, wait, strict=True))
    ]
    return {"workers": workers, "nodes": nodes, "cpus_per_worker": 2 / workers, "steps": steps}


def _row(workers: int, nodes: int, overhead_ms: float) -> dict:
    return {"workers": workers, "nodes": nodes, "ms_per_worker": overhead_ms / workers}


def test_arguments_for_a_smoke_test_and_their_refusals(capsys) -> None:
    args = bench.parse_args(["--workers", "1,2", "--steps", "3"])
    assert (args.workers, args.nodes, args.steps, args.warmup) == ([1, 2], [1, 2], 3, 2)
    assert args.json is None and not args.fail_on_goal
    defaults = bench.parse_args([])
    assert defaults.workers == [1, 2, 4, 8] and defaults.steps == 6 and defaults.max_ms_per_worker == 10.0
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "2"])
    assert "--steps (2) must exceed --warmup (2)" in capsys.readouterr().err
    for bad in (["--workers", "1,x"], ["--workers", "0"], ["--workers", "2,2"], ["--cpus", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_configurations_pair_each_node_count_with_the_worker_counts_it_divides() -> None:
    assert bench.configurations([1, 2, 4, 8], [1, 2]) == [
        (1, 1),
        (2, 1),
        (4, 1),
        (8, 1),
        (2, 2),
        (4, 2),
        (8, 2),
    ]
    assert bench.configurations([1, 2], [1, 2]) == [(1, 1), (2, 1), (2, 2)]
    with pytest.raises(ValueError, match="3 workers"):
        bench.configurations([3], [1])


def test_overrides_load_for_one_and_two_nodes(tmp_path) -> None:
    from verity.config import load_config

    one = load_config(bench.run_overrides(8, 1, 6, 2.0, tmp_path / "a", None))
    assert one.trainer.n_workers == 8 and one.trainer.cpus_per_worker == 0.25
    assert one.data.train_batch_size * one.rollout.n % 8 == 0 and one.trainer.total_steps == 6
    assert not one.trainer.val_before_train and not one.trainer.progress
    two = load_config(bench.run_overrides(4, 2, 6, 2.0, tmp_path / "b", "127.0.0.1:6379"))
    assert (two.trainer.nnodes, two.trainer.n_workers_per_node, two.trainer.n_workers) == (2, 2, 4)
    assert two.trainer.ray_address == "127.0.0.1:6379"
    with pytest.raises(ValueError, match="need a cluster address"):
        bench.run_overrides(4, 2, 6, 2.0, tmp_path / "c", None)
    assert bench.cpus_per_worker(3, 2.0) == 0.666


def test_a_run_summarised_after_warmup() -> None:
    # overheads 0.5, 0.5, 0.02, 0.03, 0.04 s: the warm-up steps' half second must not count
    run = _run(4, 1, window=[2.0, 1.5, 1.02, 1.13, 1.04], wait=[1.5, 1.0, 1.0, 1.1, 1.0])
    row = bench.summarise_run(run, warmup=2)
    assert row["measured_steps"] == 3 and row["steps"] == 5
    assert row["driver_overhead_ms"] == pytest.approx(30.0)
    assert row["ms_per_worker"] == pytest.approx(7.5)
    assert row["window_s"] == pytest.approx(1.04)
    assert row["driver_kb"] == pytest.approx((2048 * 4 + 1024) / 1024)
    assert row["weight_sync_ms"] == pytest.approx(40.0)
    with pytest.raises(ValueError, match="nothing left to measure"):
        bench.summarise_run(run, warmup=5)


def test_goal_passes_sublinear_growth_and_fails_each_rule() -> None:
    rows = [_row(1, 1, 5.0), _row(2, 1, 8.0), _row(4, 1, 26.0), _row(8, 1, 90.0), _row(2, 2, 6.0)]
    assert not bench.goal_check(rows, max_ms=10.0, tolerance=0.2)
    verdicts = [(r["workers"], r["nodes"], r["goal"]) for r in rows]
    assert verdicts == [(1, 1, "PASS"), (2, 1, "PASS"), (4, 1, "FAIL"), (8, 1, "FAIL"), (2, 2, "PASS")]
    assert rows[2]["goal_reasons"] == ["faster than linear: 6.50 ms per worker > 1.2 x 5.00 at 1 worker(s)"]
    assert rows[3]["goal_reasons"][0] == "11.25 ms per worker >= 10"
    assert rows[4]["reference_workers"] == 2  # the 2-node rows are judged against the fewest on 2 nodes
    assert bench.goal_check([_row(1, 1, 9.0), _row(8, 1, 50.0)], max_ms=10.0, tolerance=0.2)


def test_table_and_json_document() -> None:
    args = bench.parse_args(["--workers", "1,2", "--steps", "4", "--warmup", "1"])
    runs = [
        _run(1, 1, window=[3.0, 2.0, 2.0, 2.0], wait=[2.0, 1.996, 1.996, 1.996]),
        _run(2, 1, window=[3.0, 1.5, 1.5, 1.5], wait=[2.0, 1.494, 1.494, 1.494]),
        _run(2, 2, window=[3.0, 1.5, 1.5, 1.5], wait=[2.0, 1.47, 1.47, 1.47]),
    ]
    result = bench.build_result(runs, args, {"cpu_model": "Test CPU", "commit": "abc"})
    assert not result["goal"]["passed"]
    assert [r["goal"] for r in result["rows"]] == ["PASS", "PASS", "FAIL"]
    table = bench.format_table(result["rows"])
    lines = table.splitlines()
    assert lines[0].split()[:4] == ["workers", "nodes", "step", "s"]
    assert "ms/worker/step" in lines[0] and "driver KB/step" in lines[0] and "weight sync ms" in lines[0]
    assert "PASS" in lines[2] and "FAIL (15.00 ms per worker >= 10)" in lines[4]
    assert lines[-1].startswith("goal: driver overhead < 10 ms per worker per step")
    json.loads(json.dumps(result))  # plain JSON


def test_probe_counts_the_main_threads_ray_wait_inside_a_step(monkeypatch) -> None:
    import ray
    from verity.trainer.loop import RLTrainer

    def fake_wait(refs, **_):
        time.sleep(0.02)
        return refs, []

    def fake_step(trainer, step, prompts):
        ray.wait([1])
        ray.wait([2])
        elsewhere = threading.Thread(target=ray.wait, args=([3],))  # not the driver's main thread
        elsewhere.start()
        elsewhere.join()
        return {"timing/step_s": 0.0}

    monkeypatch.setattr(ray, "wait", fake_wait)
    monkeypatch.setattr(RLTrainer, "step", fake_step)
    probe = bench.DriverWaitProbe()
    with probe.installed():
        ray.wait([0])  # outside a step: not counted
        assert RLTrainer.step(None, 7, None) == {"timing/step_s": 0.0}
    assert ray.wait is fake_wait and RLTrainer.step is fake_step  # put back
    figures = probe.steps[7]
    assert figures["waits"] == 2
    assert 0.04 <= figures["wait_s"] < figures["window_s"]
