"""What the actor and critic workers share: optimizer settings per role, the engine, the update loop."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import tiny_qwen2
from verity.batch import Batch
from verity.config import load_config
from verity.engines import OptimConfig
from verity.engines.model_source import ModelSource
from verity.workers.report import TrainingFacts, WorkerReport
from verity.workers.role_training import (
    UpdateSchedule,
    build_role_engine,
    mini_batches,
    optimizer_steps_per_rl_step,
    update_epochs,
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


def test_role_engine_schedules_the_whole_run(tmp_path):
    cfg = _cfg()
    tiny_qwen2(seed=0).save_pretrained(tmp_path)
    engine = build_role_engine("actor", ModelSource(str(tmp_path)), cfg, cfg.actor, torch.device("cpu"))
    assert engine.name == "fsdp2"
    assert engine.optim_config is cfg.actor.optim
    assert engine.optimizer is not None and engine.device == torch.device("cpu")
    # the cosine horizon is the run's 12 x 5 = 60 optimizer steps: after warm-up 2, f(31) = 0.1 + 0.9 * 0.5
    assert engine.lr_scheduler.lr_lambdas[0](31) == pytest.approx(0.1 + 0.9 * 0.5)


class _RecordingEngine:
    """Records the update loop's calls: each forward_backward's rows and options, each optimizer step."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def forward_backward(self, mini, loss_fn, micro_batch_size, **options):
        self.calls.append(("forward_backward", mini["x"].tolist(), micro_batch_size, options))
        return {"loss": torch.tensor(float(len(self.calls))), "tokens": float(len(mini))}

    def forward_backward_values(self, mini, loss_fn, micro_batch_size):
        self.calls.append(("forward_backward_values", mini["x"].tolist(), micro_batch_size, {}))
        return {"loss": 1.0, "tokens": float(len(mini))}

    def optimizer_step(self):
        self.calls.append(("optimizer_step",))
        return {"grad_norm": 0.5}

    def update_finished(self):
        self.calls.append(("update_finished",))


def test_the_update_loop_takes_one_optimizer_step_per_mini_batch_of_every_epoch():
    engine, batch = _RecordingEngine(), Batch.from_dict({"x": torch.arange(5)})
    schedule = UpdateSchedule(epochs=2, rows_per_mini_batch=2, micro_batch_size=1)
    steps = update_epochs(engine, batch, None, schedule, temperature=0.7)
    passes = [c for c in engine.calls if c[0] == "forward_backward"]
    assert [c[1] for c in passes] == [[0, 1], [2, 3], [4]] * 2
    assert all(c[2] == 1 and c[3] == {"temperature": 0.7} for c in passes)
    assert [c[0] for c in engine.calls] == ["forward_backward", "optimizer_step"] * 6 + ["update_finished"]
    assert steps.steps == 6 and steps.sums["tokens"] == 10.0 and steps.sums["grad_norm"] == 3.0
    assert all(type(v) is float for v in steps.sums.values()) and "step_seconds" in steps.sums
    means = steps.means("actor", renamed={"grad_norm": "norm"})
    assert means["actor/norm"] == 0.5 and means["actor/optimizer_steps"] == 6.0
    assert update_epochs(engine, batch, None, UpdateSchedule(0, 2, 1)).steps == 0


def test_the_update_loop_hands_each_mini_batch_its_share_of_the_rows_to_run():
    engine, batch = _RecordingEngine(), Batch.from_dict({"x": torch.arange(5)})
    rows = torch.tensor([True, False, False, True, True])
    update_epochs(engine, batch, None, UpdateSchedule(1, 2, 2), train_rows=rows)
    shares = [c[3]["train_rows"].tolist() for c in engine.calls if c[0] == "forward_backward"]
    assert shares == [[True, False], [False, True], [True]]
    update_epochs(engine, batch, None, UpdateSchedule(1, 5, 5), values=True)
    assert engine.calls[-3][:2] == ("forward_backward_values", [0, 1, 2, 3, 4])


def test_mini_batches_keep_the_padding_rows_of_a_dp_split_marked():
    # 7 rows over 2 ranks: rank 1 holds rows 4-6 and a padding copy of row 0 (Batch.split)
    part = Batch.from_dict({"x": torch.arange(7)}).split(2)[1]
    assert part.pad_rows == 1
    seen = [(mini["x"].tolist(), mini.pad_rows) for _, mini in mini_batches(part, 3)]
    assert seen == [([4, 5, 6], 0), ([0], 1)]  # the last mini-batch is padding only
    seen = [(rows, mini["x"].tolist(), mini.pad_rows) for rows, mini in mini_batches(part, 2)]
    assert seen == [(slice(0, 2), [4, 5], 0), (slice(2, 4), [6, 0], 1)]


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


def _report(device_name: str | None = None, **training) -> WorkerReport:
    facts = TrainingFacts(engine="fsdp2", compute_dtype="float32", **training)
    return WorkerReport(rank=0, device_name=device_name, training=facts)


def test_ran_names_the_device_the_actor_computed_on():
    from verity.launch.roles import RoleGroups

    groups = RoleGroups(roles=[])
    groups.reports = {
        "actor": _report("NVIDIA H200"),
        "critic": _report("NVIDIA H100 80GB HBM3"),
    }
    ran = groups.ran()
    assert ran["device_name"] == "NVIDIA H200" and ran["critic"] == "fsdp2"
    assert "device_name" not in RoleGroups(roles=[], reports={"actor": _report()}).ran()


def test_ran_names_the_trainer_mode_from_the_roles_that_started():
    from verity.launch.roles import RoleGroups

    sync = RoleGroups(roles=[], handles={"actor": object()}, reports={"actor": _report()})
    assert sync.ran()["mode"] == "sync"
    # a rollout worker group of its own is what generates a step ahead (trainer.mode=async)
    both = RoleGroups(roles=[], handles={"actor": object(), "rollout": object()}, reports={})
    assert both.ran()["mode"] == "async"


def test_ran_says_when_the_loss_head_was_compiled():
    from verity.launch.roles import RoleGroups

    compiled = {"compiled_layers": 24, "compiled_head": True}
    ran = RoleGroups(roles=[], reports={"actor": _report(**compiled)}).ran()
    assert ran["actor_compiled_layers"] == "24" and ran["actor_compiled_head"] == "true"
    assert "actor_cuda_graphs" not in ran
    graphed = RoleGroups(roles=[], reports={"actor": _report(**compiled, cuda_graphs=True)}).ran()
    assert graphed["actor_cuda_graphs"] == "true"
    eager_ran = RoleGroups(roles=[], reports={"actor": _report()}).ran()
    assert "actor_compiled_layers" not in eager_ran and "actor_compiled_head" not in eager_ran


def test_a_plug_in_roles_dict_answer_becomes_a_report():
    report = WorkerReport.from_answer({"rank": 1, "n_params": 7, "pid": 42})
    assert (report.rank, report.n_params, report.extra) == (1, 7, {"pid": 42})
    assert report.ran("demo") == {}
