"""``rollout.balance=load`` through the whole stack in ``trainer.mode=async``: two rollout workers take
chunks as they finish while the actor trains, and a rerun with the same seed is the same run."""

from __future__ import annotations

import json

import pytest
from verity.config import load_config

pytestmark = pytest.mark.slow  # two 2-step async runs: about 2 min on 2 cores


def _metrics(out) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_async_rollout_group_balanced_by_load_reruns_the_same(tiny_grpo_overrides, tmp_path) -> None:
    from verity.launch.run import run_training

    extra = (
        "trainer.mode=async",
        "trainer.n_workers=1",
        "rollout.n_workers=2",
        "rollout.balance_chunk_rows=4",  # 32 rows: 8 chunks of one prompt's 4 samples
        "trainer.total_steps=2",
    )
    runs = []
    for name in ("a", "b"):
        run_training(load_config(tiny_grpo_overrides(str(tmp_path / name), *extra)))
        runs.append(_metrics(tmp_path / name))
    first, second = runs
    assert len(first) == len(second) == 2
    for a, b in zip(first, second, strict=True):
        assert a["perf/rollout_rows_per_replica_max"] + a["perf/rollout_rows_per_replica_min"] == 32
        assert a["perf/rollout_rows_per_replica_min"] % 4 == 0  # whole prompt groups
        for key in ("reward/mean", "response_length/mean", "actor/loss", "actor/grad_norm"):
            assert a[key] == b[key], (key, a[key], b[key])
        assert a["async/staleness_max"] <= 1.0
