"""Make ``verity_harness`` importable from a checkout where the harness is not installed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

if importlib.util.find_spec("verity_harness") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


import pytest  # noqa: E402


def make_result(**changes):
    """A synthetic, valid harness result document (see verity_harness.results)."""
    result = {
        "recipe": "grpo",
        "config": "cpu",
        "hardware": "cpu-test",
        "family": "cpu",
        "device_name": "Test CPU",
        "device_count": 1,
        "cpu_isa": "avx2",
        "backend": "hf",
        "train_engine": "fsdp2",
        "date": "2026-11-20",
        "finished_at": "2026-11-20T10:00:00+00:00",
        "git_commit": "0123456789abcdef",
        "git_dirty": False,
        "versions": {"verity": "0.1.0"},
        "scores": {
            "accuracy_before": 0.4,
            "accuracy_after": 0.7,
            "accuracy_gain": 0.3,
            "reward/mean_last10": 0.6,
        },
        "throughput": {
            "tokens_per_s": 1000.0,
            "generated_tokens_per_s": 2000.0,
            "train_tokens_per_s": 3000.0,
            "step_seconds": 2.0,
            "stage_seconds": {"generate": 0.5, "update_actor": 1.0},
            "mfu": None,
        },
        "checks": [],
        "passed": True,
        "curves": {
            "step": [1, 2, 3],
            "reward/mean": [0.2, 0.4, 0.6],
            "val_step": [0, 3],
            "val/acc": [0.4, 0.7],
        },
        "mlflow": {"run_id": None, "tracking_uri": None},
    }
    result.update(changes)
    return result


@pytest.fixture
def result_factory():
    return make_result
