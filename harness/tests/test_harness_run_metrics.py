"""Scores and throughput read from a run's summary and per-step metrics (hand-computed values)."""

from __future__ import annotations

import pytest
from verity_harness.run_metrics import curves, score_metrics, throughput


def _steps() -> list[dict[str, float]]:
    # step 1 is slow (start-up) and left out of throughput
    rows = [
        {
            "reward/mean": 0.1,
            "perf/tokens_per_s": 10.0,
            "perf/generated_tokens_per_s": 5.0,
            "perf/total_tokens": 100.0,
            "timing/generate_s": 9.0,
            "timing/update_actor_s": 9.0,
            "timing/weight_sync_s": 1.0,
            "timing/step_s": 20.0,
        },
    ]
    for i in range(2, 13):
        rows.append(
            {
                "reward/mean": i / 100,
                "perf/tokens_per_s": 200.0,
                "perf/generated_tokens_per_s": 300.0,
                "perf/total_tokens": 100.0,
                "timing/generate_s": 0.25,
                "timing/update_actor_s": 0.5,
                "timing/weight_sync_s": 0.1,
                "timing/step_s": 1.0,
            }
        )
    return rows


def test_scores_add_gain_and_last10_reward() -> None:
    summary = {
        "final_metrics": {"val/acc": 0.7, "acc/mean": 0.6, "note": "x", "bad": float("nan")},
        "accuracy_before": 0.25,
        "accuracy_after": 0.75,
        "steps": 12,
        "wall_seconds": 30.5,
    }
    scores = score_metrics(summary, _steps())
    assert scores["accuracy_gain"] == pytest.approx(0.5)
    # last 10 steps are 3..12: mean of i/100 = 7.5/100
    assert scores["reward/mean_last10"] == pytest.approx(0.075)
    assert scores["val/acc"] == 0.7 and scores["steps"] == 12.0 and scores["wall_seconds"] == 30.5
    assert "note" not in scores and "bad" not in scores


def test_sampled_evaluation_scores_and_their_gain() -> None:
    summary = {
        "accuracy_before": 0.5,
        "accuracy_after": 0.6,
        "avg_at_k_before": 0.25,
        "avg_at_k_after": 0.625,
        "pass_at_k_before": 0.5,
        "pass_at_k_after": 0.875,
        "val_k": 8.0,
    }
    scores = score_metrics(summary, _steps())
    assert scores["avg_at_k_gain"] == pytest.approx(0.375)
    assert scores["accuracy_gain"] == pytest.approx(0.1)  # the greedy accuracy keeps its own names
    assert (scores["pass_at_k_before"], scores["pass_at_k_after"], scores["val_k"]) == (0.5, 0.875, 8.0)
    assert "avg_at_k_gain" not in score_metrics({"avg_at_k_after": 0.5}, [])


def test_throughput_leaves_out_step_one_and_computes_mfu() -> None:
    t = throughput(_steps(), ppo_epochs=2, n_params=1000, peak_flops=1e9, num_devices=2)
    assert t["measured_steps"] == 11
    assert t["tokens_per_s"] == pytest.approx(200.0)
    assert t["generated_tokens_per_s"] == pytest.approx(300.0)
    # 11 steps x 100 tokens x 2 epochs over 11 x (0.5 - 0.1) s = 500 tokens/s
    assert t["train_tokens_per_s"] == pytest.approx(500.0)
    # 6 x 1000 x 500 / (1e9 x 2)
    assert t["mfu"] == pytest.approx(1.5e-3)
    assert t["stage_seconds"] == {"generate": 0.25, "update_actor": 0.5, "weight_sync": pytest.approx(0.1)}
    assert t["step_seconds"] == pytest.approx(1.0)


def test_train_tokens_count_what_the_update_ran_when_the_run_logs_it() -> None:
    """Rows skipped for a zero advantage are not work done: MFU counts perf/actor_trained_tokens."""
    steps = [{**row, "perf/actor_trained_tokens": 40.0} for row in _steps()]
    t = throughput(steps, ppo_epochs=2, n_params=1000, peak_flops=1e9, num_devices=2)
    # 11 steps x 40 tokens (already summed over epochs) over 11 x 0.4 s = 100 tokens/s
    assert t["train_tokens_per_s"] == pytest.approx(100.0)
    assert t["mfu"] == pytest.approx(3e-4)
    # a run that logs it on some steps only (an older run resumed) falls back to the batch's tokens
    steps[3].pop("perf/actor_trained_tokens")
    assert throughput(steps, ppo_epochs=2)["train_tokens_per_s"] == pytest.approx(500.0)


def test_no_peak_no_mfu_and_single_step_is_kept() -> None:
    t = throughput(_steps()[:1], n_params=1000, peak_flops=None)
    assert t["mfu"] is None and t["measured_steps"] == 1
    assert t["train_tokens_per_s"] == pytest.approx(100 / 8.0)


def test_an_mfu_above_one_is_not_reported_and_the_note_says_why() -> None:
    from verity_harness.runner import format_throughput

    # 6 x 1000 x 500 tokens/s = 3e6 FLOP/s against a "peak" of 1e6: the peak was measured under load
    t = throughput(_steps(), ppo_epochs=2, n_params=1000, peak_flops=1e6, num_devices=1)
    assert t["mfu"] is None
    assert "300% of the peak measured before the run (0.0 GFLOP/s)" in t["mfu_note"]
    assert "n/a (not reported: the update reached 300%" in format_throughput({**t, "stage_seconds": {}})


def test_curves_hold_steps_and_validation() -> None:
    c = curves(_steps()[:3], [{"step": 0, "val/acc": 0.2}, {"step": 3, "val/acc": 0.4}])
    assert c["step"] == [1, 2, 3] and c["reward/mean"] == [0.1, 0.02, 0.03]
    assert c["val_step"] == [0, 3] and c["val/acc"] == [0.2, 0.4]


def test_a_cpu_run_gets_a_measured_peak_and_says_so() -> None:
    from types import SimpleNamespace

    from verity_harness.machine import Machine
    from verity_harness.runner import format_throughput, with_measured_cpu_peak

    cpu = Machine(label="cpu", family="cpu", device_name="test cpu", peak_flops=None, device_count=1)
    cfg = SimpleNamespace(trainer=SimpleNamespace(n_workers=2, cpus_per_worker=1.0))
    measured, source = with_measured_cpu_peak(cpu, cfg)
    assert measured.peak_flops and measured.peak_flops > 0 and "on 2 threads" in source
    gpu = Machine(label="h100", family="cuda", device_name="H100", peak_flops=989e12, device_count=8)
    assert with_measured_cpu_peak(gpu, cfg) == (gpu, "spec sheet")
    text = format_throughput({"mfu": 0.125, "peak_flops_source": source, "stage_seconds": {}})
    assert "12.50% (peak measured: float32" in text


def test_the_cpu_peak_is_measured_in_the_dtype_the_actor_computes_in() -> None:
    from types import SimpleNamespace

    from verity_harness.machine import Machine
    from verity_harness.runner import actor_compute_dtype, check_peak_dtype, with_measured_cpu_peak

    def cfg(mixed, model_dtype="float32", engine="fsdp2"):
        return SimpleNamespace(
            trainer=SimpleNamespace(n_workers=1, cpus_per_worker=1.0),
            model=SimpleNamespace(dtype=model_dtype),
            actor=SimpleNamespace(engine=engine, fsdp2=SimpleNamespace(mixed_precision=mixed)),
        )

    assert actor_compute_dtype(cfg(None)) == "float32"
    assert actor_compute_dtype(cfg(True)) == "bfloat16"
    assert actor_compute_dtype(cfg(True, engine="megatron")) == "float32"
    assert actor_compute_dtype(cfg(None, model_dtype="bfloat16")) == "bfloat16"
    cpu = Machine(label="cpu", family="cpu", device_name="test cpu", peak_flops=None, device_count=1)
    _, source = with_measured_cpu_peak(cpu, cfg(True))
    assert source.startswith("measured: bfloat16 512x512 matmul on 1 threads")

    throughput = {"mfu": 0.3}
    check_peak_dtype(throughput, {"ran": {"actor_compute_dtype": "bfloat16"}}, "bfloat16")
    assert throughput == {"mfu": 0.3}
    check_peak_dtype(throughput, {"ran": {"actor_compute_dtype": "bfloat16"}}, "float32")
    assert throughput["mfu"] is None and "measured in float32 but the actor computed in bfloat16" in (
        throughput["mfu_note"]
    )


def test_the_peak_memory_is_the_largest_of_the_measured_steps() -> None:
    steps = [{**row, "perf/max_memory_gb": 1.0 + i / 10} for i, row in enumerate(_steps())]
    steps[0]["perf/max_memory_gb"] = 99.0  # step 1 (start-up) is left out like the rest of its figures
    assert throughput(steps)["max_memory_gb"] == pytest.approx(2.1)
    assert throughput(_steps())["max_memory_gb"] is None  # a run that recorded none
