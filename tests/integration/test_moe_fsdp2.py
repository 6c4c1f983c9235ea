"""A tiny mixture-of-experts model (Qwen3-MoE, Qwen2-MoE) through the FSDP2 engine, in one process.

Log-probs equal HF's own forward (float32); the router losses reach the router's gradient only
through their coefficients; with routing replay the trainer's forward uses exactly the experts the
rollout recorded, and the rollout-vs-trainer log-prob gap falls.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_models import VOCAB, initial_logprobs, make_padded_batch
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.moe_router import RouterSettings
from verity.rollout.moe_routes import RouterTap
from verity_toyworld.tiny_moe import build_tiny_moe


def tiny_moe(family: str, seed: int = 0):
    return build_tiny_moe(
        VOCAB,
        family,
        hidden=32,
        layers=2,
        heads=4,
        kv_heads=2,
        experts=8,
        top_k=2,
        expert_intermediate=32,
        shared_intermediate=32,
        seed=seed,
    )


def push_up_loss(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def router_grads(engine: FSDP2Engine) -> torch.Tensor:
    return torch.cat(
        [p.grad.flatten() for n, p in engine.model.named_parameters() if n.endswith("mlp.gate.weight")]
    )


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
@pytest.mark.parametrize("packed", [True, False])
def test_fsdp2_logprobs_equal_hf_forward(family, packed):
    model = tiny_moe(family)
    batch = make_padded_batch()
    want = initial_logprobs(batch, model) * batch["response_mask"]
    engine = FSDP2Engine(copy.deepcopy(model), packed=packed)
    got, _ = engine.compute_logprobs(batch, micro_batch_size=3)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_router_terms_reach_the_router_gradient_only_through_their_coefficients():
    model = tiny_moe("qwen3_moe")
    batch = make_padded_batch()
    grads, metrics = {}, {}
    for name, settings in {
        "none": None,
        "zero": RouterSettings(0.0, 0.0),
        "aux": RouterSettings(aux_loss_coef=0.1),
        "z": RouterSettings(z_loss_coef=0.1),
    }.items():
        engine = FSDP2Engine(copy.deepcopy(model), OptimConfig(lr=1e-3), router=settings, packed=False)
        metrics[name] = engine.forward_backward(batch, push_up_loss, micro_batch_size=4)
        grads[name] = router_grads(engine)
    assert torch.equal(grads["none"], grads["zero"])
    assert not torch.allclose(grads["aux"], grads["none"], atol=1e-7)
    assert not torch.allclose(grads["z"], grads["none"], atol=1e-7)
    m = metrics["none"]
    assert 1.0 <= m["moe/expert_load_max_over_mean"] <= m["moe/expert_load_max_over_mean_max"] <= 8 / 2
    assert 0.0 < m["moe/router_entropy"] <= torch.log(torch.tensor(8.0)).item() + 1e-6
    assert m["moe/aux_loss"] > 0 and m["moe/z_loss"] > 0


def rollout_routes(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routes [B, S, L, k], log-probs [B, R])`` of a whole-width HF forward, as a rollout records them."""
    with RouterTap(model) as tap, torch.no_grad():
        logprobs = initial_logprobs(batch, model)
        routes = tap.routes()
    rows, width = batch["input_ids"].shape
    return routes.reshape(rows, width, *routes.shape[1:]), logprobs


def test_routing_replay_uses_the_rollout_routes_and_narrows_the_logprob_gap():
    trainer_model = tiny_moe("qwen3_moe")
    sampler = copy.deepcopy(trainer_model)  # a sampler that differs from the trainer: routers perturbed
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for name, p in sampler.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.5 * p.std() * torch.randn_like(p))
    batch = make_padded_batch(rows=6)
    routes, rollout_logprobs = rollout_routes(sampler, batch)
    mask = batch["response_mask"]
    gaps = {}
    for replay in (False, True):
        engine = FSDP2Engine(copy.deepcopy(trainer_model), router=RouterSettings(routing_replay=replay))
        rows = {**batch, "routed_experts": routes}
        got, _ = engine.compute_logprobs(rows, micro_batch_size=6)
        gaps[replay] = float(((got - rollout_logprobs).abs() * mask).sum() / mask.sum())
        if replay:
            trained = engine.router_terms.last_routes()  # the window's positions, row by row
            real = batch["attention_mask"].bool()
            first = int(real.any(0).nonzero()[0])
            window = routes[:, first:].reshape(-1, *routes.shape[2:])
            keep = real[:, first:].reshape(-1)
            assert torch.equal(trained[keep], window[keep])
    assert gaps[True] < gaps[False], gaps
    # the perturbed sampler routed some tokens differently from the trainer: agreement below 1
    engine = FSDP2Engine(
        copy.deepcopy(trainer_model), OptimConfig(lr=1e-3), router=RouterSettings(routing_replay=True)
    )
    metrics = engine.forward_backward({**batch, "routed_experts": routes}, push_up_loss, micro_batch_size=6)
    assert 0.3 < metrics["moe/replay_route_agreement"] < 1.0
    print(f"behaviour log-prob gap: without replay {gaps[False]:.4f}, with replay {gaps[True]:.4f}")


def test_routing_replay_trains_the_router_through_its_weights():
    model = tiny_moe("qwen3_moe")
    batch = make_padded_batch(rows=4)
    routes, _ = rollout_routes(model, batch)
    engine = FSDP2Engine(
        copy.deepcopy(model), OptimConfig(lr=1e-3), router=RouterSettings(routing_replay=True)
    )
    free = FSDP2Engine(copy.deepcopy(model), OptimConfig(lr=1e-3), packed=False)
    engine.forward_backward({**batch, "routed_experts": routes}, push_up_loss, micro_batch_size=4)
    free.forward_backward(batch, push_up_loss, micro_batch_size=4)
    # replaying the model's own routes is its own routing: the same gradient, the router's included
    assert router_grads(engine).abs().sum() > 0
    assert torch.allclose(router_grads(engine), router_grads(free), atol=1e-6)


def test_router_settings_on_a_dense_model_are_refused():
    from helpers.tiny_models import tiny_qwen2

    with pytest.raises(ValueError, match="mixture-of-experts"):
        FSDP2Engine(tiny_qwen2(), router=RouterSettings(routing_replay=True))


def test_hf_rollout_records_routes_that_a_replayed_trainer_forward_reproduces():
    from verity.rollout.hf_rollout import HFRollout
    from verity.rollout.sampling import SamplingParams

    model = tiny_moe("qwen3_moe").eval()
    batch = make_padded_batch(rows=4)
    prompts = {"input_ids": batch["input_ids"][:, :5], "attention_mask": batch["attention_mask"][:, :5]}
    rollout = HFRollout(
        copy.deepcopy(model),
        pad_token_id=0,
        eos_token_ids=[1],
        record_routes=True,
        sampling=SamplingParams(max_new_tokens=6, temperature=1.0, n=2),
    )
    out = rollout.generate(prompts)
    routes = out["routed_experts"]
    assert routes.shape == (8, 11, 2, 2) and routes.dtype == torch.int16
    real = out["attention_mask"].bool()
    assert bool((routes[~real] == -1).all())
    # every fed position was recorded; only each row's last sampled token was never fed
    recorded = (routes[..., 0, 0] >= 0) & real
    last = real.long().cumsum(1).argmax(1)
    assert bool(recorded.sum(1).eq(real.sum(1) - 1).all()) and not bool(recorded[torch.arange(8), last].any())
    # HF's own routing of the whole sequence at once equals the decode loop's (float32, same model)
    rows = {k: out[k] for k in ("input_ids", "attention_mask", "position_ids", "responses", "routed_experts")}
    whole, _ = rollout_routes(model, rows)
    assert torch.equal(whole[recorded].to(torch.int16), routes[recorded])
    # the trainer replays them: its forward uses the recorded experts exactly
    engine = FSDP2Engine(copy.deepcopy(model), router=RouterSettings(routing_replay=True))
    engine.compute_logprobs(rows, micro_batch_size=8)
    first = int(real.any(0).nonzero()[0])
    trained = engine.router_terms.last_routes().reshape(8, -1, 2, 2)
    assert torch.equal(trained[recorded[:, first:]].to(torch.int16), routes[:, first:][recorded[:, first:]])


def test_replay_under_activation_checkpointing_gives_the_same_gradient():
    """The recomputed forward in backward replays the same routes (the tap keeps them for the micro-batch)."""
    model = tiny_moe("qwen3_moe")
    batch = make_padded_batch(rows=6)
    routes, _ = rollout_routes(model, batch)
    routes[:, :, :, 0] = (routes[:, :, :, 0] + 1) % 8  # routes the model would not choose itself
    routes[:, :, :, 1] = torch.where(
        routes[..., 1] == routes[..., 0], (routes[..., 1] + 1) % 8, routes[..., 1]
    )
    grads = []
    for checkpointing in (False, True):
        engine = FSDP2Engine(
            copy.deepcopy(model),
            OptimConfig(lr=1e-3),
            gradient_checkpointing=checkpointing,
            router=RouterSettings(aux_loss_coef=0.1, routing_replay=True),
        )
        engine.forward_backward({**batch, "routed_experts": routes}, push_up_loss, micro_batch_size=3)
        grads.append(torch.cat([p.grad.flatten() for p in engine.model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-7)
