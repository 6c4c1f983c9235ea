"""Cross-process weight sync (trainer.mode=async): the actor group publishes its weights in buckets through
Ray's object store and the standalone rollout group loads them; afterwards the rollout's weights equal the
trainer's exactly, before and after an update.

The rollout worker starts from scrambled weights, so a sync that missed a tensor would show.
"""

from __future__ import annotations

import sys

import pytest
import ray
import ray.cloudpickle
import torch
from verity.batch import Batch
from verity.controller import Dispatch, ResourcePool, WorkerGroup, init_ray, register, shutdown_ray
from verity.workers.rollout_worker import RolloutWorker

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class ScrambledRolloutWorker(RolloutWorker):
    """A rollout rank whose weights start as noise (not the model folder's)."""

    @register(Dispatch.BROADCAST)
    def init_model(self):
        facts = super().init_model()
        generator = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in self.rollout.model.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
        return facts


@pytest.fixture(scope="module")
def ray_cluster():
    init_ray(num_cpus=2, object_store_memory=100 * 1024**2)
    yield
    shutdown_ray()


def _model(tmp_path) -> str:
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    return str(tmp_path / "model")


def _assert_equal(actor_weights: dict, rollout_weights: dict) -> None:
    assert set(actor_weights) <= set(rollout_weights)
    for name, tensor in actor_weights.items():
        assert torch.equal(tensor, rollout_weights[name]), name


def test_rollout_weights_equal_the_trainers_after_each_sync(ray_cluster, tmp_path) -> None:
    from verity.config import load_config
    from verity.trainer.async_rollout import AsyncRollout
    from verity.trainer.stages import SEQUENCE_KEYS, training_rows
    from verity.workers.actor_rollout import ActorRolloutRefWorker

    path = _model(tmp_path)
    cfg = load_config(
        [
            f"model.path={path}",
            "trainer.mode=async",
            "trainer.n_workers=1",
            "trainer.cpus_per_worker=0.5",
            "data.train_batch_size=2",
            "data.max_response_length=4",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=2",
            "actor.optim.lr=1e-2",
            "reward.placement=driver",  # these prompts carry no reward columns: nothing is scored here
        ]
    )
    actor = WorkerGroup(
        ResourcePool([1], cpus_per_bundle=0.5, name="actor"), ActorRolloutRefWorker, cfg, path, path
    )
    group = WorkerGroup(
        ResourcePool([1], cpus_per_bundle=0.5, name="rollout"), ScrambledRolloutWorker, cfg, path, path
    )
    try:
        actor.init_model()
        rollout = AsyncRollout(cfg, group)
        rollout.init_model()
        before = actor.named_weights()
        assert not all(torch.equal(t, group.named_weights()[n]) for n, t in before.items())

        metrics = rollout.sync_from(actor, 0)
        _assert_equal(before, group.named_weights())
        assert metrics["async/weight_sync_bytes"] == sum(
            t.numel() * t.element_size() for t in before.values()
        )

        # one update on a batch the rollout generated, then the next sync
        ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
        mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
        prompts = Batch.from_dict(
            {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
        )
        rollout.submit(1, training_rows(cfg, prompts, 1))
        batch = rollout.take(1)
        assert batch["policy_version"].tolist() == [0, 0, 0, 0]
        batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * batch["response_mask"].float()
        actor.update_actor(batch.select(*SEQUENCE_KEYS, "response_mask", "advantages"))
        after = actor.named_weights()
        assert not all(torch.equal(t, before[n]) for n, t in after.items())  # the update moved the weights
        rollout.sync_from(actor, 1)
        _assert_equal(after, group.named_weights())
        assert rollout.version == 1
    finally:
        group.shutdown()
        actor.shutdown()
