"""FSDP2 on 2 gloo ranks, packed == padded: log-probs, entropy, values and gradients.

The 2-rank run is spawned once per module; each rank runs the actor (fully sharded, the
vocabulary in row shards as by default on a CPU) and the critic, padded and packed, on its
half of a 7-row mini-batch (rank 1's half carries a padding row, ``pad_rows=1``), with
micro-batches cut by a token budget so that the ranks run different numbers of passes.
The padded single-process engine is the reference.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import make_padded_batch, tiny_qwen2, tiny_value_model
from verity.engines import FSDP2Engine, OptimConfig

pytestmark = pytest.mark.slow  # spawns 2 ranks once for the module: tens of seconds on 2 cores

WORLD = 2
CFG = OptimConfig(lr=1e-2, grad_clip=1.0)
BUDGET = 15  # real tokens per micro-batch when packed: 3 passes on rank 0, 2 on rank 1


def _batch() -> dict[str, torch.Tensor]:
    batch = make_padded_batch(rows=7, seed=11)
    batch["returns"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(2))
    return batch


def _shard(batch: dict[str, torch.Tensor], rank: int):
    from verity.batch import Batch

    return Batch.from_dict(batch).split(WORLD)[rank]


def policy_loss(mb, logprobs, entropy, agg):
    mask = mb["response_mask"]
    return (-(logprobs * mb["advantages"]) * mask).sum() / agg.global_tokens - 0.01 * (
        entropy * mask
    ).sum() / agg.global_tokens, {}


def value_loss(mb, values, agg):
    return ((values - mb["returns"]) ** 2 * mb["response_mask"]).sum() / agg.global_tokens, {}


def scenarios(batch, packed: bool, out: dict) -> None:
    """Actor and critic passes of one layout; results under ``<name>/<packed|padded>``."""
    tag = "packed" if packed else "padded"
    actor = FSDP2Engine(tiny_qwen2(), CFG, packed=packed, micro_batch_tokens=BUDGET)
    assert actor.packed is packed
    out[f"logprobs/{tag}"], out[f"entropy/{tag}"] = actor.compute_logprobs(batch, 4, temperature=0.8)
    actor.forward_backward(batch, policy_loss, 4, temperature=0.8, entropy_requires_grad=True)
    out[f"grad/{tag}"] = actor.full_gradients()
    critic = FSDP2Engine(tiny_value_model(), CFG, packed=packed, micro_batch_tokens=BUDGET)
    out[f"values/{tag}"] = critic.compute_values(batch, 4)
    critic.forward_backward_values(batch, value_loss, 4)
    out[f"value_grad/{tag}"] = critic.full_gradients()


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        batch = _shard(_batch(), rank)
        from verity.engines.micro_batch_groups import micro_batch_groups

        rows = len(batch["input_ids"]) - batch.pad_rows
        out: dict = {
            "pad_rows": batch.pad_rows,
            "passes": len(micro_batch_groups(batch, rows, 4, BUDGET, "tokens")),  # the engine's packed passes
        }
        for packed in (False, True):
            scenarios(batch, packed, out)
        out["vocab_sharded"] = FSDP2Engine(tiny_qwen2(), None).vocab_sharded
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_and_load(_worker, WORLD, str(tmp_path_factory.mktemp("packed")))


@pytest.fixture(scope="module")
def reference():
    out: dict = {}
    scenarios(_batch(), False, out)
    return out


def _close(got, want, what: str) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), what
        assert any(g.abs().max() > 1e-4 for g in want.values()), what  # the check has something to see
        for name in want:
            torch.testing.assert_close(
                got[name], want[name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
            )
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", ["grad", "value_grad"])
def test_gradients_packed_equal_padded_on_two_ranks(two_ranks, reference, name):
    assert two_ranks[1]["pad_rows"] == 1 and all(r["vocab_sharded"] for r in two_ranks)
    assert two_ranks[0]["passes"] != two_ranks[1]["passes"]  # rank 1 runs a zero-weight pass to match
    for rank in two_ranks:
        _close(rank[f"{name}/packed"], rank[f"{name}/padded"], f"{name}: 2 ranks")
    _close(two_ranks[0][f"{name}/packed"], reference[f"{name}/padded"], f"{name}: 2 ranks vs 1 process")


@pytest.mark.parametrize("name", ["logprobs", "entropy", "values"])
def test_scores_packed_equal_padded_on_two_ranks(two_ranks, reference, name):
    rows = [rank[f"{name}/packed"][: len(rank[f"{name}/packed"]) - rank["pad_rows"]] for rank in two_ranks]
    _close(torch.cat(rows), reference[f"{name}/padded"], name)
    for rank in two_ranks:
        _close(rank[f"{name}/packed"], rank[f"{name}/padded"], f"{name}: 2 ranks")
