"""One step of the RL loop: the stages in order, and a step that a stage leaves without rows."""

from __future__ import annotations

import torch
from verity.batch import Batch
from verity.config import load_config
from verity.trainer.loop import RLTrainer
from verity.trainer.stages import Stage


def _rows(n: int) -> Batch:
    return Batch.from_dict(
        {
            "attention_mask": torch.ones(n, 4, dtype=torch.long),
            "response_mask": torch.ones(n, 2),
            "scores": torch.arange(n, dtype=torch.float32),
        }
    )


def test_a_stage_that_leaves_no_rows_ends_the_step_without_the_remaining_stages() -> None:
    ran: list[str] = []

    def stage(name: str, keep: bool):
        def run(ctx, batch):
            ran.append(name)
            ctx.metrics[f"test/{name}"] = float(len(batch))
            return batch if keep else batch.index(torch.zeros(len(batch), dtype=torch.bool))

        return Stage(name, run)

    stages = [stage("first", True), stage("drop_all", False), stage("update", True)]
    trainer = RLTrainer(
        load_config([]), stages, roles={"actor": None}, rewards=None, train_batches=None, val_batches=None
    )
    metrics = trainer.step(1, _rows(3))
    assert ran == ["first", "drop_all"]
    assert metrics["train/step_skipped"] == 1.0
    assert metrics["test/first"] == 3.0 and metrics["test/drop_all"] == 3.0
    assert "timing/update_s" not in metrics and metrics["perf/total_tokens"] == 0.0
    assert "reward/mean" not in metrics  # no rows: no batch statistics

    ran.clear()
    trainer.stages = [stage("first", True), stage("update", True)]
    metrics = trainer.step(2, _rows(3))
    assert ran == ["first", "update"] and "train/step_skipped" not in metrics
    assert metrics["reward/mean"] == 1.0 and metrics["perf/total_tokens"] == 12.0
