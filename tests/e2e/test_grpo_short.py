"""A short GRPO run through the whole stack: Ray workers, FSDP2 over gloo, HF rollout, rewards, MLflow."""

from __future__ import annotations

import json

import pytest
from verity.config import load_config


def _overrides(paths: dict[str, str], out: str, steps: int = 2) -> list[str]:
    return [
        f"model.path={paths['model']}",
        f"data.train_files=[{paths['train']}]",
        f"data.val_files=[{paths['test']}]",
        "data.train_batch_size=8",
        "data.max_prompt_length=32",
        "data.max_response_length=6",
        "data.val_max_samples=32",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=8",
        "actor.optim.lr=1e-3",
        "algorithm.kl.use_kl_loss=true",
        f"trainer.total_steps={steps}",
        "trainer.n_workers=2",
        "trainer.cpus_per_worker=0.5",
        "trainer.progress=false",
        f"trainer.output_dir={out}",
    ]


@pytest.mark.slow
def test_grpo_runs_end_to_end_and_is_deterministic(tiny_model_and_task, tmp_path) -> None:
    from verity.launch.run import run_training

    first = run_training(load_config(_overrides(tiny_model_and_task, str(tmp_path / "a"))))
    assert first["steps"] == 2
    assert 0.0 <= first["accuracy_before"] <= 1.0
    rows = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for key in (
        "reward/mean",
        "actor/grad_norm",
        "actor/kl_loss",
        "timing/generate_s",
        "timing/weight_sync_s",
        "perf/tokens_per_s",
        "response_length/clip_ratio",
        "actor/entropy",
    ):
        assert key in rows[-1], key
    assert rows[-1]["actor/optimizer_steps"] == 2.0  # 8 prompts / mini-batch of 4
    # rollout.balance=load (the default) over the 2 replicas: every one of the 32 rows generated once
    assert rows[-1]["perf/rollout_rows_per_replica_max"] + rows[-1]["perf/rollout_rows_per_replica_min"] == 32
    # the step's rows crossed the driver: at least the generated responses came back to it
    responses = 8 * rows[-1]["response_length/mean"]  # tokens of 8 prompts x n samples, > 0
    assert rows[-1]["perf/driver_bytes_received"] >= responses > 0
    assert rows[-1]["perf/driver_bytes_sent"] > 0
    # each role's memory peak per method, largest over the ranks (CPU: the resident set)
    memory = {k: v for k, v in rows[-1].items() if k.startswith("memory/actor/")}
    assert {"memory/actor/generate_gb", "memory/actor/update_actor_gb"} <= set(memory), memory
    assert all(0.05 < v < 64 for v in memory.values()), memory  # a worker process with torch: not 0
    assert rows[-1]["perf/max_memory_gb"] == max(memory.values())
    for name in ("summary.json", "curves.png", "validation.jsonl", "mlflow.db"):
        assert (tmp_path / "a" / name).exists(), name

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=first["tracking_uri"])
    history = client.get_metric_history(first["run_id"], "reward/mean")
    assert [m.step for m in history] == [1, 2]

    second = run_training(load_config(_overrides(tiny_model_and_task, str(tmp_path / "b"))))
    rows_b = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows, rows_b, strict=True):
        for key in ("reward/mean", "actor/loss", "actor/grad_norm", "response_length/mean", "actor/kl_loss"):
            assert a[key] == b[key], (key, a[key], b[key])
    assert first["accuracy_after"] == second["accuracy_after"]
