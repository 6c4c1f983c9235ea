"""Offload on CUDA (``fsdp2.offload_params`` / ``offload_optimizer``): the same losses, less device memory.

Needs a GPU (skipped elsewhere). A one-rank process group (gloo for host tensors, NCCL for the
device's, as the workers form it when parameters are offloaded) gives the engine FSDP2 sharding,
which ``offload_params`` needs.
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.distributed as dist
from helpers.tiny_models import make_unpadded_batch, push_up_loss, tiny_qwen2
from verity.engines import FSDP2Engine, OptimConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = 2


@pytest.fixture(scope="module", autouse=True)
def group():
    """One rank over ``cpu:gloo,cuda:nccl`` (what ``process_group_backend`` forms under offload)."""
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _train(**offload) -> tuple[list[float], int, FSDP2Engine]:
    """Two optimizer steps and the end of the update phase: (losses, device bytes the engine holds, engine)."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    engine = FSDP2Engine(tiny_qwen2(tie_word_embeddings=False), OptimConfig(lr=1e-3), device="cuda", **offload)
    batch = make_unpadded_batch(4, seed=1)
    losses = [engine.train_step(batch, push_up_loss, 2)["loss"] for _ in range(STEPS)]
    engine.update_finished()
    torch.cuda.synchronize()
    return losses, torch.cuda.memory_allocated() - before, engine


def _release(engine: FSDP2Engine) -> None:
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def _state_devices(engine: FSDP2Engine) -> set[str]:
    devices = set()
    for state in engine.optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value):
                local = value.to_local() if hasattr(value, "to_local") else value
                devices.add(local.device.type)
    return devices


@pytest.mark.parametrize("key", ["offload_params", "offload_optimizer"])
def test_offloaded_training_gives_the_same_losses_with_less_device_memory(key):
    plain_losses, plain_bytes, plain = _train()
    param_bytes = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    state_bytes = plain.optimizer_state_bytes()
    _release(plain)
    losses, held, engine = _train(**{key: True})
    for a, b in zip(losses, plain_losses, strict=True):
        assert math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-5), (losses, plain_losses)
    assert _state_devices(engine) == {"cpu"}  # AdamW's state is in host memory after the update
    # what left the device: AdamW's state, and with offload_params the parameters as well
    freed = state_bytes + (param_bytes if key == "offload_params" else 0)
    assert plain_bytes - held >= 0.8 * freed, (plain_bytes, held, freed)
    if key == "offload_params":
        local = next(engine.model.parameters()).to_local()
        assert local.device.type == "cpu" and local.is_pinned()
    else:
        assert engine.optimizer_offload.on_host
        engine.train_step(make_unpadded_batch(4, seed=2), push_up_loss, 2)  # the state comes back for it
        assert _state_devices(engine) == {"cuda"} and not engine.optimizer_offload.on_host
    _release(engine)


def test_an_offloaded_reference_scores_like_a_resident_one():
    batch = make_unpadded_batch(4, seed=3)
    resident = FSDP2Engine(tiny_qwen2(tie_word_embeddings=False), None, device="cuda")
    expected, _ = resident.compute_logprobs(batch, 2, compute_entropy=False)
    _release(resident)
    offloaded = FSDP2Engine(tiny_qwen2(tie_word_embeddings=False), None, device="cuda", offload_params=True)
    logprobs, _ = offloaded.compute_logprobs(batch, 2, compute_entropy=False)
    assert torch.allclose(logprobs, expected, atol=1e-5)
