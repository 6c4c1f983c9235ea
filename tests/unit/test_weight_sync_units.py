"""Resharding pieces in one process: bucket plans, gathering, name mapping, TP slicing, in-place copy."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from verity.resharding import (
    ModuleWeightReceiver,
    compose,
    copy_named_tensors_into,
    iter_full_state_dict,
    iter_full_state_dict_buckets,
    map_names,
    plan_buckets,
    regex_rename,
    skip_matching,
    slice_for_tp,
    strip_prefix,
    sync_weights,
    tp_split_dim,
)


def test_plan_buckets_respects_capacity_and_order():
    sizes = [("a", 40), ("b", 50), ("c", 20), ("d", 200), ("e", 10)]
    assert plan_buckets(sizes, 100) == [["a", "b"], ["c"], ["d"], ["e"]]
    assert plan_buckets(sizes, 1000) == [["a", "b", "c", "d", "e"]]
    assert plan_buckets([], 10) == []
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(sizes, 0)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def test_gather_dedupes_ties_skips_non_persistent_and_buckets_by_bytes():
    model = Tied()
    names = [n for n, _ in iter_full_state_dict(model)]
    assert names == ["embed.weight", "proj.weight", "proj.bias", "scale"]
    with_tied = [n for n, _ in iter_full_state_dict(model, include_tied=True)]
    assert "head.weight" in with_tied
    # float32: embed 160 B, proj.weight 64 B, proj.bias 16 B, scale 16 B; bf16 halves them
    buckets = [[n for n, _ in b] for b in iter_full_state_dict_buckets(model, bucket_bytes=80)]
    assert buckets == [["embed.weight"], ["proj.weight", "proj.bias"], ["scale"]]
    bf16 = list(iter_full_state_dict_buckets(model, bucket_bytes=80, dtype=torch.bfloat16))
    assert [[n for n, _ in b] for b in bf16] == [["embed.weight"], ["proj.weight", "proj.bias", "scale"]]
    assert all(t.dtype == torch.bfloat16 for b in bf16 for _, t in b)


def test_name_mappers():
    mapper = compose(
        strip_prefix("model."), regex_rename([(r"^lm_head", "output")]), skip_matching(r"rotary")
    )
    assert mapper("model.layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert mapper("lm_head.weight") == "output.weight"
    assert mapper("model.rotary_emb.inv_freq") is None
    stream = [("model.a", torch.zeros(1)), ("model.rotary", torch.zeros(1))]
    assert [n for n, _ in map_names(stream, mapper)] == ["a"]


def test_tp_split_dims_for_qwen2_layers():
    layer = "model.layers.3."
    assert tp_split_dim(layer + "self_attn.q_proj.weight") == 0
    assert tp_split_dim(layer + "self_attn.k_proj.bias") == 0
    assert tp_split_dim(layer + "mlp.gate_proj.weight") == 0
    assert tp_split_dim(layer + "self_attn.o_proj.weight") == 1
    assert tp_split_dim(layer + "mlp.down_proj.weight") == 1
    assert tp_split_dim(layer + "input_layernorm.weight") is None
    assert tp_split_dim("model.embed_tokens.weight") == 0
    assert tp_split_dim("model.norm.weight") is None


def test_slice_for_tp_hand_values():
    w = torch.arange(24.0).reshape(4, 6)  # [out=4, in=6]
    q1 = slice_for_tp("model.layers.0.self_attn.q_proj.weight", w, 1, 2)
    assert torch.equal(q1, w[2:4])
    o2 = slice_for_tp("model.layers.0.self_attn.o_proj.weight", w, 2, 3)
    assert torch.equal(o2, w[:, 4:6]) and o2.is_contiguous()
    norm = torch.ones(6)
    assert slice_for_tp("model.norm.weight", norm, 1, 2) is norm
    # the shards of every rank put back together give the full tensor
    parts = [slice_for_tp("model.layers.0.mlp.down_proj.weight", w, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(parts, 1), w)
    with pytest.raises(ValueError, match="not divisible by tp_size=4"):
        slice_for_tp("model.layers.0.mlp.down_proj.weight", w, 0, 4)
    with pytest.raises(ValueError, match="tp_rank"):
        slice_for_tp("model.layers.0.mlp.up_proj.weight", w, 2, 2)


def test_kv_heads_are_replicated_when_fewer_than_tp_ranks():
    k = torch.arange(8.0).reshape(4, 2)  # 2 kv heads of head_dim 2
    shards = [
        slice_for_tp("model.layers.0.self_attn.k_proj.weight", k, r, 4, num_kv_heads=2) for r in range(4)
    ]
    assert [s.tolist() for s in shards] == [k[:2].tolist(), k[:2].tolist(), k[2:].tolist(), k[2:].tolist()]
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        slice_for_tp("model.layers.0.self_attn.v_proj.weight", k, 0, 3, num_kv_heads=2)


def test_copy_into_module_in_place_and_strict_checks():
    src, dst = Tied(), Tied()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(1.0)
    head_before = dst.head.weight
    loaded = copy_named_tensors_into(dst, iter_full_state_dict(src))
    assert loaded == {"embed.weight", "proj.weight", "proj.bias", "scale"}
    assert dst.head.weight is head_before  # same storage, filled in place
    for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    with pytest.raises(KeyError, match="no counterpart"):
        copy_named_tensors_into(dst, [("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        copy_named_tensors_into(dst, [("proj.bias", torch.zeros(5))])
    with pytest.raises(KeyError, match="no weight was sent"):
        copy_named_tensors_into(dst, [("proj.bias", torch.zeros(4))])


def test_sync_weights_single_process_reports_stats():
    src, dst = Tied(), Tied()
    stats = sync_weights(src, ModuleWeightReceiver(dst), bucket_bytes=64)
    assert stats.num_tensors == 4
    assert stats.num_bytes == (40 + 16 + 4 + 4) * 4
    assert torch.equal(dst.proj.weight, src.proj.weight)
    with pytest.raises(TypeError, match=r"\.model module"):
        sync_weights(object(), None)


def test_sync_weights_sends_full_tensors_to_a_tensor_parallel_rollout_that_slices_itself():
    # vLLM inside the actor's ranks: tensor_parallel_size 2, but its loader takes checkpoint-sized tensors
    class FullTaker:
        tensor_parallel_size = 2
        receives_slices = False

        def __init__(self) -> None:
            self.shapes: dict[str, tuple[int, ...]] = {}

        def load_weights(self, named_tensors):
            self.shapes.update({name: tuple(t.shape) for name, t in named_tensors})
            return len(self.shapes)

    src, taker = Tied(), FullTaker()
    stats = sync_weights(src, taker)
    assert taker.shapes == {
        name: tuple(p.shape) for name, p in src.state_dict().items() if name != "head.weight"
    }
    assert stats.received_bytes is None  # no slicing took place
