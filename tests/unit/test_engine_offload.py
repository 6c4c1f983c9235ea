"""Offload (``fsdp2.offload_params`` / ``offload_optimizer``): what can be checked on a CPU.

The moves themselves need an accelerator (tests/unit/test_engine_offload_gpu.py); here: the
optimizer-state move functions touch every tensor and nothing else and keep the values, the
engine refuses offload where it cannot apply before it loads anything, and the update loop
tells the engine when an update phase ends.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_padded_batch, push_up_loss, tiny_qwen2
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.offload import (
    OptimizerStateOffload,
    check_offload,
    host_collectives_backend,
    move_optimizer_state,
    offload_policy,
    restore_optimizer_state,
)


class Traced(torch.Tensor):
    """A tensor that records every ``.to(...)`` called on it (what a move touched)."""

    calls: list[tuple[int, tuple]] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            cls.calls.append((id(args[0]), args[1:]))
        return super().__torch_function__(func, types, args, kwargs or {})


def _stepped_adamw(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.AdamW]:
    """A small model and the AdamW that took one step on it (so every state tensor exists)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model(torch.randn(6, 5)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def test_a_move_touches_every_state_tensor_and_leaves_the_rest():
    _, optimizer = _stepped_adamw()
    expected_tensors = set()
    others = {}
    for param, state in optimizer.state.items():
        for key, value in list(state.items()):
            state[key] = value.as_subclass(Traced)
            expected_tensors.add(id(state[key]))
        state["note"] = f"not a tensor {key}"  # a non-tensor value must come back as the same object
        others[id(param)] = state["note"]
    Traced.calls.clear()
    origins, moved = move_optimizer_state(optimizer, "cpu")
    assert {obj for obj, _ in Traced.calls} == expected_tensors  # every tensor, once each
    assert all(args[0] == torch.device("cpu") or args[0] == "cpu" for _, args in Traced.calls)
    assert origins == {} and moved == 0  # already on the host: nothing to bring back later
    for param, state in optimizer.state.items():
        assert state["note"] is others[id(param)]


def test_the_offload_round_trip_keeps_values_and_step_counts():
    model, optimizer = _stepped_adamw()
    before = {
        (id(p), k): v.clone() for p, s in optimizer.state.items() for k, v in s.items() if torch.is_tensor(v)
    }
    assert {k for _, k in before} == {"step", "exp_avg", "exp_avg_sq"}
    offload = OptimizerStateOffload(optimizer)
    offload.to_host()
    offload.to_device()
    assert not offload.on_host
    after = {(id(p), k): v for p, s in optimizer.state.items() for k, v in s.items() if torch.is_tensor(v)}
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    # and the next step is the step an optimizer that never moved takes
    twin, reference = _stepped_adamw()
    for m, opt in ((model, optimizer), (twin, reference)):
        torch.manual_seed(1)
        m(torch.randn(6, 5)).square().sum().backward()
        opt.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert all(float(s["step"]) == 2.0 for s in optimizer.state.values())


def test_restore_moves_only_the_tensors_it_was_told_about():
    _, optimizer = _stepped_adamw()
    param = next(iter(optimizer.state))
    # a recorded origin equal to where the tensor is: nothing to copy, nothing counted
    assert restore_optimizer_state(optimizer, {(id(param), "exp_avg"): torch.device("cpu")}) == 0
    assert restore_optimizer_state(optimizer, {}) == 0
    assert OptimizerStateOffload(optimizer).to_device() == 0  # nothing was away


@pytest.mark.parametrize(
    ("device", "kwargs", "message"),
    [
        ("cpu", {"offload_params": True}, r"offload_params=True moves tensors .* computes on the CPU"),
        ("cpu", {"offload_optimizer": True}, r"offload_optimizer=True moves tensors .* computes on the CPU"),
        ("cuda", {"offload_params": 1}, r"offload_params must be True or False, got 1"),
        (
            "cuda",
            {"offload_params": True, "offload_optimizer": True},
            r"offload_params=True already keeps the AdamW state in host memory",
        ),
        ("cuda", {"offload_params": True, "sharding": "replicate"}, r"sharding='replicate' keeps a whole copy"),
        ("cuda", {"offload_params": True}, r"needs a torch.distributed process group"),
        ("cuda", {"offload_optimizer": True, "has_optimizer": False}, r"without an optimizer"),
    ],
)
def test_check_offload_names_what_rules_it_out(device, kwargs, message):
    settings = {"offload_params": False, "offload_optimizer": False, "sharding": "full", "has_optimizer": True}
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        check_offload(torch.device(device), **settings)


def test_check_offload_accepts_the_optimizer_offload_on_an_accelerator():
    # no process group needed, and replicate is fine: the state moves whatever the layout
    for sharding in ("full", "replicate"):
        check_offload(
            torch.device("cuda"),
            offload_params=False,
            offload_optimizer=True,
            sharding=sharding,
            has_optimizer=True,
        )


def test_the_engine_refuses_offload_on_the_cpu_before_loading_anything():
    with pytest.raises(ValueError, match=r"offload_params=True moves tensors .* on the CPU"):
        FSDP2Engine("/no/such/checkpoint", OptimConfig(), device="cpu", offload_params=True)
    with pytest.raises(ValueError, match=r"offload_optimizer=True moves tensors .* on the CPU"):
        FSDP2Engine(tiny_qwen2(), OptimConfig(), device="cpu", offload_optimizer=True)


def test_without_offload_the_engine_has_no_state_mover_and_update_finished_is_harmless():
    engine = FSDP2Engine(tiny_qwen2(), OptimConfig(lr=1e-3), device="cpu")
    assert engine.optimizer_offload is None and engine.offload_params is False
    engine.train_step(make_padded_batch(), push_up_loss, 4)
    engine.update_finished()
    assert all(v.device.type == "cpu" for s in engine.optimizer.state.values() for v in s.values())


def test_offload_policy_and_the_backend_for_host_collectives():
    assert isinstance(offload_policy(True), CPUOffloadPolicy) and offload_policy(True).pin_memory
    assert type(offload_policy(False)) is OffloadPolicy
    assert host_collectives_backend("nccl", "cuda") == "cpu:gloo,cuda:nccl"
    assert host_collectives_backend("hccl", "npu") == "cpu:gloo,npu:hccl"
    assert host_collectives_backend("gloo", "cpu") == "gloo"
    assert host_collectives_backend("cpu:gloo,cuda:nccl", "cuda") == "cpu:gloo,cuda:nccl"


def test_the_update_loop_ends_each_phase_with_update_finished():
    from verity.batch import Batch
    from verity.workers.role_training import UpdateSchedule, update_epochs

    calls: list[str] = []

    class Engine:
        def forward_backward(self, mini, loss_fn, micro_batch_size, **kwargs):
            calls.append("forward_backward")
            return {"loss": 0.0, "tokens": 1.0}

        def optimizer_step(self):
            calls.append("optimizer_step")
            return {}

        def update_finished(self):
            calls.append("update_finished")

    batch = Batch.from_dict({"x": torch.zeros(4, 1)})
    update_epochs(Engine(), batch, None, UpdateSchedule(epochs=2, rows_per_mini_batch=2, micro_batch_size=2))
    assert calls == ["forward_backward", "optimizer_step"] * 4 + ["update_finished"]
