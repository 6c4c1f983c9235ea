"""MegatronEngine on 2 gloo processes vs FSDP2Engine in one process: same gradients, log-probs, steps.

Two ranks are spawned once for the module; in them the engine runs at three layouts
of the 2-rank world, one after another: DP=2 (TP=1), TP=2 and PP=2, each with an
untied and a tied-embedding model. The reference is FSDP2Engine on the whole batch in
this process. With DP=2 each rank gets ``Batch.split(2)``'s part (rank 1's part ends in
a padding row); with TP=2 or PP=2 both ranks get every row.
Also: a checkpoint written at TP=2 reloads at TP=2 (identical continuation), loads at
PP=2 and DP=2 (DCP reshards), and exports to an HF folder.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import make_padded_batch, tiny_qwen2

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from verity.engines import FSDP2Engine, OptimConfig  # noqa: E402

WORLD = 2
LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
CFG = OptimConfig(lr=1e-2, warmup_steps=2, grad_clip=1.0)
TOL = 1e-5


def actor_loss(mode: str):
    """The trainer's actor loss: dual-clip PPO with clip-higher + k3 KL loss - entropy bonus."""
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.workers.actor_rollout import make_actor_loss

    policy = PolicyLossConfig(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    kl = KLConfig(use_kl_loss=True, kl_loss_kind="k3", kl_loss_coef=0.1)
    return make_actor_loss(policy, kl, entropy_coeff=0.01)


def rl_batch(tied: bool) -> dict[str, torch.Tensor]:
    """7 padded rows with old/ref log-probs (the initial policy's + noise) and advantages."""
    batch = make_padded_batch()
    with torch.no_grad():
        lp, _ = FSDP2Engine(tiny_qwen2(tie_word_embeddings=tied), None).compute_logprobs(batch, 7)
    g = torch.Generator().manual_seed(11)
    return {
        **batch,
        "old_logprobs": lp + 0.3 * torch.randn(lp.shape, generator=g),
        "ref_logprobs": lp + 0.3 * torch.randn(lp.shape, generator=g),
    }


def run_scenarios(make_engine, batch, out: dict, prefix: str) -> None:
    """Identical in the reference and in every rank: gradients per loss and micro-batch, log-probs, 2 steps."""
    engine = make_engine()
    for mode in AGG_MODES:
        for mbs in (1, 4):
            engine.forward_backward(batch, actor_loss(mode), mbs, entropy_requires_grad=True)
            out[f"{prefix}/grad/{mode}/{mbs}"] = engine.full_gradients()
            engine.optimizer.zero_grad(set_to_none=True)
    out[f"{prefix}/logprobs"] = engine.compute_logprobs(batch, micro_batch_size=3, temperature=0.8)
    out[f"{prefix}/metrics"] = [engine.train_step(batch, actor_loss("token-mean"), 2) for _ in range(2)]
    out[f"{prefix}/weights"] = full_weights(engine)
    if engine.name == "megatron":  # weight sync into a fresh HF model, as the actor's rollout receives it
        from verity.resharding import ModuleWeightReceiver, sync_weights

        receiver = tiny_qwen2(seed=7, tie_word_embeddings=engine.shape.tie_word_embeddings)
        stats = sync_weights(engine, ModuleWeightReceiver(receiver), bucket_bytes=8192)
        out[f"{prefix}/synced"] = {n: p.detach().clone() for n, p in receiver.named_parameters()}
        out[f"{prefix}/sync_tensors"] = stats.num_tensors


ZERO_ROWS = [0, 1, 2, 3, 5]  # at DP=2 all of rank 0's rows and one of rank 1's


def policy_only_loss():
    """Dual-clip PPO without KL or entropy: rows with zero advantage add exactly nothing."""
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.workers.actor_rollout import make_actor_loss

    return make_actor_loss(PolicyLossConfig(clip_ratio_c=3.0), KLConfig(), entropy_coeff=0.0)


def zero_advantage_batch(tied: bool) -> dict[str, torch.Tensor]:
    batch = rl_batch(tied)
    batch["advantages"] = batch["advantages"].clone()
    batch["advantages"][ZERO_ROWS] = 0.0
    return batch


def skip_scenario(engine, batch, out: dict, prefix: str, skip: bool) -> None:
    """Gradient of the policy-only loss with the zero-advantage rows left out (``skip``) or run."""
    from verity.engines.train_rows import rows_with_advantage

    keep = rows_with_advantage(batch["advantages"], batch["response_mask"]) if skip else None
    metrics = engine.forward_backward(batch, policy_only_loss(), 2, train_rows=keep)
    out[f"{prefix}/skip/grad"] = engine.full_gradients()
    out[f"{prefix}/skip/fraction"] = metrics["skipped_row_fraction"]
    engine.optimizer.zero_grad(set_to_none=True)


def full_weights(engine) -> dict[str, torch.Tensor]:
    if hasattr(engine, "iter_full_weights"):
        return {n: t.detach().clone() for bucket in engine.iter_full_weights(4096) for n, t in bucket}
    return {n: p.detach().clone() for n, p in engine.model.named_parameters()}


def _megatron(tied: bool, tp: int, pp: int, seed: int = 0, cfg=CFG):
    from verity.engines.megatron import MegatronEngine, MegatronOptions

    options = MegatronOptions(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return MegatronEngine(tiny_qwen2(seed=seed, tie_word_embeddings=tied), cfg, options)


def _shard(batch, dp_rank: int, dp: int):
    from verity.batch import Batch

    return Batch.from_dict(batch).split(dp)[dp_rank] if dp > 1 else batch


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out: dict = {}
        for name, (tp, pp) in LAYOUTS.items():
            for tied in (False, True):
                probe = _megatron(tied, tp, pp, cfg=None)
                dp_rank, dp, _ = probe.dp_layout
                out[f"{name}/{tied}/dp_layout"] = probe.dp_layout
                batch = _shard(rl_batch(tied), dp_rank, dp)
                run_scenarios(
                    lambda tied=tied, tp=tp, pp=pp: _megatron(tied, tp, pp), batch, out, f"{name}/{tied}"
                )
            skipping = _shard(zero_advantage_batch(False), dp_rank, dp)
            skip_scenario(_megatron(False, tp, pp), skipping, out, name, skip=True)
        padded_vocab_scenario(out)
        checkpoint_scenarios(rank, out_dir, out)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def padded_vocab_scenario(out: dict) -> None:
    """TP=2 with a vocabulary of 101 (padded to 102 inside Megatron): log-probs and a gradient."""
    from verity.engines.megatron import MegatronEngine, MegatronOptions

    engine = MegatronEngine(odd_vocab_model(), CFG, MegatronOptions(tensor_parallel_size=2))
    batch = rl_batch(False)
    out["vocab101/logprobs"] = engine.compute_logprobs(batch, 4)
    engine.forward_backward(batch, actor_loss("token-mean"), 3, entropy_requires_grad=True)
    out["vocab101/grad"] = engine.full_gradients()
    out["vocab101/local_rows"] = engine.model.embedding.word_embeddings.weight.shape[0]


def odd_vocab_model():
    from helpers.tiny_models import tiny_qwen2_config
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(tie_word_embeddings=False)
    config.vocab_size = 101
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def checkpoint_scenarios(rank: int, out_dir: str, out: dict) -> None:
    """TP=2: train 1 step, save; a differently initialised engine loads it; both train once more.
    Then the TP=2 checkpoint loads at PP=2 and at DP=2."""
    from verity.checkpoint.sharded import load_engine, save_engine

    loss = actor_loss("token-mean")
    folder = os.path.join(out_dir, "ckpt_tp2")
    rl = rl_batch(False)
    a = _megatron(False, 2, 1)
    a.train_step(rl, loss, 4)
    save_engine(folder, a, rank=rank, world_size=WORLD)
    out["ckpt/saved_weights"] = full_weights(a)
    b = _megatron(False, 2, 1, seed=9)
    load_engine(folder, b, rank=rank, world_size=WORLD)
    out["ckpt/step"] = b.global_step
    out["ckpt/metrics"] = (a.train_step(rl, loss, 4), b.train_step(rl, loss, 4))
    wa, wb = full_weights(a), full_weights(b)
    out["ckpt/max_diff"] = max(float((wa[n] - wb[n]).abs().max()) for n in wa)
    for name in ("pp2", "dp2"):
        c = _megatron(False, *LAYOUTS[name], seed=5)
        load_engine(folder, c, rank=rank, world_size=WORLD)
        out[f"ckpt/{name}/weights"] = full_weights(c)
        out[f"ckpt/{name}/adam"] = c.state_dict_for_checkpoint()["optimizer"]["state"]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("megatron"))
    results = spawn_and_load(_worker, WORLD, out_dir)
    for r in results:
        r["out_dir"] = out_dir
    return results


@pytest.fixture(scope="module")
def reference():
    out: dict = {}
    for tied in (False, True):
        run_scenarios(
            lambda tied=tied: FSDP2Engine(tiny_qwen2(tie_word_embeddings=tied), CFG),
            rl_batch(tied),
            out,
            f"ref/{tied}",
        )
    untied = FSDP2Engine(tiny_qwen2(tie_word_embeddings=False), CFG)
    skip_scenario(untied, zero_advantage_batch(False), out, "ref", skip=False)
    return out


def assert_close_dicts(got: dict, want: dict, what: str, atol: float = TOL) -> None:
    assert set(got) == set(want), f"{what}: names differ: {set(got) ^ set(want)}"
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("mbs", [1, 4])
def test_gradients_equal_fsdp2(ranks, reference, layout, tied, mode, mbs):
    want = reference[f"ref/{tied}/grad/{mode}/1"]
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3
    for rank in range(WORLD):
        got = ranks[rank][f"{layout}/{tied}/grad/{mode}/{mbs}"]
        assert_close_dicts(got, want, f"{layout} tied={tied} rank {rank} mbs={mbs}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_dp_layouts_declare_one_collector_per_replica(ranks, layout):
    layouts = [ranks[r][f"{layout}/False/dp_layout"] for r in range(WORLD)]
    if layout == "dp2":
        assert layouts == [(0, 2, True), (1, 2, True)]
    elif layout == "tp2":
        assert layouts == [(0, 1, True), (0, 1, False)]
    else:  # the last pipeline stage answers
        assert layouts == [(0, 1, False), (0, 1, True)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tied", [False, True])
def test_logprobs_equal_fsdp2_on_response_tokens(ranks, reference, layout, tied):
    lp_ref, ent_ref = reference[f"ref/{tied}/logprobs"]
    mask = make_padded_batch()["response_mask"].bool()
    parts = [ranks[r][f"{layout}/{tied}/logprobs"] for r in range(WORLD)]
    if layout == "dp2":
        lp = torch.cat([parts[0][0], parts[1][0][:3]])
        ent = torch.cat([parts[0][1], parts[1][1][:3]])
    else:
        torch.testing.assert_close(parts[0][0], parts[1][0], rtol=0, atol=0)  # every rank answers the same
        lp, ent = parts[0]
    assert lp.shape == lp_ref.shape
    # padding positions hold whatever each attention implementation computes there; only real tokens count
    torch.testing.assert_close(lp[mask], lp_ref[mask], rtol=0, atol=TOL)
    torch.testing.assert_close(ent[mask], ent_ref[mask], rtol=0, atol=TOL)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tied", [False, True])
def test_train_steps_equal_fsdp2(ranks, reference, layout, tied):
    for step, want in enumerate(reference[f"ref/{tied}/metrics"]):
        for rank in range(WORLD):
            got = ranks[rank][f"{layout}/{tied}/metrics"][step]
            for key in ("loss", "grad_norm", "lr", "tokens", "response_tokens", "entropy", "actor/pg_loss"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (layout, step, rank, key)
    for rank in range(WORLD):
        # AdamW divides by sqrt(v): summation-order noise on a near-zero gradient moves a weight ~1e-5
        assert_close_dicts(
            ranks[rank][f"{layout}/{tied}/weights"], reference[f"ref/{tied}/weights"], "weights", 1e-4
        )


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("tied", [False, True])
def test_weight_sync_fills_an_hf_model_with_the_trained_weights(ranks, layout, tied):
    for rank in range(WORLD):
        r = ranks[rank]
        synced, weights = r[f"{layout}/{tied}/synced"], r[f"{layout}/{tied}/weights"]
        assert r[f"{layout}/{tied}/sync_tensors"] == len(weights)
        assert_close_dicts(synced, weights, "synced", atol=0)


def test_vocabulary_padded_for_tensor_parallelism(ranks):
    model = odd_vocab_model()
    ref = FSDP2Engine(model, CFG)
    batch = rl_batch(False)
    lp_ref, ent_ref = ref.compute_logprobs(batch, 4)
    ref.forward_backward(batch, actor_loss("token-mean"), 3, entropy_requires_grad=True)
    grads = ref.full_gradients()
    mask = batch["response_mask"].bool()
    for rank in range(WORLD):
        r = ranks[rank]
        assert r["vocab101/local_rows"] == 51  # 101 rows padded to 102, 51 per rank
        lp, ent = r["vocab101/logprobs"]
        torch.testing.assert_close(lp[mask], lp_ref[mask], rtol=0, atol=TOL)
        torch.testing.assert_close(ent[mask], ent_ref[mask], rtol=0, atol=TOL)
        assert_close_dicts(r["vocab101/grad"], grads, f"vocab 101 rank {rank}")


def test_checkpoint_round_trip_at_tp2(ranks):
    for rank in range(WORLD):
        r = ranks[rank]
        assert r["ckpt/step"] == 1
        assert r["ckpt/max_diff"] == 0.0
        got, want = r["ckpt/metrics"]
        assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]


@pytest.mark.parametrize("layout", ["pp2", "dp2"])
def test_tp2_checkpoint_loads_at_other_layouts(ranks, layout):
    for rank in range(WORLD):
        r = ranks[rank]
        assert_close_dicts(r[f"ckpt/{layout}/weights"], r["ckpt/saved_weights"], layout, atol=0)
        adam = r[f"ckpt/{layout}/adam"]
        assert adam and all(float(entry["step"]) == 1.0 for entry in adam.values())
        assert all(float(entry["exp_avg_sq"].abs().max()) > 0 for entry in adam.values())


def test_tp2_checkpoint_exports_to_hf(ranks, tmp_path):
    from verity.checkpoint.export import read_model_state

    weights = read_model_state(os.path.join(ranks[0]["out_dir"], "ckpt_tp2"))
    assert_close_dicts(weights, ranks[0]["ckpt/saved_weights"], "exported", atol=0)
    model = tiny_qwen2(seed=4)
    model.load_state_dict(weights, strict=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_skipping_zero_advantage_rows_keeps_the_gradient(ranks, reference, layout):
    """At DP=2 rank 0's rows all have zero advantage (it runs one, with zero gradient); at TP=2 and
    PP=2 both ranks skip the same 5 of 7 rows. The gradient equals FSDP2 training all rows."""
    want = reference["ref/skip/grad"]
    assert max(float(g.abs().max()) for g in want.values()) > 1e-3
    for rank in range(WORLD):
        assert_close_dicts(ranks[rank][f"{layout}/skip/grad"], want, f"{layout} rank {rank} skipping")
        assert ranks[rank][f"{layout}/skip/fraction"] == pytest.approx(len(ZERO_ROWS) / 7)
