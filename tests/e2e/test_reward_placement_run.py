"""``reward.placement=workers`` through the whole stack: the ranks score the rows they generated, the
responses stay with them, and the run is the same run, with fewer bytes back through the driver."""

from __future__ import annotations

import json

import pytest
from verity.config import load_config


def _overrides(paths: dict[str, str], out: str, *extra: str) -> list[str]:
    return [
        f"model.path={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['test']}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        "data.val_max_samples=16",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=8",
        "actor.optim.lr=1e-3",
        "trainer.total_steps=3",
        "trainer.n_workers=2",
        "trainer.cpus_per_worker=0.5",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
        *extra,
    ]


def _metrics(out) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_scoring_on_the_workers_is_the_same_run_with_less_coming_back(
    tiny_model_and_task, tmp_path, mode
) -> None:
    from verity.trainer.run import run_training

    runs = {}
    for placement in ("driver", "workers"):
        out = tmp_path / placement
        summary = run_training(
            load_config(
                _overrides(
                    tiny_model_and_task,
                    str(out),
                    f"reward.placement={placement}",
                    f"trainer.mode={mode}",
                )
            )
        )
        runs[placement] = (summary, _metrics(out))
    (driver, driver_rows), (workers, worker_rows) = runs["driver"], runs["workers"]
    assert len(driver_rows) == len(worker_rows) == 3
    for a, b in zip(driver_rows, worker_rows, strict=True):
        assert a["reward/scored_on_workers"] == 0.0 and b["reward/scored_on_workers"] == 1.0
        for key in ("reward/mean", "actor/grad_norm", "actor/loss", "response_length/mean", "train/accuracy"):
            if key in a:
                assert a[key] == b[key], (key, a[key], b[key])
        # the responses stayed on the workers: back came a few scalars a row
        assert b["perf/driver_bytes_received"] < a["perf/driver_bytes_received"], (a, b)
    # held-out evaluation is scored on the driver either way
    assert driver["accuracy_after"] == workers["accuracy_after"]
