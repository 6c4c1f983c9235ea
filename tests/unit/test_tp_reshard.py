"""Weight sync from FSDP2 shards straight to tensor-parallel slices (:mod:`verity.resharding.tp_reshard`).

In one process: ``tp_slice_bounds`` against ``torch.chunk``, ``slice_for_tp`` agreeing with it,
the local fallback ``slice_full_buckets``. On 4 gloo processes (FSDP2 over all 4, and over two
2-rank sub-meshes): tiny Qwen2 models (tied, untied, and uneven: vocabulary 75 and MLP width 90;
``fully_shard`` per decoder layer then the root, as ``FSDP2Engine`` does) and a module mixing
shards with plain tensors. Every yielded slice must equal its ``full_tensor()`` narrowed by
``tp_slice_bounds``, in the full gather's buckets and order, with one all-to-all per bucket and
each rank receiving its slices' bytes (about ``1 / TP`` of the model) where the full gather
receives the whole model (both counted by wrapping the collectives).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from helpers.spawn import spawn_and_load
from helpers.tiny_models import tiny_qwen2
from torch import nn
from verity.resharding import (
    iter_full_state_dict_buckets,
    iter_tp_slice_buckets,
    named_weights,
    slice_for_tp,
    slice_full_buckets,
    tp_slice_bounds,
)

Q = "model.layers.0.self_attn.q_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"
SMALL_BUCKET = 6 * 1024  # over 20 buckets for the ~0.3 MB tiny Qwen2 models


def test_tp_slice_bounds_follow_torch_chunk():
    for size in range(0, 11):
        full = torch.arange(size)
        for tp in range(1, 5):
            chunks = torch.chunk(full, tp) if size else ()
            for rank in range(tp):
                bounds = tp_slice_bounds(Q, (size, 3), rank, tp)
                if tp == 1:
                    assert bounds is None
                    continue
                dim, start, length = bounds
                want = chunks[rank].tolist() if rank < len(chunks) else []
                assert dim == 0 and full[start : start + length].tolist() == want
    assert tp_slice_bounds(DOWN, (4, 6), 2, 3) == (1, 4, 2)
    assert tp_slice_bounds(DOWN, (4, 5), 3, 4) == (1, 5, 0)  # chunks of 2: the last rank gets none
    assert tp_slice_bounds("model.norm.weight", (6,), 1, 2) is None
    assert tp_slice_bounds("model.layers.0.self_attn.o_proj.bias", (6,), 1, 2) is None
    with pytest.raises(ValueError, match="tp_rank"):
        tp_slice_bounds(Q, (4, 4), 2, 2)
    with pytest.raises(ValueError, match="cannot split dim 1"):
        tp_slice_bounds(DOWN, (4,), 0, 2)


def test_slice_for_tp_agrees_with_the_bounds():
    w = torch.arange(48.0).reshape(6, 8)
    for name in (Q, DOWN, "model.norm.weight"):
        for rank in range(2):
            bounds = tp_slice_bounds(name, tuple(w.shape), rank, 2)
            want = w if bounds is None else w.narrow(*bounds)
            assert torch.equal(slice_for_tp(name, w, rank, 2), want)


def _qwen_named_module() -> nn.Module:
    """Qwen2's weight names on small odd sizes (vocabulary 7, heads 5, MLP 9), without transformers."""
    torch.manual_seed(0)
    m = nn.Module()
    m.model = nn.Module()
    m.model.embed_tokens = nn.Embedding(7, 6)
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.q_proj = nn.Linear(6, 5)
    layer.self_attn.o_proj = nn.Linear(5, 6)  # its bias replicated
    layer.mlp = nn.Module()
    layer.mlp.up_proj = nn.Linear(6, 9, bias=False)
    layer.mlp.down_proj = nn.Linear(9, 6, bias=False)
    layer.input_layernorm = nn.LayerNorm(6)
    m.model.layers = nn.ModuleList([layer])
    m.lm_head = nn.Linear(6, 7, bias=False)
    return m


def test_slice_full_buckets_cuts_contiguous_copies():
    model = _qwen_named_module()
    full = {n: t.detach().clone() for n, t in model.named_parameters()}
    for tp in (1, 2, 3, 4):
        parts: dict[str, list[torch.Tensor]] = {}
        names = []
        for tp_rank in range(tp):
            incoming = list(iter_full_state_dict_buckets(model, 64))
            names.append([[n for n, _ in b] for b in incoming])
            for bucket in slice_full_buckets(iter(incoming), tp_rank, tp):
                for name, part in bucket:
                    bounds = tp_slice_bounds(name, tuple(full[name].shape), tp_rank, tp)
                    want = full[name] if bounds is None else full[name].narrow(*bounds)
                    assert torch.equal(part, want) and part.is_contiguous()
                    if bounds is not None:  # a copy: the full tensor can be freed
                        assert part.untyped_storage().data_ptr() != model.get_parameter(name).data_ptr()
                    parts.setdefault(name, []).append(part)
            assert all(b == [] for b in incoming), "each incoming bucket is emptied once sliced"
        assert names == [names[0]] * tp
        for name, pieces in parts.items():  # the TP ranks' slices put together give the full tensor
            bounds = tp_slice_bounds(name, tuple(full[name].shape), 0, tp)
            whole = pieces[0] if bounds is None else torch.cat(pieces, bounds[0])
            assert torch.equal(whole, full[name])
    with pytest.raises(ValueError, match="tp_rank"):
        next(slice_full_buckets([], 2, 2))


def test_unsharded_module_without_a_process_group():
    model = _qwen_named_module()
    stats: dict[str, int] = {}
    got = [[(n, t.clone()) for n, t in b] for b in iter_tp_slice_buckets(model, 1, 64, stats=stats)]
    want = list(iter_full_state_dict_buckets(model, 64))
    assert [[n for n, _ in b] for b in got] == [[n for n, _ in b] for b in want]
    assert all(
        torch.equal(a, b)
        for bg, bw in zip(got, want, strict=True)
        for (_, a), (_, b) in zip(bg, bw, strict=True)
    )
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    assert stats == {"received_bytes": 0, "sliced_bytes": full_bytes}
    with pytest.raises(ValueError, match="must divide"):
        next(iter_tp_slice_buckets(model, 2, 64))


# ---------------------------------------------------------------- multi-process


class _Counted:
    """Wraps ``dist.all_to_all_single`` and the all-gather the full gather uses, counting calls and output bytes."""

    def __init__(self) -> None:
        self.calls = {"a2a": 0, "gather": 0}
        self.bytes = {"a2a": 0, "gather": 0}

    def __enter__(self):
        self.saved = {
            n: getattr(dist, n, None)
            for n in ("all_to_all_single", "all_gather_single", "all_gather_into_tensor")
        }
        for attr, key in (
            ("all_to_all_single", "a2a"),
            ("all_gather_single", "gather"),
            ("all_gather_into_tensor", "gather"),
        ):
            if self.saved[attr] is not None:
                setattr(dist, attr, self._wrap(self.saved[attr], key))
        return self

    def _wrap(self, fn, key):
        def wrapped(output, *args, **kwargs):
            self.calls[key] += 1
            self.bytes[key] += output.numel() * output.element_size()
            return fn(output, *args, **kwargs)

        return wrapped

    def __exit__(self, *exc) -> None:
        for attr, fn in self.saved.items():
            if fn is not None:
                setattr(dist, attr, fn)


def _uneven_qwen2():
    """Vocabulary 75 and MLP width 90: neither divides over 4 ranks (FSDP2 rows 19/19/19/18 and 23/23/23/21)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    config = Qwen2Config(
        vocab_size=75,
        hidden_size=64,
        intermediate_size=90,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config)


def _mixed_module():
    """FSDP2 shards of 1 row and of 3 rows, a row-parallel bias, an ignored (plain) parameter, an int buffer."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(3)
    m = nn.Module()
    m.embed_tokens = nn.Embedding(3, 5)  # 3 rows: on 4 TP ranks the last gets none
    m.gate_proj = nn.Linear(5, 1)  # 1 row over the ranks
    m.o_proj = nn.Linear(6, 5)  # split on dim 1; its bias replicated
    m.extra = nn.Module()
    m.extra.q_proj = nn.Linear(5, 6)  # left out of FSDP2: sliced locally
    m.register_buffer("steps", torch.arange(4))
    fully_shard(m, ignored_params=set(m.extra.q_proj.parameters()))
    return m


def _check(
    model, tp: int, bucket_bytes: int, dtype, full: dict[str, torch.Tensor], rank: int, cache: dict
) -> dict:
    """Slices vs the full tensors narrowed, buckets vs the full gather's; the bytes each moved."""
    stats: dict[str, int] = {}
    tp_rank = rank % tp
    names, mismatches, sliced = [], [], 0
    with _Counted() as counted:
        for bucket in iter_tp_slice_buckets(model, tp, bucket_bytes, dtype=dtype, stats=stats):
            names.append([n for n, _ in bucket])
            for name, part in bucket:
                bounds = tp_slice_bounds(name, tuple(full[name].shape), tp_rank, tp)
                want = full[name] if bounds is None else full[name].narrow(*bounds)
                if dtype is not None and want.is_floating_point():
                    want = want.to(dtype)
                if not (torch.equal(part, want) and part.dtype == want.dtype and part.is_contiguous()):
                    mismatches.append(name)
                sliced += part.numel() * part.element_size()
            del bucket
    if (bucket_bytes, dtype) not in cache:  # the full gather of the same buckets, for comparison
        with _Counted() as gather:
            cache[bucket_bytes, dtype] = (
                [[n for n, _ in b] for b in iter_full_state_dict_buckets(model, bucket_bytes, dtype=dtype)],
                gather,
            )
    full_names, gather = cache[bucket_bytes, dtype]
    element = torch.empty((), dtype=dtype).element_size() if dtype is not None else None
    full_bytes = sum(
        t.numel() * (element if element and t.is_floating_point() else t.element_size())
        for t in full.values()
    )
    return {
        "mismatches": mismatches,
        "same_buckets": names == full_names,
        "buckets": len(names),
        "stats": stats,
        "sliced": sliced,
        "tp_calls": counted.calls,
        "tp_bytes": counted.bytes,
        "gather_calls": gather.calls,
        "gather_bytes": gather.bytes,
        "full_bytes": full_bytes,
    }


WORLD = 4


def _shard(model, mesh):
    """As FSDP2Engine shards: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank: int, port: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        # W=4 on the whole group; W=2 on two sub-meshes, ranks {0, 1} and {2, 3} (one process spawn for both)
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = DeviceMesh.from_group(pairs[rank // 2], "cpu")
        models = {
            (4, "tied"): _shard(tiny_qwen2(seed=0), None),
            (4, "untied"): _shard(tiny_qwen2(seed=1, tie_word_embeddings=False), None),
            (4, "uneven"): _shard(_uneven_qwen2(), None),
            (4, "mixed"): _mixed_module(),
            (2, "tied"): _shard(tiny_qwen2(seed=0), pair),
            (2, "uneven"): _shard(_uneven_qwen2(), pair),
        }
        out: dict = {"types": {key: {type(p).__name__ for p in m.parameters()} for key, m in models.items()}}
        for (world, key), model in models.items():
            full = {  # each weight's own full_tensor(), independently of the code under test
                name: t.full_tensor().detach().clone() if hasattr(t, "full_tensor") else t.detach().clone()
                for name, t in named_weights(model)
            }
            cache: dict = {}
            for tp in [t for t in (1, 2, 4) if world % t == 0]:
                for dtype in (None, torch.bfloat16):
                    out[world, key, tp, dtype, SMALL_BUCKET] = _check(
                        model, tp, SMALL_BUCKET, dtype, full, rank % world, cache
                    )
                if key == "uneven":  # each tensor alone (exchanged straight into its slice); one bucket
                    for bucket_bytes in (1, 1 << 30):
                        out[world, key, tp, None, bucket_bytes] = _check(
                            model, tp, bucket_bytes, None, full, rank % world, cache
                        )
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_to_tp_slices(tmp_path):
    ranks = spawn_and_load(_worker, WORLD, str(tmp_path))
    lines = []
    for rank, out in enumerate(ranks):
        types = out.pop("types")
        assert types[4, "mixed"] == {"DTensor", "Parameter"}
        assert all(t == {"DTensor"} for k, t in types.items() if k[1] != "mixed"), types
        for (world, key, tp, dtype, bucket_bytes), res in out.items():
            where = f"rank {rank} W={world} {key} TP={tp} dtype={dtype} bucket={bucket_bytes}"
            assert res["mismatches"] == [], where
            assert res["same_buckets"], where
            stats, full_bytes, received = res["stats"], res["full_bytes"], res["stats"]["received_bytes"]
            assert stats["sliced_bytes"] == res["sliced"], where
            # one all-to-all per bucket (one process group, one dtype) and no all-gather
            assert res["tp_calls"] == {"a2a": res["buckets"], "gather": 0}, where
            assert received == res["tp_bytes"]["a2a"], where
            assert res["gather_calls"] == {"a2a": 0, "gather": res["buckets"]}, where
            gathered = res["gather_bytes"]["gather"]
            if key == "mixed":  # its ignored parameter and buffer are sliced locally, not received
                assert received < stats["sliced_bytes"] <= full_bytes, where
                continue
            # a rank receives exactly its slices' bytes (and one spare element per source and
            # exchange): ~1/TP of the model, where the full gather gets it all
            spare = res["buckets"] * world * (2 if dtype == torch.bfloat16 else 4)
            assert received - spare == stats["sliced_bytes"], where
            assert gathered >= full_bytes, where
            assert received - spare <= {1: 1.0, 2: 0.6, 4: 0.35}[tp] * full_bytes, where
            if tp == 1:
                assert received - spare == full_bytes, where
            if bucket_bytes == SMALL_BUCKET and dtype is None and rank in (0, 3):
                lines.append(
                    f"rank {rank} W={world} {key:6} TP={tp}: received {received / 1e3:6.1f} kB, "
                    f"full gather {gathered / 1e3:6.1f} kB, model {full_bytes / 1e3:6.1f} kB "
                    f"(ratio {received / full_bytes:.3f}), {res['buckets']} buckets"
                )
    print("\n" + "\n".join(lines))
