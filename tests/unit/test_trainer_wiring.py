"""A run's parts are passed to the trainer at construction: step-end hooks in order, resumed state, metrics.jsonl."""

from __future__ import annotations

import json

import torch
from verity.batch import Batch
from verity.config.loader import load_config
from verity.tracking.metrics_file import METRICS_FILE, MetricsFile
from verity.trainer.loop import RLTrainer, RunHooks, RunStart, TrainResult
from verity.trainer.role_handles import GroupView, worker_group_of
from verity.trainer.stages import Stage


class _Prompts:
    def next_batch(self) -> Batch:
        return Batch.from_dict(
            {
                "attention_mask": torch.ones(2, 4, dtype=torch.long),
                "response_mask": torch.ones(2, 2),
                "scores": torch.arange(2, dtype=torch.float32),
            }
        )


def _trainer(tmp_path, steps: int, start: RunStart | None = None, **hooks) -> RLTrainer:
    cfg = load_config(
        [
            f"trainer.total_steps={steps}",
            "trainer.val_every=0",
            "trainer.val_before_train=false",
            "trainer.progress=false",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    trainer = RLTrainer(
        cfg,
        [Stage("noop", lambda ctx, batch: batch)],
        roles={"actor": None},
        rewards=None,
        train_batches=_Prompts(),
        val_batches=lambda: iter(()),
        hooks=RunHooks(**hooks),
        start=start,
    )
    trainer.validate = lambda step: {"val/acc": 0.0}  # no model: the held-out pass is not under test
    return trainer


def test_step_end_hooks_run_in_the_order_given_after_every_step(tmp_path) -> None:
    calls: list[tuple[str, int, int]] = []

    def first(step, result):
        calls.append(("first", step, len(result.history)))

    def second(step, result):
        calls.append(("second", step, len(result.history)))

    result = _trainer(tmp_path, 2, step_end=(first, second)).fit()
    assert calls == [("first", 1, 1), ("second", 1, 1), ("first", 2, 2), ("second", 2, 2)]
    assert [row["train/step"] for row in result.history] == [1.0, 2.0]


def test_a_resumed_trainer_continues_from_its_start_step_and_result(tmp_path) -> None:
    done = TrainResult(history=[{"train/step": 1.0}, {"train/step": 2.0}], wall_seconds=5.0)
    steps: list[int] = []
    result = _trainer(tmp_path, 4, RunStart(2, done), step_end=[lambda s, r: steps.append(s)]).fit()
    assert steps == [3, 4]
    assert result is done and [row["train/step"] for row in result.history] == [1.0, 2.0, 3.0, 4.0]
    assert result.wall_seconds > 5.0


def test_metrics_file_rewrites_on_start_and_appends_each_step(tmp_path) -> None:
    metrics = MetricsFile(tmp_path)
    assert metrics.path == tmp_path / METRICS_FILE
    metrics.start([{"train/step": 1.0, "reward/mean": 0.5}])
    _trainer(
        tmp_path, 3, RunStart(1, TrainResult(history=[{"train/step": 1.0}])), step_end=[metrics]
    ).fit()
    rows = [json.loads(line) for line in metrics.path.read_text().splitlines()]
    assert [row["train/step"] for row in rows] == [1.0, 2.0, 3.0]
    assert rows[0] == {"train/step": 1.0, "reward/mean": 0.5}  # the kept history, as the checkpoint had it
    metrics.start([])
    assert metrics.path.read_text() == ""


def test_worker_group_of_a_view_is_its_group_and_of_a_group_itself() -> None:
    class Group:
        name = "actor"

    class View:
        def __init__(self, group):
            self._group = group

        @property
        def group(self):
            return self._group

    group = Group()
    assert isinstance(View(group), GroupView) and not isinstance(group, GroupView)
    assert worker_group_of(View(group)) is group
    assert worker_group_of(group) is group
