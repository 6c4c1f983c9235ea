"""The loop's per-step throughput figures when a stage generated more rows than the batch keeps."""

from __future__ import annotations

import pytest
import torch
from verity.batch import Batch
from verity.config import load_config
from verity.trainer.loop import RLTrainer
from verity.trainer.stages import Stage


def _batch() -> Batch:
    mask = torch.ones(4, 3, dtype=torch.long)
    return Batch.from_dict(
        {
            "attention_mask": torch.ones(4, 5, dtype=torch.long),
            "response_mask": mask,
            "scores": torch.zeros(4),
        }
    )


def _oversampling(ctx, batch):
    ctx.metrics["timing/generate_s"] = 2.0  # seconds spent sampling inside the stage
    ctx.metrics["perf/generated_tokens"] = 48.0  # it sampled 4x the rows it kept
    return _batch()


def test_generated_tokens_per_s_counts_every_sampled_token_when_a_stage_reports_them():
    trainer = RLTrainer(
        load_config([]), [Stage("oversampling", _oversampling)],
        roles={"actor": None}, rewards=None, train_batches=None, val_batches=None,
    )  # fmt: skip
    metrics = trainer.step(1, _batch())
    assert metrics["perf/generated_tokens_per_s"] == pytest.approx(48.0 / 2.0)
    assert metrics["perf/total_tokens"] == 20.0  # the trained batch's tokens


def test_without_the_report_the_batch_response_tokens_count():
    def plain(ctx, batch):
        ctx.metrics["timing/generate_s"] = 2.0
        return _batch()

    trainer = RLTrainer(
        load_config([]),
        [Stage("plain", plain)],
        roles={"actor": None},
        rewards=None,
        train_batches=None,
        val_batches=None,
    )
    assert trainer.step(1, _batch())["perf/generated_tokens_per_s"] == pytest.approx(12.0 / 2.0)
