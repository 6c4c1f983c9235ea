"""A stage that outlives trainer.stage_timeout_s in real Ray workers fails naming the stage, busy ranks, stacks."""

from __future__ import annotations

import sys
import time

import pytest
import ray
import ray.cloudpickle
import torch
from verity.batch import Batch
from verity.config import load_config
from verity.controller import Dispatch, ResourcePool, Worker, WorkerGroup, init_ray, register, shutdown_ray
from verity.trainer.loop import RLTrainer, RunHooks
from verity.trainer.stage_guard import StageGuard, StageTimeoutError
from verity.trainer.stages import Stage

# Worker classes defined here travel to the Ray workers by value (this file is not importable there).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NappingWorker(Worker):
    @register(Dispatch.BROADCAST)
    def nap(self, seconds: float) -> int:
        """Sleep (a hung collective, a slow generation), then answer the rank."""
        time.sleep(seconds)
        return self.rank

    @register(Dispatch.BROADCAST)
    def ping(self) -> int:
        return self.rank


@pytest.fixture(scope="module")
def group():
    if ray.is_initialized():
        ray.shutdown()
    init_ray(num_cpus=2, object_store_memory=100 * 1024**2)
    pool = ResourcePool([2], cpus_per_bundle=0.5, name="nappers", timeout_s=30)
    wg = WorkerGroup(pool, NappingWorker, name="actor")
    yield wg
    wg.shutdown()
    pool.remove()
    shutdown_ray()


def test_stacks_answer_while_a_method_runs(group):
    call = group.nap.submit(3.0)
    time.sleep(1.0)
    stacks = group.stacks(timeout_s=10)
    assert sorted(stacks) == [0, 1]
    for rank in (0, 1):
        busy = stacks[rank]["busy"]
        assert busy["method"] == "nap" and busy["seconds"] > 0.5
        assert "in nap" in busy["stack"] and "time.sleep" in busy["stack"]
    assert call.result() == [0, 1]
    idle = group.stacks(timeout_s=10)
    assert idle[0]["busy"] is None and idle[1]["busy"] is None


def test_a_stage_over_its_limit_fails_naming_the_stage(group):
    def generate(ctx, batch: Batch) -> Batch:
        ctx.actor.nap(60.0)
        return batch

    cfg = load_config(["trainer.progress=false"])
    trainer = RLTrainer(
        cfg,
        [Stage("generate", generate)],
        roles={"actor": group},
        rewards=None,
        train_batches=None,
        val_batches=None,
        hooks=RunHooks(stage_guard=StageGuard(2.0, {"actor": group})),
    )
    prompts = Batch.from_dict({"input_ids": torch.ones(2, 3, dtype=torch.long)})
    start = time.monotonic()
    with pytest.raises(StageTimeoutError) as info:
        trainer.step(5, prompts)
    assert time.monotonic() - start < 30.0
    err = info.value
    assert err.stage == "generate" and err.step == 5
    assert sorted(rank for _, rank, method, _ in err.busy if method == "nap") == [0, 1]
    message = str(err)
    assert "stage 'generate' at step 5 exceeded trainer.stage_timeout_s = 2 s" in message
    assert "actor rank 0 (nap), actor rank 1 (nap)" in message
    assert message.count("in nap") == 2 and "driver (main thread)" in message
