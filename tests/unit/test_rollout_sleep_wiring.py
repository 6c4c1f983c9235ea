"""The actor worker wakes its rollout before generating and puts it to sleep after (memory back to training)."""

from __future__ import annotations

import torch
from verity.batch import Batch
from verity.config import load_config
from verity.rollout.base import RolloutEngine
from verity.workers.actor_rollout import ActorRolloutRefWorker
from verity.workers.rollout_side import RowScorer


class RecordingRollout(RolloutEngine):
    name = "recording"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def generate(self, batch: Batch, params) -> Batch:  # noqa: ANN001 - the interface's SamplingParams
        self.calls.append("generate")
        return Batch.from_dict({"responses": torch.zeros(len(batch), 2, dtype=torch.long)})

    def load_weights(self, named_tensors) -> int:  # noqa: ANN001
        return 0

    def set_seed(self, seed: int) -> None:
        self.calls.append("seed")

    def sleep(self) -> None:
        self.calls.append("sleep")

    def wake(self) -> None:
        self.calls.append("wake")


def test_generate_wakes_the_rollout_first_and_puts_it_to_sleep_after() -> None:
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.cfg = load_config(["rollout.micro_batch_size=2"])
    worker.rollout = RecordingRollout()  # no seed in the batch: the rank is not read
    worker.pad_token_id = 0
    worker.score_rows = RowScorer(worker.cfg, tokenizer=None)
    prompts = Batch.from_dict({"input_ids": torch.ones(3, 4, dtype=torch.long)})
    out = ActorRolloutRefWorker.generate(worker, prompts)
    assert len(out) == 3
    assert worker.rollout.calls == ["wake", "generate", "generate", "sleep"]  # 2 chunks of <= 2 rows


def test_a_load_balanced_chunk_leaves_waking_and_sleeping_to_the_calls_around_it() -> None:
    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.cfg = load_config(["rollout.micro_batch_size=4"])
    worker.rollout = RecordingRollout()
    worker.pad_token_id = 0
    worker.score_rows = RowScorer(worker.cfg, tokenizer=None)
    worker.set_dp_layout(0, 2, True, name="rollout")
    chunk = Batch.from_dict({"input_ids": torch.ones(3, 4, dtype=torch.long)}, meta={"chunk_index": 5})
    worker.prepare_generate()
    ActorRolloutRefWorker.generate(worker, chunk)
    ActorRolloutRefWorker.generate(worker, chunk)
    worker.release_generate()
    assert worker.rollout.calls == ["wake", "generate", "generate", "sleep"]
