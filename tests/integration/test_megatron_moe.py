"""MegatronEngine on a tiny Qwen3-MoE over 2 gloo processes at EP=2 (x DP=2) vs FSDP2Engine in one process.

Each rank gets ``Batch.split(2)``'s half of the rows and holds 4 of the 8 experts; tokens
travel to their experts' rank and back by all-to-all. Compared with the reference on the
whole batch: log-probs, gradients, two AdamW steps, the gathered weights (exact). Also:
a router that sends every token to rank 0's experts (rank 1 receives no token at all),
a rank with fewer micro-batches than its peer (zero-advantage rows skipped), and an EP=2
checkpoint loaded at EP=1.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import make_padded_batch, tiny_moe

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from verity.engines import FSDP2Engine, OptimConfig  # noqa: E402

WORLD = 2
CFG = OptimConfig(lr=1e-2, warmup_steps=2, grad_clip=1.0)
TOL = 1e-5
ZERO_ROWS = [0, 1, 2, 3, 5]  # all of rank 0's rows and one of rank 1's


def actor_loss():
    """The trainer's actor loss: dual-clip PPO + k3 KL loss - entropy bonus (token-mean)."""
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.workers.actor_rollout import make_actor_loss

    policy = PolicyLossConfig(loss_agg_mode="token-mean", clip_ratio_c=3.0)
    return make_actor_loss(policy, KLConfig(use_kl_loss=True, kl_loss_kind="k3", kl_loss_coef=0.1), 0.01)


def policy_only_loss():
    """Dual-clip PPO without KL or entropy: rows with zero advantage add exactly nothing."""
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.workers.actor_rollout import make_actor_loss

    return make_actor_loss(PolicyLossConfig(clip_ratio_c=3.0), KLConfig(), entropy_coeff=0.0)


def one_sided_moe():
    """The tiny MoE with routers that put both of every token's experts among experts 0-3 (EP rank 0's):
    rows ``c u, -c u, c v, -c v`` give two positive logits for any hidden state, experts 4-7 score 0."""
    model = tiny_moe(seed=2)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in model.model.layers:
            u, v = torch.randn(2, 64, generator=g)
            layer.mlp.gate.weight.copy_(torch.stack([u, -u, v, -v, *([torch.zeros(64)] * 4)]) * 3.0)
    return model


def rl_batch(model) -> dict[str, torch.Tensor]:
    batch = make_padded_batch()
    with torch.no_grad():
        lp, _ = FSDP2Engine(model, None).compute_logprobs(batch, 7)
    g = torch.Generator().manual_seed(11)
    batch["old_logprobs"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    batch["ref_logprobs"] = lp + 0.3 * torch.randn(lp.shape, generator=g)
    return batch


def full_weights(engine) -> dict[str, torch.Tensor]:
    if hasattr(engine, "iter_full_weights"):
        return {n: t.detach().clone() for bucket in engine.iter_full_weights(4096) for n, t in bucket}
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def scenarios(make_engine, batch, out: dict, prefix: str, skip_batch) -> None:
    """Identical in the reference and in every rank."""
    from verity.engines.train_rows import rows_with_advantage

    engine = make_engine()
    out[f"{prefix}/logprobs"] = engine.compute_logprobs(batch, micro_batch_size=2, temperature=0.8)
    out[f"{prefix}/initial"] = full_weights(engine)
    engine.forward_backward(batch, actor_loss(), 2, entropy_requires_grad=True)
    out[f"{prefix}/grad"] = engine.full_gradients()
    engine.optimizer.zero_grad(set_to_none=True)
    keep = rows_with_advantage(skip_batch["advantages"], skip_batch["response_mask"])
    engine.forward_backward(skip_batch, policy_only_loss(), 1, train_rows=keep if prefix != "ref" else None)
    out[f"{prefix}/skip_grad"] = engine.full_gradients()
    engine.optimizer.zero_grad(set_to_none=True)
    out[f"{prefix}/metrics"] = [engine.train_step(batch, actor_loss(), 2) for _ in range(2)]
    out[f"{prefix}/weights"] = full_weights(engine)


def zero_advantage(batch):
    batch = dict(batch)
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][ZERO_ROWS] = 0.0
    return batch


def _shard(batch, rank: int):
    from verity.batch import Batch

    return Batch.from_dict(batch).split(WORLD)[rank]


def _megatron(model, ep: int, cfg=CFG):
    from verity.engines.megatron import MegatronEngine, MegatronOptions

    return MegatronEngine(model, cfg, MegatronOptions(expert_parallel_size=ep))


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out: dict = {}
        batch = rl_batch(tiny_moe())
        probe = _megatron(tiny_moe(), 2, cfg=None)
        out["dp_layout"] = probe.dp_layout
        out["local_experts"] = list(probe.model.decoder.layers[0].mlp.local_expert_indices)
        mine, skip = _shard(batch, rank), _shard(zero_advantage(batch), rank)
        scenarios(lambda: _megatron(tiny_moe(), 2), mine, out, "ep2", skip)
        one_sided_scenario(rank, out)
        checkpoint_scenario(rank, out_dir, mine, out)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def one_sided_scenario(rank: int, out: dict) -> None:
    """Every token goes to rank 0's experts: rank 1 receives none, yet both run and match HF."""
    batch = _shard(rl_batch(one_sided_moe()), rank)
    engine = _megatron(one_sided_moe(), 2)
    out["one_sided/logprobs"] = engine.compute_logprobs(batch, micro_batch_size=4)
    dispatchers = [layer.mlp.token_dispatcher for layer in engine.model.decoder.layers]
    out["one_sided/received"] = sum(int(sum(d.output_splits.tolist())) for d in dispatchers)
    engine.forward_backward(batch, actor_loss(), 4)
    out["one_sided/grad"] = engine.full_gradients()


def checkpoint_scenario(rank: int, out_dir: str, batch, out: dict) -> None:
    """An EP=2 engine trains one step and saves; an EP=1 (DP=2) engine loads it: same weights, same Adam step."""
    from verity.checkpoint.sharded import load_engine, save_engine

    folder = os.path.join(out_dir, "ckpt_ep2")
    a = _megatron(tiny_moe(), 2)
    a.train_step(batch, actor_loss(), 4)
    save_engine(folder, a, rank=rank, world_size=WORLD)
    out["ckpt/saved"] = full_weights(a)
    b = _megatron(tiny_moe(seed=9), 1)
    load_engine(folder, b, rank=rank, world_size=WORLD)
    out["ckpt/loaded"] = full_weights(b)
    out["ckpt/step"] = b.global_step
    adam = b.state_dict_for_checkpoint()["optimizer"]["state"]
    out["ckpt/adam_steps"] = {float(entry["step"]) for entry in adam.values()}
    out["ckpt/expert_moment"] = float(
        adam["model.layers.0.mlp.experts.gate_up_proj"]["exp_avg_sq"].abs().max()
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("megatron_moe"))
    return spawn_and_load(_worker, WORLD, out_dir)


@pytest.fixture(scope="module")
def reference():
    out: dict = {}
    batch = rl_batch(tiny_moe())
    scenarios(lambda: FSDP2Engine(tiny_moe(), CFG), batch, out, "ref", zero_advantage(batch))
    one_sided = rl_batch(one_sided_moe())
    engine = FSDP2Engine(one_sided_moe(), CFG)
    out["one_sided/logprobs"] = engine.compute_logprobs(one_sided, micro_batch_size=7)
    engine.forward_backward(one_sided, actor_loss(), 7)
    out["one_sided/grad"] = engine.full_gradients()
    return out


def assert_close_dicts(got: dict, want: dict, what: str, atol: float = TOL) -> None:
    assert set(got) == set(want), f"{what}: names differ: {set(got) ^ set(want)}"
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


def joined_logprobs(parts) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's 4 rows and rank 1's first 3 (its fourth is ``Batch.split`` padding)."""
    return torch.cat([parts[0][0], parts[1][0][:3]]), torch.cat([parts[0][1], parts[1][1][:3]])


def test_each_rank_holds_half_the_experts(ranks):
    assert [r["local_experts"] for r in ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r["dp_layout"] for r in ranks] == [(0, 2, True), (1, 2, True)]


def test_gathered_weights_are_the_hf_weights_exactly(ranks):
    from verity.engines.megatron.convert import hf_state_dict

    want = hf_state_dict(tiny_moe())
    for r in ranks:
        assert_close_dicts(r["ep2/initial"], want, "initial", atol=0)


@pytest.mark.parametrize("scenario", ["ep2", "one_sided"])
def test_logprobs_equal_hf(ranks, reference, scenario):
    key = "ref/logprobs" if scenario == "ep2" else "one_sided/logprobs"
    lp_ref, ent_ref = reference[key]
    lp, ent = joined_logprobs([r[f"{scenario}/logprobs"] for r in ranks])
    mask = make_padded_batch()["response_mask"].bool()
    torch.testing.assert_close(lp[mask], lp_ref[mask], rtol=0, atol=TOL)
    torch.testing.assert_close(ent[mask], ent_ref[mask], rtol=0, atol=TOL)


def test_a_rank_that_receives_no_token_still_runs(ranks, reference):
    assert ranks[1]["one_sided/received"] == 0 and ranks[0]["one_sided/received"] > 0
    for rank, r in enumerate(ranks):
        assert_close_dicts(r["one_sided/grad"], reference["one_sided/grad"], f"one-sided rank {rank}")


@pytest.mark.parametrize("key", ["grad", "skip_grad"])
def test_gradients_equal_fsdp2(ranks, reference, key):
    want = reference[f"ref/{key}"]
    expert = want["model.layers.0.mlp.experts.gate_up_proj"]
    assert float(expert.abs().max()) > 1e-4
    for rank, r in enumerate(ranks):
        assert_close_dicts(r[f"ep2/{key}"], want, f"{key} rank {rank}")


def test_train_steps_equal_fsdp2(ranks, reference):
    for step, want in enumerate(reference["ref/metrics"]):
        for rank, r in enumerate(ranks):
            got = r["ep2/metrics"][step]
            for key in ("loss", "grad_norm", "lr", "tokens", "response_tokens", "entropy"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, rank, key)
    for r in ranks:
        assert_close_dicts(r["ep2/weights"], reference["ref/weights"], "weights", 1e-4)


def test_an_ep2_checkpoint_loads_at_ep1(ranks):
    for r in ranks:
        assert_close_dicts(r["ckpt/loaded"], r["ckpt/saved"], "loaded", atol=0)
        assert r["ckpt/step"] == 1 and r["ckpt/adam_steps"] == {1.0}
        assert r["ckpt/expert_moment"] > 0
