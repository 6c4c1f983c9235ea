"""Router losses, router metrics and routing replay on the Megatron engine vs the FSDP2 engine, 2 gloo ranks.

Rank 0 gets 4 of 7 rows and rank 1 the other 3, each run as one micro-batch, through the FSDP2 engine
(the definitions: :mod:`verity.engines.moe_router`), the Megatron engine at EP=1 (DP=2) and at
EP=2 (each rank 4 of the 8 experts). Compared: the loss with ``aux_loss_coef`` and ``z_loss_coef``,
every gradient (the routers' included), the ``moe/*`` metrics; with routing replay of a perturbed
sampler's routes, the log-probs, the trainer's routes (the rollout's), the agreement; replaying
the model's own routes changes nothing.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import initial_logprobs, make_padded_batch, tiny_moe

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from verity.engines import FSDP2Engine, OptimConfig  # noqa: E402
from verity.engines.moe_router import ROUTER_METRICS, RouterSettings  # noqa: E402
from verity.rollout.moe_routes import RouterTap  # noqa: E402

pytestmark = pytest.mark.slow  # two spawned ranks, six engines each

WORLD = 2
CFG = OptimConfig(lr=1e-3)
LOSSES = RouterSettings(aux_loss_coef=0.05, z_loss_coef=0.02)
REPLAY = RouterSettings(aux_loss_coef=0.05, z_loss_coef=0.02, routing_replay=True)
MICRO = 4  # one micro-batch per rank: the router terms are per micro-batch
ENGINES = ("fsdp2", "ep1", "ep2")


def sampler_routes(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[B, P+R, L, k]`` int16 routes of a copy of the model with perturbed routers (-1 at padding),
    as the HF rollout records them."""
    sampler = tiny_moe()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        for name, p in sampler.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.5 * p.std() * torch.randn_like(p))
        with RouterTap(sampler) as tap:
            initial_logprobs(batch, sampler)
            routes = tap.routes()
    routes = routes.reshape(batch["input_ids"].shape[0], -1, *routes.shape[1:]).to(torch.int16)
    routes[~batch["attention_mask"].bool()] = -1
    return routes


def the_batch() -> dict[str, torch.Tensor]:
    batch = make_padded_batch(rows=7)
    batch["routed_experts"] = sampler_routes(batch)
    return batch


def push_up_loss(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def build(kind: str, router: RouterSettings | None):
    if kind == "fsdp2":
        return FSDP2Engine(tiny_moe(), CFG, router=router)
    from verity.engines.megatron import MegatronEngine, MegatronOptions

    ep = 2 if kind == "ep2" else 1
    return MegatronEngine(tiny_moe(), CFG, MegatronOptions(expert_parallel_size=ep), router=router)


def train(engine, batch) -> tuple[dict, dict]:
    metrics = engine.forward_backward(batch, push_up_loss, MICRO)
    return metrics, engine.full_gradients()


def megatron_order(routes: torch.Tensor) -> torch.Tensor:
    """``[b, S, L, k]`` -> ``[S x b, L, k]``: the positions in the order Megatron's routers see them."""
    return routes.transpose(0, 1).reshape(-1, *routes.shape[2:])


def scenario(kind: str, batch, out: dict) -> None:
    out[f"{kind}/losses"] = train(build(kind, LOSSES), batch)
    out[f"{kind}/no_term"] = train(build(kind, None), batch)
    engine = build(kind, REPLAY)
    out[f"{kind}/replayed_logprobs"] = engine.compute_logprobs(batch, MICRO)[0]
    out[f"{kind}/replayed"] = train(engine, batch)
    if kind == "fsdp2":
        return
    out[f"{kind}/zero_coefs"] = train(build(kind, RouterSettings()), batch)
    routes = megatron_order(batch["routed_experts"]).long()
    recorded = routes[:, :, 0] >= 0
    trained = engine.router_terms.last_routes()
    out[f"{kind}/trainer_routes_are_rollouts"] = bool(
        (trained.sort(-1).values == routes.sort(-1).values).all(-1)[recorded].all()
    )
    # the model's own routes, replayed: the log-probs and gradients of the unreplayed pass
    own = build(kind, REPLAY)
    plain_batch = {k: v for k, v in batch.items() if k != "routed_experts"}
    out[f"{kind}/own_plain_logprobs"] = own.compute_logprobs(plain_batch, MICRO)[0]
    b, s = batch["input_ids"].shape
    own_routes = own.router_terms.last_routes().reshape(s, b, *routes.shape[1:]).transpose(0, 1)
    own_routes = own_routes.to(torch.int16).clone()
    own_routes[~batch["attention_mask"].bool()] = -1
    own_batch = {**plain_batch, "routed_experts": own_routes}
    out[f"{kind}/own_replayed_logprobs"] = own.compute_logprobs(own_batch, MICRO)[0]
    out[f"{kind}/own_plain"] = train(own, plain_batch)
    own.optimizer.zero_grad(set_to_none=True)
    out[f"{kind}/own_replayed"] = train(own, own_batch)


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out: dict = {}
        rows = slice(0, 4) if rank == 0 else slice(4, 7)
        batch = {k: v[rows] for k, v in the_batch().items()}
        out["response_mask"] = batch["response_mask"]
        for kind in ENGINES:
            scenario(kind, batch, out)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_and_load(_worker, WORLD, str(tmp_path_factory.mktemp("megatron_router")))


def assert_same_grads(got: dict, want: dict, what: str, atol: float = 1e-5) -> None:
    assert set(got) == set(want), what
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


def router_grads(grads: dict) -> list[torch.Tensor]:
    return [g for n, g in sorted(grads.items()) if n.endswith("mlp.gate.weight")]


@pytest.mark.parametrize("kind", ["ep1", "ep2"])
@pytest.mark.parametrize("case", ["losses", "replayed"])
def test_loss_gradients_and_metrics_equal_fsdp2(ranks, kind, case):
    for rank, r in enumerate(ranks):
        got_metrics, got_grads = r[f"{kind}/{case}"]
        want_metrics, want_grads = r[f"fsdp2/{case}"]
        assert_same_grads(got_grads, want_grads, f"{kind} {case} rank {rank}")
        names = [m for m in ROUTER_METRICS if case == "replayed" or m != "moe/replay_route_agreement"]
        for key in ("loss", *names):
            assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-6), (kind, case, key)


@pytest.mark.parametrize("kind", ENGINES)
def test_the_router_losses_move_the_router_gradient(ranks, kind):
    for r in ranks:
        with_terms, without = router_grads(r[f"{kind}/losses"][1]), router_grads(r[f"{kind}/no_term"][1])
        assert all(float((a - b).abs().max()) > 1e-6 for a, b in zip(with_terms, without, strict=True))
        assert r[f"{kind}/losses"][0]["moe/aux_loss"] >= 1.0 - 1e-6  # E * sum f P is at least 1


@pytest.mark.parametrize("kind", ["ep1", "ep2"])
def test_zero_coefficients_add_nothing(ranks, kind):
    for r in ranks:
        (zero_metrics, zero_grads), (plain_metrics, plain_grads) = (
            r[f"{kind}/zero_coefs"],
            r[f"{kind}/no_term"],
        )
        assert_same_grads(zero_grads, plain_grads, f"{kind} zero coefficients", atol=0)
        assert zero_metrics["loss"] == plain_metrics["loss"]


@pytest.mark.parametrize("kind", ["ep1", "ep2"])
def test_replayed_routes_are_the_rollouts(ranks, kind):
    for rank, r in enumerate(ranks):
        assert r[f"{kind}/trainer_routes_are_rollouts"]
        mask = r["response_mask"].bool()  # log-probs past a response's end are not defined alike
        torch.testing.assert_close(
            r[f"{kind}/replayed_logprobs"][mask], r["fsdp2/replayed_logprobs"][mask], rtol=0, atol=1e-5
        )
        agreement = r[f"{kind}/replayed"][0]["moe/replay_route_agreement"]
        assert 0.0 < agreement < 1.0, (rank, agreement)  # the perturbed sampler routed some tokens otherwise


@pytest.mark.parametrize("kind", ["ep1", "ep2"])
def test_replaying_the_models_own_routes_changes_nothing(ranks, kind):
    for r in ranks:
        torch.testing.assert_close(
            r[f"{kind}/own_replayed_logprobs"], r[f"{kind}/own_plain_logprobs"], rtol=0, atol=0
        )
        assert_same_grads(
            r[f"{kind}/own_replayed"][1], r[f"{kind}/own_plain"][1], f"{kind} own routes", atol=0
        )
        assert r[f"{kind}/own_replayed"][0]["moe/replay_route_agreement"] == 1.0
