"""The weight sync into a tensor-parallel rollout (2 gloo ranks, one replica of TP=2), per engine kind.

FSDP2: each rank receives only its slices straight from the shards (received bytes about half the
model's). LoRA: the merged weights ``W + s B A`` are gathered whole and cut (every rank receives the
whole model, and holds half). Either way the rollout's local shards must equal the trainer's full
weights sliced by the slicing rule, after a training step has moved them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import make_unpadded_batch, push_up_loss, tiny_qwen2
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.fsdp2_lora import FSDP2LoRAEngine
from verity.engines.lora import LoRAConfig

WORLD = 2
BUCKET_BYTES = 32 * 1024  # several buckets for this ~0.3 MB model


def _max_slice_error(rollout, full: dict[str, torch.Tensor]) -> float:
    from verity.resharding import tp_slice_bounds

    worst = 0.0
    for name, param in rollout.model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        whole = (
            full["model.embed_tokens.weight"] if name == "lm_head.weight" and name not in full else full[name]
        )
        bounds = tp_slice_bounds(name, tuple(whole.shape), rollout.tensor_parallel_rank, 2)
        expected = whole if bounds is None else whole.narrow(*bounds)
        worst = max(worst, float((local.detach() - expected).abs().max()))
    return worst


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from verity.resharding import iter_engine_weights, sync_weights
    from verity.rollout.hf_tensor_parallel import TensorParallelHFRollout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replica", "tp"))["tp"]
        out: dict = {}
        engines = {
            "fsdp2": FSDP2Engine(tiny_qwen2(seed=0), OptimConfig(lr=1e-2)),
            "lora": FSDP2LoRAEngine(
                tiny_qwen2(seed=0), OptimConfig(lr=1e-2), lora=LoRAConfig(rank=4, alpha=8), seed=0
            ),
        }
        for kind, engine in engines.items():
            engine.train_step(make_unpadded_batch(4, seed=rank), push_up_loss, micro_batch_size=2)
            full = {n: t.clone() for n, t in iter_engine_weights(engine, BUCKET_BYTES)}
            full_bytes = sum(t.numel() * t.element_size() for t in full.values())
            rollout = TensorParallelHFRollout.from_config(tiny_qwen2().config, tp_mesh=mesh, eos_token_ids=0)
            stats = sync_weights(engine, rollout, bucket_bytes=BUCKET_BYTES)
            out[kind] = {
                "error": _max_slice_error(rollout, full),
                "received": stats.received_bytes / full_bytes,
                "handed": stats.num_bytes / full_bytes,
                "needs_sync": rollout.needs_weight_sync,
            }
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_each_rank_gets_its_slices_from_fsdp2_and_from_merged_adapters(tmp_path):
    for out in spawn_and_load(_worker, WORLD, str(tmp_path)):
        fsdp2, lora = out["fsdp2"], out["lora"]
        assert fsdp2["error"] == 0.0 and lora["error"] < 1e-6  # the merge's matmul rounds
        assert not fsdp2["needs_sync"] and not lora["needs_sync"]
        assert 0.45 < fsdp2["handed"] < 0.6 and 0.45 < fsdp2["received"] < 0.6  # slices only
        assert 0.45 < lora["handed"] < 0.6 and lora["received"] >= 1.0  # whole merged weights, then cut
