"""What the actor and critic workers share: optimizer settings per role, the engine, the epoch loop."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import tiny_qwen2
from verity.batch import Batch
from verity.config import load_config
from verity.engines import OptimConfig
from verity.workers.role_training import (
    build_role_engine,
    minibatch_epochs,
    optimizer_steps_per_rl_step,
)


def _cfg():
    return load_config(
        [
            "data.train_batch_size=8",
            "actor.ppo_mini_batch_size=2",
            "actor.ppo_epochs=3",
            "actor.optim.lr=2e-4",
            "actor.optim.betas=[0.8,0.95]",
            "actor.optim.scheduler=cosine",
            "actor.optim.warmup_steps=2",
            "actor.optim.min_lr_ratio=0.1",
            "critic.enabled=true",  # a critic beside GRPO's advantages: its own optimizer settings count
            "critic.ppo_mini_batch_size=8",
            "critic.optim.grad_clip=0.5",
            "critic.optim.weight_decay=0.01",
            "trainer.total_steps=5",
        ]
    )


def test_each_role_has_its_own_optim_section():
    cfg = _cfg()
    assert cfg.actor.optim == OptimConfig(
        lr=2e-4,
        betas=[0.8, 0.95],
        weight_decay=0.0,
        grad_clip=1.0,
        warmup_steps=2,
        scheduler="cosine",
        min_lr_ratio=0.1,
    )
    critic = cfg.critic.optim
    assert (critic.lr, critic.grad_clip, critic.weight_decay) == (1e-5, 0.5, 0.01)
    assert optimizer_steps_per_rl_step(cfg, cfg.actor) == 4 * 3
    assert optimizer_steps_per_rl_step(cfg, cfg.critic) == 1


def test_role_engine_schedules_the_whole_run():
    cfg = _cfg()
    engine = build_role_engine(
        "actor", lambda: tiny_qwen2(seed=0), cfg, cfg.actor, torch.device("cpu"), "unused"
    )
    assert engine.name == "fsdp2"
    assert engine.optim_config is cfg.actor.optim
    assert engine.optimizer is not None and engine.device == torch.device("cpu")
    # the cosine horizon is the run's 12 x 5 = 60 optimizer steps: after warm-up 2, f(31) = 0.1 + 0.9 * 0.5
    assert engine.lr_scheduler.lr_lambdas[0](31) == pytest.approx(0.1 + 0.9 * 0.5)


def test_minibatch_epochs_steps_over_consecutive_rows_and_sums_metrics():
    batch = Batch.from_dict({"x": torch.arange(5)})
    seen = []

    def step(mini):
        seen.append(mini["x"].tolist())
        return {"loss": torch.tensor(float(len(seen))), "rows": len(mini)}

    sums, steps = minibatch_epochs(batch, 2, 2, step)
    assert seen == [[0, 1], [2, 3], [4]] * 2
    assert steps == 6 and sums == {"loss": 21.0, "rows": 10.0}
    assert all(type(v) is float for v in sums.values())
    assert minibatch_epochs(batch, 2, 0, step) == ({}, 0)


def test_minibatch_epochs_keeps_the_padding_rows_of_a_dp_split_marked():
    # 7 rows over 2 ranks: rank 1 holds rows 4-6 and a padding copy of row 0 (Batch.split)
    part = Batch.from_dict({"x": torch.arange(7)}).split(2)[1]
    assert part.pad_rows == 1
    seen = []

    def step(mini):
        seen.append((mini["x"].tolist(), mini.pad_rows))
        return {}

    minibatch_epochs(part, 3, 1, step)
    assert seen == [([4, 5, 6], 0), ([0], 1)]  # the last mini-batch is padding only
    seen.clear()
    minibatch_epochs(part, 2, 1, step)
    assert seen == [([4, 5], 0), ([6, 0], 1)]


class _FakeBackend:
    def __init__(self, visible: int) -> None:
        self.visible = visible

    def device_count(self) -> int:
        return self.visible

    def device(self, index: int) -> torch.device:
        return torch.device("cuda", index)


@pytest.mark.parametrize(("visible", "local_rank", "expected"), [(1, 3, 0), (0, 1, 0), (4, 3, 3), (2, 0, 0)])
def test_role_device_uses_index_0_under_isolation_else_the_local_rank(
    visible: int, local_rank: int, expected: int
) -> None:
    from verity.workers.role_training import role_device

    assert role_device(_FakeBackend(visible), local_rank) == torch.device("cuda", expected)


def test_ran_names_the_device_the_actor_computed_on():
    from verity.launch.roles import RoleGroups

    groups = RoleGroups(roles=[])
    groups.facts = {
        "actor": {"train_engine": "fsdp2", "device_name": "NVIDIA H200"},
        "critic": {"train_engine": "fsdp2", "device_name": "NVIDIA H100 80GB HBM3"},
    }
    ran = groups.ran()
    assert ran["device_name"] == "NVIDIA H200" and ran["critic"] == "fsdp2"
    assert "device_name" not in RoleGroups(roles=[], facts={"actor": {"train_engine": "fsdp2"}}).ran()


def test_ran_names_the_trainer_mode_from_the_roles_that_started():
    from verity.launch.roles import RoleGroups

    sync = RoleGroups(roles=[], handles={"actor": object()}, facts={"actor": {"train_engine": "fsdp2"}})
    assert sync.ran()["mode"] == "sync"
    # a rollout worker group of its own is what generates a step ahead (trainer.mode=async)
    both = RoleGroups(roles=[], handles={"actor": object(), "rollout": object()}, facts={})
    assert both.ran()["mode"] == "async"


def test_ran_says_when_the_loss_head_was_compiled():
    from verity.launch.roles import RoleGroups

    compiled = {"train_engine": "fsdp2", "train_compiled_layers": 24, "train_compiled_head": True}
    ran = RoleGroups(roles=[], facts={"actor": compiled}).ran()
    assert ran["actor_compiled_layers"] == "24" and ran["actor_compiled_head"] == "true"
    assert "actor_cuda_graphs" not in ran
    graphed = RoleGroups(roles=[], facts={"actor": {**compiled, "train_cuda_graphs": True}}).ran()
    assert graphed["actor_cuda_graphs"] == "true"
    eager = {"train_engine": "fsdp2", "train_compiled_layers": 0, "train_compiled_head": False}
    eager_ran = RoleGroups(roles=[], facts={"actor": eager}).ran()
    assert "actor_compiled_layers" not in eager_ran and "actor_compiled_head" not in eager_ran
