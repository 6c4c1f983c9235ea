"""FSDP2Engine over 2 gloo processes vs one process: same gradients, log-probs, losses, checkpoints.

The 2-rank run is spawned once per module (torch.multiprocessing, gloo on CPU); each
scenario's results are saved per rank and compared with a single-process reference
computed here. The global mini-batch has 7 real rows split by ``Batch.split(2)``: rank 0
gets rows 0-3, rank 1 rows 4-6 plus a padding copy of row 0 recorded in ``pad_rows``.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import (
    P,
    R,
    initial_logprobs,
    make_grouped_batch,
    make_padded_batch,
    seq_mean_token_mean_loss,
    tiny_qwen2,
    tiny_value_model,
)
from verity.engines import FSDP2Engine, OptimConfig

pytestmark = pytest.mark.slow  # the 2-rank module fixture runs every scenario once: about a minute on 2 cores

WORLD = 2


def rank_shard(batch: dict[str, torch.Tensor], rank: int):
    """``Batch.split(2)`` of the 7 rows: rank 0 rows 0-3; rank 1 rows 4-6 + a copy of row 0 (``pad_rows=1``)."""
    from verity.batch import Batch

    part = Batch.from_dict(batch).split(WORLD)[rank]
    assert part.pad_rows == rank  # the real padding the engine must skip
    return part


def shard(batch: dict[str, torch.Tensor], rank: int):
    """:func:`rank_shard` for the 7-row batch; the grouped 8-row batch splits 4 + 4 (one group per rank)."""
    if len(batch["input_ids"]) == 7:
        return rank_shard(batch, rank)
    from verity.batch import Batch

    return Batch.from_dict(batch).split(WORLD)[rank]


def token_mean_loss(mb, logprobs, entropy, agg):
    """sum_tokens(-logprob * advantage) / global_tokens."""
    mask = mb["response_mask"]
    return -(logprobs * mb["advantages"] * mask).sum() / agg.global_tokens, {}


def library_loss(mode: str):
    """``verity.algorithms.aggregate_loss`` of ``-logprob * advantage`` in aggregation ``mode``."""

    def loss_fn(mb, logprobs, entropy, agg):
        from verity.algorithms import aggregate_loss

        return aggregate_loss(-logprobs * mb["advantages"], mb["response_mask"], mode, agg), {}

    return loss_fn


def actor_loss(mode: str):
    """The trainer's actor loss (``workers.actor_rollout.make_actor_loss``): dual-clip PPO with clip-higher + k3 KL loss - entropy bonus."""
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.workers.actor_rollout import make_actor_loss

    policy = PolicyLossConfig(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    kl = KLConfig(use_kl_loss=True, kl_loss_kind="k3", kl_loss_coef=0.1)
    return make_actor_loss(policy, kl, entropy_coeff=0.01)


def add_rl_keys(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``old_logprobs``/``ref_logprobs`` = the initial policy's log-probs + noise (ratios on both sides
    of the clip range); ``values``/``returns`` for the critic's loss."""
    logprobs = initial_logprobs(batch)
    g = torch.Generator().manual_seed(11)
    shape = logprobs.shape
    return {
        **batch,
        "old_logprobs": logprobs + 0.3 * torch.randn(shape, generator=g),
        "ref_logprobs": logprobs + 0.3 * torch.randn(shape, generator=g),
        "values": 0.5 * torch.randn(shape, generator=g),
        "returns": torch.randn(shape, generator=g),
    }


AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOSSES = {
    "token_mean": token_mean_loss,
    "seq_mean_token_mean": seq_mean_token_mean_loss,
    **{mode: library_loss(mode) for mode in AGG_MODES},
    **{f"actor/{mode}": actor_loss(mode) for mode in AGG_MODES},
}
CFG = OptimConfig(lr=1e-2, warmup_steps=2, grad_clip=1.0)


def run_scenarios(engine_factory, shard_of, out: dict, **engine_kwargs) -> None:
    """The scenarios run identically by the reference and by each rank."""
    batch = shard_of(add_rl_keys(make_padded_batch()))
    engine = engine_factory()
    for loss_name, loss_fn in LOSSES.items():
        for mbs in (1, 4):
            # the actor loss's entropy bonus needs the entropy's gradient
            engine.forward_backward(batch, loss_fn, mbs, entropy_requires_grad=loss_name.startswith("actor/"))
            out[f"grad/{loss_name}/{mbs}"] = engine.full_gradients()
            engine.optimizer.zero_grad(set_to_none=True)
    critic_scenarios(batch, out, **engine_kwargs)
    grouped_scenarios(engine, shard_of, out)
    out["logprobs"] = engine.compute_logprobs(batch, micro_batch_size=3, temperature=0.8)
    out["metrics"] = [engine.train_step(batch, token_mean_loss, 2) for _ in range(2)]
    out["weights"] = {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for n, p in engine.model.named_parameters()
    }


def grouped_scenarios(engine, shard_of, out: dict) -> None:
    """GRPO groups: one-row micro-batches run the padded window, four-row ones the shared-prompt layout."""
    grouped = shard_of(add_rl_keys(make_grouped_batch()))
    for mbs in (1, 4):
        engine.forward_backward(grouped, LOSSES["actor/token-mean"], mbs, entropy_requires_grad=True)
        out[f"grad/grouped/{mbs}"] = engine.full_gradients()
        engine.optimizer.zero_grad(set_to_none=True)
    out["grouped_logprobs"] = engine.compute_logprobs(grouped, micro_batch_size=4, temperature=0.8)


def critic_scenarios(batch, out: dict, **engine_kwargs) -> None:
    """A value model in the same engine: value-loss gradients per aggregation mode, and values."""
    from verity.algorithms.configs import ValueLossConfig
    from verity.workers.critic import make_value_loss

    engine = FSDP2Engine(tiny_value_model(), CFG, **engine_kwargs)
    for mode in AGG_MODES:
        loss_fn = make_value_loss(ValueLossConfig(cliprange_value=0.2, loss_agg_mode=mode))
        for mbs in (1, 4):
            engine.forward_backward_values(batch, loss_fn, mbs)
            out[f"grad/critic/{mode}/{mbs}"] = engine.full_gradients()
            engine.optimizer.zero_grad(set_to_none=True)
    out["values"] = engine.compute_values(batch, micro_batch_size=3)


ZERO_ROWS = (0, 1, 2, 3, 5)  # all of rank 0's rows and one of rank 1's


def policy_only_loss(mode: str):
    """Dual-clip PPO without KL or entropy: rows with zero advantage add exactly nothing."""
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.workers.actor_rollout import make_actor_loss

    policy = PolicyLossConfig(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    return make_actor_loss(policy, KLConfig(), entropy_coeff=0.0)


def skip_scenarios(engine_factory, shard_of, out: dict, skip: bool) -> None:
    """Rows with zero advantage left out of forward + backward (``train_rows``) when ``skip``."""
    from verity.engines.train_rows import rows_with_advantage

    full = add_rl_keys(make_padded_batch())
    full["advantages"][list(ZERO_ROWS)] = 0.0
    batch = shard_of(full)
    keep = rows_with_advantage(batch["advantages"], batch["response_mask"]) if skip else None
    engine = engine_factory()
    for mode in ("token-mean", "seq-mean-token-sum-norm"):
        for mbs in (1, 4):
            metrics = engine.forward_backward(batch, policy_only_loss(mode), mbs, train_rows=keep)
            out[f"skip/grad/{mode}/{mbs}"] = engine.full_gradients()
            out[f"skip/loss/{mode}/{mbs}"] = metrics["loss"]
            out[f"skip/fraction/{mode}/{mbs}"] = metrics["skipped_row_fraction"]
            engine.optimizer.zero_grad(set_to_none=True)


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out: dict = {}
        run_scenarios(lambda: FSDP2Engine(tiny_qwen2(), CFG), lambda b: shard(b, rank), out)
        out["sharded"] = type(next(iter(FSDP2Engine(tiny_qwen2(), None).model.parameters()))).__name__
        skip_scenarios(lambda: FSDP2Engine(tiny_qwen2(), CFG), lambda b: shard(b, rank), out, skip=True)
        budget_scenario(rank, out)
        bf16_scenario(rank, out)
        compile_scenario(rank, out)
        ckpt_dir = os.path.join(out_dir, "dcp")
        checkpoint_scenario(rank, ckpt_dir, out)
        # replicated: a full copy per rank, gradients summed in one all-reduce per step
        replicated: dict = {}
        run_scenarios(
            lambda: FSDP2Engine(tiny_qwen2(), CFG, sharding="replicate"),
            lambda b: shard(b, rank),
            replicated,
            sharding="replicate",
        )
        skip_scenarios(
            lambda: FSDP2Engine(tiny_qwen2(), CFG, sharding="replicate"),
            lambda b: shard(b, rank),
            replicated,
            skip=True,
        )
        replicated["sharded"] = type(
            next(iter(FSDP2Engine(tiny_qwen2(), None, sharding="replicate").model.parameters()))
        ).__name__
        checkpoint_scenario(
            rank, os.path.join(out_dir, "dcp-replicated"), replicated, save_sharding="replicate"
        )
        out["replicate"] = replicated
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def bf16_scenario(rank: int, out: dict) -> None:
    """bf16 mixed precision on CPU over gloo, sharded (FSDP2 gathers bf16) and replicated (autocast)."""
    batch = shard(add_rl_keys(make_padded_batch()), rank)
    for sharding in ("full", "replicate"):
        engine = FSDP2Engine(tiny_qwen2(), CFG, sharding=sharding, mixed_precision=True)
        engine.forward_backward(batch, LOSSES["token_mean"], 4)
        out[f"bf16/{sharding}/grad"] = engine.full_gradients()
        engine.optimizer.zero_grad(set_to_none=True)
        engine.train_step(batch, token_mean_loss, 4)
        out[f"bf16/{sharding}/param_dtypes"] = sorted({str(p.dtype) for p in engine.model.parameters()})
        out[f"bf16/{sharding}/compute_dtype"] = str(engine.compute_dtype)


def compile_scenario(rank: int, out: dict) -> None:
    """Decoder layers compiled by inductor, then sharded by FSDP2: the gradient of the eager engine."""
    from verity.engines.compiled_layers import compile_unavailable_reason

    if compile_unavailable_reason(torch.device("cpu")) is not None:
        return
    engine = FSDP2Engine(tiny_qwen2(), CFG, compile_layers=True)
    engine.forward_backward(shard(add_rl_keys(make_padded_batch()), rank), LOSSES["token_mean"], 4)
    out["compiled/grad"] = engine.full_gradients()
    out["compiled/layers"] = engine.compiled_layers
    out["compiled/sharded"] = type(next(iter(engine.model.parameters()))).__name__


BUDGET_TOKENS = 20  # cuts rank 0's 4 rows into 3 micro-batches (not in row order) and rank 1's 3 into 2


def budget_scenario(rank: int, out: dict) -> None:
    """Fully sharded, micro-batches cut by ``micro_batch_tokens``: the ranks run different counts."""
    from verity.engines.micro_batch_groups import micro_batch_groups

    batch = shard(add_rl_keys(make_padded_batch()), rank)
    rows = len(batch["input_ids"]) - batch.pad_rows
    out["budget/ranges"] = len(micro_batch_groups(batch, rows, 4, BUDGET_TOKENS))
    # padded: the budget counts window positions (test_packed_layout_ranks.py runs the packed count)
    engine = FSDP2Engine(tiny_qwen2(), CFG, micro_batch_tokens=BUDGET_TOKENS, packed=False)
    engine.forward_backward(batch, LOSSES["actor/token-mean"], 4, entropy_requires_grad=True)
    out["grad/budget"] = engine.full_gradients()
    out["budget/logprobs"] = engine.compute_logprobs(batch, micro_batch_size=4, temperature=0.8)


def checkpoint_scenario(rank: int, ckpt_dir: str, out: dict, save_sharding: str = "full") -> None:
    """Train 1 step, save with DCP, restore into a differently initialised engine, train both once more.

    The engine saved has ``save_sharding``; the one restored is always fully sharded.
    """
    import torch.distributed.checkpoint as dcp

    def full(p: torch.Tensor) -> torch.Tensor:
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    batch = rank_shard(make_padded_batch(seed=3), rank)
    a = FSDP2Engine(tiny_qwen2(seed=0), CFG, sharding=save_sharding)
    a.train_step(batch, token_mean_loss, 4)
    dcp.save(a.state_dict_for_checkpoint(), checkpoint_id=ckpt_dir)
    b = FSDP2Engine(tiny_qwen2(seed=9), CFG)
    state = b.state_dict_for_checkpoint()
    dcp.load(state, checkpoint_id=ckpt_dir)
    b.load_checkpoint_state(state)
    a.train_step(batch, token_mean_loss, 4)
    b.train_step(batch, token_mean_loss, 4)
    out["ckpt_max_diff"] = max(
        float((full(pa) - full(pb)).abs().max().detach())
        for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True)
    )
    out["ckpt_step"] = b.global_step


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("fsdp2"))
    return spawn_and_load(_worker, WORLD, out_dir)


@pytest.fixture(scope="module")
def reference():
    out: dict = {}
    run_scenarios(lambda: FSDP2Engine(tiny_qwen2(), CFG), lambda b: b, out)
    skip_scenarios(lambda: FSDP2Engine(tiny_qwen2(), CFG), lambda b: b, out, skip=False)
    return out


@pytest.fixture(scope="module")
def one_rank_group():
    """World size 1 with a real (1-rank gloo) process group: FSDP2 is applied."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out: dict = {}
        run_scenarios(lambda: FSDP2Engine(tiny_qwen2(), CFG), lambda b: b, out)
        out["sharded"] = type(next(iter(FSDP2Engine(tiny_qwen2(), None).model.parameters()))).__name__
    finally:
        dist.destroy_process_group()
    return out


def assert_same_tensors(got: dict, want: dict, what: str, atol: float = 1e-6) -> None:
    assert set(got) == set(want), what
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=atol, msg=lambda m, n=name: f"{what}: {n}: {m}"
        )


@pytest.mark.parametrize("loss_name", list(LOSSES))
@pytest.mark.parametrize("mbs", [1, 4])
def test_gradient_equal_for_1_and_2_workers_and_micro_batch_sizes(
    two_ranks, reference, one_rank_group, loss_name, mbs
):
    want = reference[f"grad/{loss_name}/1"]
    assert any(g.abs().max() > 1e-4 for g in want.values())
    assert_same_tensors(reference[f"grad/{loss_name}/{mbs}"], want, "1 process")
    assert_same_tensors(one_rank_group[f"grad/{loss_name}/{mbs}"], want, "1-rank group")
    for rank in range(WORLD):
        assert_same_tensors(two_ranks[rank][f"grad/{loss_name}/{mbs}"], want, f"2 ranks, rank {rank}")


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("mbs", [1, 4])
def test_critic_gradient_equal_for_1_and_2_workers_and_micro_batch_sizes(
    two_ranks, reference, one_rank_group, mode, mbs
):
    want = reference[f"grad/critic/{mode}/1"]
    assert want["model.layers.0.mlp.up_proj.weight"].abs().max() > 1e-4
    assert_same_tensors(reference[f"grad/critic/{mode}/{mbs}"], want, "1 process", atol=1e-5)
    assert_same_tensors(one_rank_group[f"grad/critic/{mode}/{mbs}"], want, "1-rank group", atol=1e-5)
    for rank in range(WORLD):
        got = two_ranks[rank][f"grad/critic/{mode}/{mbs}"]
        assert_same_tensors(got, want, f"2 ranks, rank {rank}", atol=1e-5)


@pytest.mark.parametrize("mbs", [1, 4])
def test_shared_prompt_layout_keeps_gradients_and_logprobs_for_1_and_2_workers(
    two_ranks, reference, one_rank_group, mbs
):
    from verity.engines.logprobs import padding_free_window
    from verity.engines.shared_prompt import find_prompt_groups, should_share_prompts

    rows = make_grouped_batch()
    half = {k: v[:4] for k, v in rows.items()}
    groups = find_prompt_groups(half["input_ids"], half["attention_mask"], P)
    assert groups.num_groups == 1  # a four-row micro-batch is one group: the grouped layout runs
    assert should_share_prompts(tiny_qwen2(), half, groups, *padding_free_window(half["attention_mask"], R))
    want = reference["grad/grouped/1"]  # one-row micro-batches: the padded window
    assert any(g.abs().max() > 1e-4 for g in want.values())
    assert_same_tensors(reference[f"grad/grouped/{mbs}"], want, "1 process")
    assert_same_tensors(one_rank_group[f"grad/grouped/{mbs}"], want, "1-rank group")
    for rank in range(WORLD):
        assert_same_tensors(two_ranks[rank][f"grad/grouped/{mbs}"], want, f"2 ranks, rank {rank}")
    lp_ref, _ = reference["grouped_logprobs"]
    lp = torch.cat([two_ranks[0]["grouped_logprobs"][0], two_ranks[1]["grouped_logprobs"][0]])
    torch.testing.assert_close(lp, lp_ref, rtol=1e-4, atol=1e-5)


def test_token_budget_micro_batches_keep_the_gradient_with_uneven_counts_over_ranks(two_ranks, reference):
    counts = [two_ranks[rank]["budget/ranges"] for rank in range(WORLD)]
    assert counts[0] != counts[1]  # rank 1 runs zero-weight passes to match rank 0's all-gathers
    for rank in range(WORLD):
        assert_same_tensors(
            two_ranks[rank]["grad/budget"], reference["grad/actor/token-mean/1"], f"rank {rank}"
        )
    logprobs = torch.cat([two_ranks[rank]["budget/logprobs"][0] for rank in range(WORLD)])[:7]
    torch.testing.assert_close(logprobs, reference["logprobs"][0], rtol=1e-5, atol=1e-5)


def test_values_of_each_rank_match_its_rows(two_ranks, reference):
    v0, v1 = two_ranks[0]["values"], two_ranks[1]["values"]
    assert v0.shape == (4, R) and v1.shape == (4, R)
    torch.testing.assert_close(torch.cat([v0, v1[:3]]), reference["values"], rtol=1e-4, atol=1e-5)


def test_parameters_really_are_sharded(two_ranks, one_rank_group):
    assert two_ranks[0]["sharded"] == "DTensor" and one_rank_group["sharded"] == "DTensor"


def test_logprobs_of_each_rank_match_its_rows(two_ranks, reference):
    lp_ref, ent_ref = reference["logprobs"]
    lp0, ent0 = two_ranks[0]["logprobs"]
    lp1, ent1 = two_ranks[1]["logprobs"]
    assert lp0.shape == (4, R) and lp1.shape == (4, R)
    torch.testing.assert_close(torch.cat([lp0, lp1[:3]]), lp_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.cat([ent0, ent1[:3]]), ent_ref, rtol=1e-4, atol=1e-5)


def test_train_steps_match_single_process(two_ranks, reference):
    for step, want in enumerate(reference["metrics"]):
        for rank in range(WORLD):
            got = two_ranks[rank]["metrics"][step]
            for key in ("loss", "grad_norm", "lr", "tokens", "response_tokens", "entropy"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, rank, key)
    # AdamW moves each weight by about lr = 1e-2 per step, and divides by sqrt(v): a gradient
    # entry near 0 turns float summation-order noise into ~1e-5 of weight; 1e-4 is 1% of a step.
    for rank in range(WORLD):
        assert_same_tensors(
            two_ranks[rank]["weights"], reference["weights"], "weights after 2 steps", atol=1e-4
        )


def test_checkpoint_round_trip_on_two_ranks(two_ranks):
    for rank in range(WORLD):
        assert two_ranks[rank]["ckpt_step"] == 2
        assert two_ranks[rank]["ckpt_max_diff"] == 0.0


@pytest.mark.parametrize("mbs", [1, 4])
def test_replicated_ranks_give_the_same_gradients_as_one_process(two_ranks, reference, mbs):
    for rank in range(WORLD):
        got = two_ranks[rank]["replicate"]
        assert got["sharded"] == "Parameter"  # a full copy per rank, no DTensor
        for loss_name in LOSSES:
            want = reference[f"grad/{loss_name}/1"]
            assert_same_tensors(got[f"grad/{loss_name}/{mbs}"], want, f"replicated, rank {rank}, {loss_name}")
        for mode in AGG_MODES:
            want = reference[f"grad/critic/{mode}/1"]
            assert_same_tensors(
                got[f"grad/critic/{mode}/{mbs}"], want, f"replicated critic, {mode}", atol=1e-5
            )
        assert_same_tensors(got[f"grad/grouped/{mbs}"], reference["grad/grouped/1"], "replicated, grouped")


def test_replicated_train_steps_match_and_the_copies_stay_identical(two_ranks, reference):
    for step, want in enumerate(reference["metrics"]):
        for rank in range(WORLD):
            got = two_ranks[rank]["replicate"]["metrics"][step]
            for key in ("loss", "grad_norm", "lr", "tokens", "response_tokens", "entropy"):
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (step, rank, key)
    first, second = two_ranks[0]["replicate"]["weights"], two_ranks[1]["replicate"]["weights"]
    for name in first:
        assert torch.equal(first[name], second[name]), name  # bitwise: same sum, same AdamW step
    assert_same_tensors(first, reference["weights"], "replicated weights after 2 steps", atol=1e-4)


def test_a_replicated_checkpoint_resumes_into_full_sharding(two_ranks):
    for rank in range(WORLD):
        got = two_ranks[rank]["replicate"]
        assert got["ckpt_step"] == 2
        assert got["ckpt_max_diff"] < 1e-5  # gradient norms are summed in another order


@pytest.mark.parametrize("sharding", ["full", "replicate"])
def test_skipping_zero_advantage_rows_keeps_the_gradient_on_two_ranks(two_ranks, reference, sharding):
    """Rank 0 has only zero-advantage rows (it runs one, with zero gradient), rank 1 skips one of
    three; the gradient summed over ranks equals one process training all 7 rows."""
    for rank_out in two_ranks:
        got = rank_out if sharding == "full" else rank_out["replicate"]
        for mode in ("token-mean", "seq-mean-token-sum-norm"):
            for mbs in (1, 4):
                key = f"{mode}/{mbs}"
                assert_same_tensors(got[f"skip/grad/{key}"], reference[f"skip/grad/{key}"], f"{sharding} {key}")
                assert got[f"skip/loss/{key}"] == pytest.approx(reference[f"skip/loss/{key}"], rel=1e-5, abs=1e-7)
                assert got[f"skip/fraction/{key}"] == pytest.approx(len(ZERO_ROWS) / 7)
                assert reference[f"skip/fraction/{key}"] == 0.0


def test_compiled_sharded_layers_give_the_eager_gradient_on_two_ranks(two_ranks, reference):
    from verity.engines.compiled_layers import compile_unavailable_reason

    reason = compile_unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(f"inductor cannot compile here: {reason}")
    for rank_out in two_ranks:
        assert rank_out["compiled/layers"] == 2 and rank_out["compiled/sharded"] == "DTensor"
        # fused kernels round differently from the eager ones: close, not bit for bit
        assert_same_tensors(rank_out["compiled/grad"], reference["grad/token_mean/4"], "compiled", atol=1e-5)


def test_bf16_mixed_precision_on_two_cpu_ranks_stays_near_the_float32_gradient(two_ranks, reference):
    want = reference["grad/token_mean/4"]
    flat_want = torch.cat([want[k].flatten() for k in sorted(want)])
    for sharding in ("full", "replicate"):
        for rank_out in two_ranks:
            got = rank_out[f"bf16/{sharding}/grad"]
            assert set(got) == set(want), sharding
            flat_got = torch.cat([got[k].flatten() for k in sorted(want)])
            relative = float((flat_got - flat_want).norm() / flat_want.norm())
            # bf16 rounding moves it a little (so the bf16 path ran); a wrong shard or sum moves it a lot
            assert 0 < relative < 0.05, (sharding, relative)
            assert rank_out[f"bf16/{sharding}/param_dtypes"] == ["torch.float32"], sharding
            assert rank_out[f"bf16/{sharding}/compute_dtype"] == "torch.bfloat16", sharding
        # every rank holds the same summed gradient
        torch.testing.assert_close(two_ranks[0][f"bf16/{sharding}/grad"], two_ranks[1][f"bf16/{sharding}/grad"])
