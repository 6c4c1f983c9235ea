"""The tiny Qwen3-MoE through FSDP2 on 2 gloo ranks vs one process: log-probs, router-loss gradients, replay.

Each decoder layer, its routed experts and router included, is one FSDP2 unit (the engine's default
wrapping): its ``[E, 2I, H]`` / ``[E, H, I]`` expert tensors are sharded on dim 0, so each rank holds
``E / 2`` whole experts' weights between passes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import VOCAB, initial_logprobs, make_padded_batch
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.moe_router import RouterSettings
from verity.rollout.moe_routes import RouterTap
from verity_toyworld.tiny_moe import build_tiny_moe

pytestmark = pytest.mark.slow  # two spawned ranks: about half a minute on 2 cores

WORLD = 2
SETTINGS = RouterSettings(aux_loss_coef=0.05, z_loss_coef=0.01, routing_replay=True)


def tiny_moe():
    return build_tiny_moe(
        VOCAB,
        "qwen3_moe",
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        experts=8,
        top_k=2,
        expert_intermediate=32,
        seed=0,
    )


def the_batch() -> dict[str, torch.Tensor]:
    """7 padded rows with the routes of a perturbed copy of the model (a sampler that routes differently)."""
    batch = make_padded_batch(rows=7)
    sampler = tiny_moe()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for name, p in sampler.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.5 * p.std() * torch.randn_like(p))
        with RouterTap(sampler) as tap:
            initial_logprobs(batch, sampler)
            routes = tap.routes()
    batch["routed_experts"] = routes.reshape(7, -1, *routes.shape[1:]).to(torch.int16)
    return batch


def push_up_loss(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def scenario(batch, out: dict) -> None:
    engine = FSDP2Engine(tiny_moe(), OptimConfig(lr=1e-3), router=SETTINGS)
    out["logprobs"], _ = engine.compute_logprobs(batch, micro_batch_size=2)
    out["metrics"] = engine.forward_backward(batch, push_up_loss, micro_batch_size=2)
    grads = {}
    for name, p in engine.model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name] = grad.detach().clone()
    out["grads"] = grads
    out["expert_shard"] = (
        tuple(
            p.to_local().shape
            for n, p in engine.model.named_parameters()
            if n.endswith("experts.gate_up_proj")
        )[0]
        if hasattr(next(engine.model.parameters()), "to_local")
        else None
    )


def _worker(rank: int, port: int, out_dir: str) -> None:
    from verity.batch import Batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out: dict = {}
        scenario(Batch.from_dict(the_batch()).split(WORLD)[rank], out)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_and_load(_worker, WORLD, str(tmp_path_factory.mktemp("moe")))


@pytest.fixture(scope="module")
def one_process():
    out: dict = {}
    scenario(the_batch(), out)
    return out


def test_two_ranks_shard_the_experts_and_match_one_process(two_ranks, one_process):
    assert two_ranks[0]["expert_shard"] == (4, 64, 32)  # 8 experts of [2I, H] = [64, 32]: 4 per rank
    rows = [slice(0, 4), slice(4, 7)]
    for rank, part in enumerate(two_ranks):
        got = part["logprobs"][: rows[rank].stop - rows[rank].start]
        torch.testing.assert_close(got, one_process["logprobs"][rows[rank]], rtol=0, atol=1e-5)
    for name, want in one_process["grads"].items():
        torch.testing.assert_close(two_ranks[0]["grads"][name], want, rtol=1e-4, atol=1e-6, msg=name)
    for key in ("moe/aux_loss", "moe/z_loss", "moe/router_entropy"):
        assert two_ranks[0]["metrics"][key] == pytest.approx(one_process["metrics"][key], rel=0.2), key


def test_the_router_gradient_carries_the_router_losses(one_process):
    router = [g for n, g in one_process["grads"].items() if n.endswith("mlp.gate.weight")]
    assert all(g.abs().sum() > 0 for g in router)
