"""``reward.placement=workers`` through the whole stack: the ranks score the rows they generated, the
responses stay with them, and the run is the same run, with fewer bytes back through the driver."""

from __future__ import annotations

import json

import pytest
from verity.config import load_config


def _metrics(out) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_scoring_on_the_workers_is_the_same_run_with_less_coming_back(
    tiny_grpo_overrides, tmp_path, mode
) -> None:
    from verity.launch.run import run_training

    runs = {}
    for placement in ("driver", "workers"):
        out = tmp_path / placement
        summary = run_training(
            load_config(
                tiny_grpo_overrides(str(out), f"reward.placement={placement}", f"trainer.mode={mode}")
            )
        )
        runs[placement] = (summary, _metrics(out))
    (driver, driver_rows), (workers, worker_rows) = runs["driver"], runs["workers"]
    assert len(driver_rows) == len(worker_rows) == 3
    for a, b in zip(driver_rows, worker_rows, strict=True):
        assert a["reward/scored_on_workers"] == 0.0 and b["reward/scored_on_workers"] == 1.0
        for key in ("reward/mean", "acc/mean", "actor/grad_norm", "actor/loss", "response_length/mean"):
            assert a[key] == b[key], (key, a[key], b[key])
        # the responses stayed on the workers: back came a few scalars a row
        assert b["perf/driver_bytes_received"] < a["perf/driver_bytes_received"], (a, b)
    # held-out evaluation is scored on the driver either way
    assert driver["accuracy_after"] == workers["accuracy_after"]
