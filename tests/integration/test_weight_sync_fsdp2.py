"""Weight sync from an FSDP2-sharded trainer (2 gloo processes) into a rollout model.

After one optimizer step, each rank gathers the full weights bucket by bucket and copies
them in place into its own (colocated) rollout model, initialised differently. The rollout's
weights must then equal the trainer's exactly, and its log-probs must equal the trainer's.
The sync time is printed (no timing assertion).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import make_unpadded_batch, push_up_loss, tiny_qwen2
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.logprobs import response_logprobs
from verity.resharding import ModuleWeightReceiver, iter_full_state_dict_buckets, sync_weights

WORLD = 2
BUCKET_BYTES = 48 * 1024  # several buckets for this ~0.2 MB model


def max_weight_diff(model, full: dict[str, torch.Tensor]) -> float:
    state = model.state_dict()
    return max(float((state[name].float() - tensor.float()).abs().max()) for name, tensor in full.items())


def _worker(rank: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out: dict = {}
        engine = FSDP2Engine(tiny_qwen2(seed=0), OptimConfig(lr=1e-2))
        batch = make_unpadded_batch(4, seed=rank)
        engine.train_step(batch, push_up_loss, micro_batch_size=2)
        buckets = list(iter_full_state_dict_buckets(engine.model, BUCKET_BYTES))
        full = {name: t.clone() for bucket in buckets for name, t in bucket}
        # an independent reference: each parameter's own DTensor.full_tensor()
        reference = {n: p.full_tensor().detach().clone() for n, p in engine.model.named_parameters()}
        out["gather_vs_full_tensor"] = max(
            float((full[n] - t).abs().max()) if full[n].shape == t.shape else float("inf")
            for n, t in reference.items()
        )
        out["uneven"] = uneven_shards_scenario()
        out["bucket_bytes"] = [[t.numel() * t.element_size() for _, t in b] for b in buckets]
        out["param_types"] = {type(p).__name__ for p in engine.model.parameters()}

        # colocated: every rank copies into its own rollout model in process
        rollout = tiny_qwen2(seed=7).eval()
        out["diff_before"] = max_weight_diff(rollout, full)
        stats = sync_weights(engine, ModuleWeightReceiver(rollout), bucket_bytes=BUCKET_BYTES)
        out["stats"] = (stats.num_tensors, stats.num_bytes, stats.seconds)
        out["diff_after"] = max_weight_diff(rollout, full)
        out["full_names"] = sorted(full)
        with torch.no_grad():
            rollout_lp, _ = response_logprobs(rollout, batch)
        trainer_lp, _ = engine.compute_logprobs(batch, micro_batch_size=4)
        out["logprob_diff"] = float((rollout_lp - trainer_lp).abs().max())

        # a separate rollout on rank 0 only, in bfloat16: rank 1 only helps gather
        rollout_bf16 = tiny_qwen2(seed=8).to(torch.bfloat16) if rank == 0 else None
        target = ModuleWeightReceiver(rollout_bf16) if rollout_bf16 is not None else None
        stats16 = sync_weights(engine, target, bucket_bytes=BUCKET_BYTES, dtype=torch.bfloat16)
        out["bf16_bytes"] = stats16.num_bytes
        if rollout_bf16 is not None:
            out["bf16_diff"] = max_weight_diff(
                rollout_bf16, {k: v.to(torch.bfloat16) for k, v in full.items()}
            )
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def uneven_shards_scenario() -> dict:
    """Parameters whose dim 0 does not divide over the ranks (7 rows, 1 row, a vector of 3), coalesced in one bucket."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    module = nn.Module()
    module.odd = nn.Parameter(torch.randn(7, 3))
    module.single = nn.Parameter(torch.randn(1, 4))
    module.vector = nn.Parameter(torch.randn(3))
    module.register_buffer("steps", torch.arange(5))
    want = {n: t.detach().clone() for n, t in module.state_dict().items()}
    fully_shard(module)
    local_rows = {n: p.to_local().shape[0] for n, p in module.named_parameters()}
    got = {n: t.clone() for b in iter_full_state_dict_buckets(module, 1 << 20) for n, t in b}
    got16 = {
        n: t.clone()
        for b in iter_full_state_dict_buckets(module, 1 << 20, dtype=torch.bfloat16)
        for n, t in b
    }
    # buckets of one tensor each: gathered in place (the short last shard padded, then cut off)
    alone = {n: t.clone() for b in iter_full_state_dict_buckets(module, 1) for n, t in b}
    return {"want": want, "got": got, "got16": got16, "alone": alone, "local_rows": local_rows}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("weight_sync"))
    return spawn_and_load(_worker, WORLD, out_dir)


def test_rollout_weights_equal_trainer_weights_after_sync(results):
    for rank, res in enumerate(results):
        assert res["param_types"] == {"DTensor"}, "trainer parameters must be FSDP2 shards"
        assert res["diff_before"] > 1e-3, "the rollout must start from other weights"
        assert res["diff_after"] == 0.0, f"rank {rank}: rollout differs from trainer after sync"
        assert res["logprob_diff"] < 1e-5
        num_tensors, num_bytes, seconds = res["stats"]
        assert num_tensors == len(res["full_names"]) == 2 * 12 + 2  # layers + embed + final norm
        print(
            f"\nrank {rank}: synced {num_tensors} tensors, {num_bytes / 1e6:.3f} MB in {seconds * 1e3:.1f} ms"
        )
    assert results[0]["full_names"] == results[1]["full_names"]


def test_buckets_are_bounded(results):
    for bucket in results[0]["bucket_bytes"]:
        assert sum(bucket) <= BUCKET_BYTES or len(bucket) == 1
    assert len(results[0]["bucket_bytes"]) > 3


def test_bf16_sync_to_a_rollout_on_rank_zero_only(results):
    assert results[0]["bf16_diff"] == 0.0
    float32_bytes = results[0]["stats"][1]
    assert results[0]["bf16_bytes"] == float32_bytes // 2
    assert results[1]["bf16_bytes"] == 0  # rank 1 gathered but had no rollout to send to


def test_coalesced_gather_equals_each_parameters_full_tensor(results):
    for res in results:
        assert res["gather_vs_full_tensor"] == 0.0


def test_uneven_shards_gather_to_the_original_tensors(results):
    for rank, res in enumerate(results):
        uneven = res["uneven"]
        # torch.chunk layout: 7 rows -> 4 + 3; 1 row -> 1 + 0; 3 -> 2 + 1
        assert uneven["local_rows"] == {"odd": [4, 3][rank], "single": [1, 0][rank], "vector": [2, 1][rank]}
        assert uneven["got"].keys() == uneven["want"].keys()
        for name, tensor in uneven["want"].items():
            assert torch.equal(uneven["got"][name], tensor), (rank, name)
            want16 = tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor
            assert torch.equal(uneven["got16"][name], want16), (rank, name)
            assert torch.equal(uneven["alone"][name], tensor), (rank, name)
