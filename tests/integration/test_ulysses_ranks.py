"""Ulysses sequence parallelism over gloo ranks vs the padded single-process engine.

2 ranks, SP=2 (one SP group, both ranks given all 7 rows of mixed lengths; SP runs on the packed
layout): log-probs, entropy, values, parameter gradients of policy and value losses and two
optimizer steps equal the single-process padded engine's within float32 tolerance; under a
``micro_batch_tokens`` budget both SP ranks form the same micro-batches and keep the gradient; the all-to-all and the sequence gather
round-trip (forward and backward) on the same ranks. 4 ranks, SP=2 x FSDP=2 (two SP groups, each
given its half of the rows, FSDP2 sharding over all four): the same gradients and log-probs.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import make_padded_batch, tiny_qwen2, tiny_value_model
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.micro_batches import num_rows

pytestmark = pytest.mark.slow  # gloo processes on 2 cores: ~1 min for 2 ranks, more for 4

CFG = OptimConfig(lr=1e-2, warmup_steps=2, grad_clip=1.0)
BUDGET = 16  # micro_batch_tokens: at least the longest row (14 tokens), so several micro-batches


def add_rl_keys(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Old/reference log-probs and critic targets with noise, so that every loss term is live."""
    g = torch.Generator().manual_seed(11)
    shape = batch["responses"].shape
    return {
        **batch,
        "old_logprobs": -3.0 + 0.3 * torch.randn(shape, generator=g),
        "ref_logprobs": -3.0 + 0.3 * torch.randn(shape, generator=g),
        "values": 0.5 * torch.randn(shape, generator=g),
        "returns": torch.randn(shape, generator=g),
    }


def token_mean_loss(mb, logprobs, entropy, agg):
    """sum_tokens(-logprob * advantage) / global_tokens."""
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def actor_loss(mode: str):
    """The trainer's actor loss: dual-clip PPO + k3 KL loss - entropy bonus (entropy with a gradient)."""
    from verity.algorithms.configs import KLConfig, PolicyLossConfig
    from verity.workers.actor_rollout import make_actor_loss

    policy = PolicyLossConfig(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    return make_actor_loss(policy, KLConfig(use_kl_loss=True, kl_loss_kind="k3", kl_loss_coef=0.1), 0.01)


LOSSES = {
    "token_mean": (token_mean_loss, False),
    "actor/token-mean": (actor_loss("token-mean"), True),
    "actor/seq-mean-token-sum-norm": (actor_loss("seq-mean-token-sum-norm"), True),
}


def the_batch() -> dict[str, torch.Tensor]:
    """7 rows, prompts 2-8 and responses 1-6 tokens long (``helpers.tiny_models``)."""
    return add_rl_keys(make_padded_batch())


def scenarios(rows, out: dict, **engine_kwargs) -> None:
    """What the reference and every rank run on their ``rows`` (a mapping of ``[b, ...]`` tensors)."""
    from verity.algorithms.configs import ValueLossConfig
    from verity.workers.critic import make_value_loss

    engine = FSDP2Engine(tiny_qwen2(), CFG, **engine_kwargs)
    out["dp_layout"] = engine.dp_layout
    for name, (loss_fn, entropy_grad) in LOSSES.items():
        for mbs in (1, 4):
            metrics = engine.forward_backward(rows, loss_fn, mbs, entropy_requires_grad=entropy_grad)
            out[f"grad/{name}/{mbs}"] = engine.full_gradients()
            out[f"loss/{name}/{mbs}"] = metrics["loss"]
            engine.optimizer.zero_grad(set_to_none=True)
    # gradient checkpointing: each layer's forward is recomputed in backward, after the pass returned
    checkpointed = FSDP2Engine(tiny_qwen2(), CFG, gradient_checkpointing=True, **engine_kwargs)
    checkpointed.forward_backward(rows, LOSSES["actor/token-mean"][0], 4, entropy_requires_grad=True)
    out["grad/checkpointed"] = checkpointed.full_gradients()
    # a token budget: micro-batches cut longest first (packed: real tokens, counted per SP group)
    budgeted = FSDP2Engine(tiny_qwen2(), CFG, micro_batch_tokens=BUDGET, **engine_kwargs)
    groups, count = budgeted._micro_ranges(rows, num_rows(rows), 4)
    out["budget_groups"], out["budget_passes"] = [g.tolist() for g in groups], count
    budgeted.forward_backward(rows, token_mean_loss, 4)
    out["grad/budget"] = budgeted.full_gradients()
    out["logprobs"], out["entropy"] = engine.compute_logprobs(rows, micro_batch_size=3, temperature=0.8)
    metrics = [engine.train_step(rows, token_mean_loss, 2) for _ in range(2)]
    out["metrics"] = [{k: m[k] for k in ("loss", "grad_norm", "entropy", "response_tokens")} for m in metrics]
    out["logprobs_after"], _ = engine.compute_logprobs(rows, micro_batch_size=4)
    critic = FSDP2Engine(tiny_value_model(), CFG, **engine_kwargs)
    loss_fn = make_value_loss(ValueLossConfig(cliprange_value=0.2, loss_agg_mode="token-mean"))
    critic.forward_backward_values(rows, loss_fn, 2)
    out["grad/critic"] = critic.full_gradients()
    out["values"] = critic.compute_values(rows, micro_batch_size=3)


def exchange_round_trip(out: dict) -> None:
    """The SP ops on a 2-rank group: forward shapes and values, backward the inverse exchange / own slice."""
    from verity.engines.ulysses import all_to_all, gather_sequence, new_sequence_parallel_group

    sp = new_sequence_parallel_group(2)
    rank = dist.get_rank()
    # [1, H=4, T/s=3, D=2]: value = 1000 * rank + 100 * head + 10 * token + feature
    h, t, d = torch.meshgrid(torch.arange(4), torch.arange(3), torch.arange(2), indexing="ij")
    x = (1000 * rank + 100 * h + 10 * t + d).float()[None].requires_grad_(True)
    y = all_to_all(x, sp.group, scatter_dim=1, gather_dim=2)  # [1, 2, 6, 2]
    out["a2a"] = y.detach()
    back = all_to_all(y, sp.group, scatter_dim=2, gather_dim=1)
    out["a2a_back"] = back.detach()
    weight = torch.arange(y.numel(), dtype=torch.float32).reshape(y.shape)
    (y * weight).sum().backward()
    out["a2a_grad"] = x.grad
    z = torch.arange(4.0).add(10 * rank).requires_grad_(True)
    full = gather_sequence(z, sp.group)
    out["gathered"] = full.detach()
    (full * torch.arange(8.0)).sum().backward()
    out["gather_grad"] = z.grad


def _worker(rank: int, port: int, out_dir: str, world: int) -> None:
    from verity.batch import Batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out: dict = {}
        if world == 2:
            exchange_round_trip(out)
            rows = the_batch()  # one SP group: both ranks hold every row
        else:  # two SP groups of 2: each group holds its half of the rows
            rows = Batch.from_dict(the_batch()).split(2)[rank // 2]
        scenarios(rows, out, ulysses_sequence_parallel_size=2)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _worker2(rank: int, port: int, out_dir: str) -> None:
    _worker(rank, port, out_dir, 2)


def _worker4(rank: int, port: int, out_dir: str) -> None:
    _worker(rank, port, out_dir, 4)


@pytest.fixture(scope="module")
def reference() -> dict:
    out: dict = {}
    scenarios(the_batch(), out, packed=False)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    return spawn_and_load(_worker2, 2, str(tmp_path_factory.mktemp("ulysses2")))


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    return spawn_and_load(_worker4, 4, str(tmp_path_factory.mktemp("ulysses4")))


def assert_close_dict(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def test_all_to_all_and_gather_round_trip_on_two_ranks(two_ranks):
    for rank, out in enumerate(two_ranks):
        # rank r keeps heads 2r, 2r+1 over all 6 tokens: rank 0's 3 tokens, then rank 1's
        a2a = out["a2a"]
        assert a2a.shape == (1, 2, 6, 2)
        assert a2a[0, 0, :, 0].tolist() == [100 * 2 * rank + v for v in (0, 10, 20, 1000, 1010, 1020)]
        h, t, d = torch.meshgrid(torch.arange(4), torch.arange(3), torch.arange(2), indexing="ij")
        assert torch.equal(out["a2a_back"][0], (1000 * rank + 100 * h + 10 * t + d).float())
        assert out["gathered"].tolist() == [0, 1, 2, 3, 10, 11, 12, 13]
        # gather's backward: this rank's slice of the gradient, not a sum over ranks
        assert out["gather_grad"].tolist() == [4.0 * rank + i for i in range(4)]
    # all_to_all's backward is the inverse exchange: the weight each of x's elements met in y
    weights = torch.arange(24, dtype=torch.float32).reshape(1, 2, 6, 2)
    for rank, out in enumerate(two_ranks):
        for head in range(4):
            owner, local_head = divmod(head, 2)
            want = weights[0, local_head, 3 * rank : 3 * rank + 3]
            assert owner in (0, 1) and torch.equal(out["a2a_grad"][0, head], want), (rank, head)


def test_sp2_layout_shares_rows_within_the_group(two_ranks, four_ranks):
    assert [out["dp_layout"] for out in two_ranks] == [(0, 1, True), (0, 1, False)]
    assert [out["dp_layout"] for out in four_ranks] == [
        (0, 2, True),
        (0, 2, False),
        (1, 2, True),
        (1, 2, False),
    ]


@pytest.mark.parametrize("name", [f"{loss}/{mbs}" for loss in LOSSES for mbs in (1, 4)])
def test_sp2_gradients_equal_the_padded_single_process(two_ranks, reference, name):
    want = reference[f"grad/{name}"]
    assert any(g.abs().max() > 1e-4 for g in want.values())
    for rank, out in enumerate(two_ranks):
        assert_close_dict(out[f"grad/{name}"], want, f"SP=2 rank {rank}")
        assert out[f"loss/{name}"] == pytest.approx(reference[f"loss/{name}"], rel=1e-5)


def test_sp2_logprobs_entropy_values_and_steps_equal_the_single_process(two_ranks, reference):
    for rank, out in enumerate(two_ranks):
        for key in ("logprobs", "entropy", "logprobs_after", "values"):
            torch.testing.assert_close(
                out[key], reference[key], rtol=1e-4, atol=1e-5, msg=f"rank {rank} {key}"
            )
        assert_close_dict(out["grad/critic"], reference["grad/critic"], f"critic rank {rank}")
        for got, want in zip(out["metrics"], reference["metrics"], strict=True):
            assert got == pytest.approx(want, rel=1e-4), rank


def test_sp2_with_gradient_checkpointing_keeps_the_gradient(two_ranks, reference):
    for rank, out in enumerate(two_ranks):
        assert_close_dict(out["grad/checkpointed"], reference["grad/actor/token-mean/4"], f"rank {rank}")


def test_sp2_ranks_form_the_same_token_budgeted_micro_batches(two_ranks, four_ranks, reference):
    groups = [out["budget_groups"] for out in two_ranks]
    assert groups[0] == groups[1] and len(groups[0]) > 1  # one SP group: identical micro-batches
    assert sorted(i for group in groups[0] for i in group) == list(range(7))
    assert two_ranks[0]["budget_passes"] == len(groups[0])
    assert four_ranks[0]["budget_groups"] == four_ranks[1]["budget_groups"]
    assert four_ranks[2]["budget_groups"] == four_ranks[3]["budget_groups"]
    for rank, out in enumerate(two_ranks):
        assert_close_dict(out["grad/budget"], reference["grad/budget"], f"budget rank {rank}")
        assert_close_dict(out["grad/budget"], reference["grad/token_mean/4"], f"budget rank {rank}")


@pytest.mark.parametrize("name", ["token_mean/4", "actor/token-mean/1"])
def test_sp2_x_fsdp2_on_four_ranks_equals_the_single_process(four_ranks, reference, name):
    for rank, out in enumerate(four_ranks):
        assert_close_dict(out[f"grad/{name}"], reference[f"grad/{name}"], f"SP=2 x FSDP=2 rank {rank}")
        assert out[f"loss/{name}"] == pytest.approx(reference[f"loss/{name}"], rel=1e-5)
        half = slice(0, 4) if rank < 2 else slice(4, 7)
        torch.testing.assert_close(out["logprobs"][: half.stop - half.start], reference["logprobs"][half])
        for got, want in zip(out["metrics"], reference["metrics"], strict=True):
            assert got == pytest.approx(want, rel=1e-4), rank
