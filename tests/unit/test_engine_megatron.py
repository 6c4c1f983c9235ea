"""MegatronEngine in one process (a 1-rank gloo group) and its HF <-> Megatron conversion."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.tiny_models import P, R, make_padded_batch, tiny_qwen2, tiny_qwen2_config

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from verity.engines.megatron import MegatronEngine, MegatronOptions  # noqa: E402
from verity.engines.megatron.convert import (  # noqa: E402
    ParamLayout,
    full_from_locals,
    hf_state_dict,
    local_from_full,
)
from verity.engines.megatron.model import padded_vocab_size, qwen2_shape  # noqa: E402


@pytest.fixture(scope="module")
def group():
    """A 1-rank gloo process group (the engine needs one), torn down with Megatron's groups."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def full_weights(engine) -> dict[str, torch.Tensor]:
    return {n: t for bucket in engine.iter_full_weights(1 << 20) for n, t in bucket}


@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_megatron_to_hf_is_exact(group, tied):
    hf = tiny_qwen2(tie_word_embeddings=tied)
    engine = MegatronEngine(hf, None)
    got = full_weights(engine)
    want = hf_state_dict(hf)
    assert set(got) == set(want) and ("lm_head.weight" in got) == (not tied)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_fused_qkv_is_grouped_per_kv_head(group):
    """Megatron's linear_qkv rows for KV group g: its query heads, then k_g, then v_g."""
    hf = tiny_qwen2()
    engine = MegatronEngine(hf, None)
    qkv = dict(engine.model.named_parameters())["decoder.layers.1.self_attention.linear_qkv.weight"]
    attn = hf.model.layers[1].self_attn
    d, qpg = 16, 2  # head_dim 64/4, 4 query heads over 2 KV heads
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    expected = torch.cat(
        [
            torch.cat([q[g * qpg * d : (g + 1) * qpg * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]])
            for g in range(2)
        ]
    )
    assert torch.equal(qkv.detach(), expected)
    fc1 = dict(engine.model.named_parameters())["decoder.layers.0.mlp.linear_fc1.weight"]
    mlp = hf.model.layers[0].mlp
    assert torch.equal(fc1.detach(), torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_pieces_round_trip(tp):
    """Cutting full HF tensors for each TP rank and joining the ranks' tensors gives them back exactly."""
    config = tiny_qwen2_config()
    config.vocab_size, config.num_attention_heads, config.num_key_value_heads = 101, 8, 4
    config.head_dim = 8
    shape = qwen2_shape(config)
    g = torch.Generator().manual_seed(0)
    h, d = shape.hidden_size, shape.head_dim
    assert d == 8
    full = {
        "q.w": torch.randn(8 * d, h, generator=g),
        "k.w": torch.randn(4 * d, h, generator=g),
        "v.w": torch.randn(4 * d, h, generator=g),
        "q.b": torch.randn(8 * d, generator=g),
        "k.b": torch.randn(4 * d, generator=g),
        "v.b": torch.randn(4 * d, generator=g),
        "gate": torch.randn(128, h, generator=g),
        "up": torch.randn(128, h, generator=g),
        "down": torch.randn(h, 128, generator=g),
        "embed": torch.randn(101, h, generator=g),
        "norm": torch.randn(h, generator=g),
    }
    vocab_rows = padded_vocab_size(101, tp) // tp
    cases = [
        (ParamLayout("qkv_w", "qkv", ("q.w", "k.w", "v.w")), (16 * d // tp, h)),
        (ParamLayout("qkv_b", "qkv", ("q.b", "k.b", "v.b")), (16 * d // tp,)),
        (ParamLayout("fc1", "fc1", ("gate", "up")), (256 // tp, h)),
        (ParamLayout("fc2", "row", ("down",)), (h, 128 // tp)),
        (ParamLayout("emb", "vocab", ("embed",)), (vocab_rows, h)),
        (ParamLayout("norm", "replicated", ("norm",)), (h,)),
    ]
    for layout, local_shape in cases:
        locals_ = [local_from_full(layout, full, shape, tp, r, local_shape) for r in range(tp)]
        assert all(tuple(t.shape) == local_shape for t in locals_), layout.name
        back = full_from_locals(layout, locals_, shape)
        for name in layout.hf_names:
            assert torch.equal(back[name], full[name]), (layout.name, name, tp)
    padding = padded_vocab_size(101, tp) - 101
    if padding:
        last = local_from_full(cases[4][0], full, shape, tp, tp - 1, (vocab_rows, h))
        assert torch.equal(last[-padding:], torch.zeros(padding, h))


@pytest.mark.parametrize("tied", [False, True])
def test_logits_and_logprobs_equal_hf(group, tied):
    from verity.engines import FSDP2Engine
    from verity.engines.megatron.model import stage_forward

    hf = tiny_qwen2(tie_word_embeddings=tied)
    engine = MegatronEngine(hf, None)
    batch = make_padded_batch()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        want = hf(**inputs).logits
        got = stage_forward(engine.model, inputs, None, engine.inv_freq).transpose(0, 1)
    real = batch["attention_mask"].bool()
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)
    lp, ent = engine.compute_logprobs(batch, 3, temperature=0.7)
    lp_ref, ent_ref = FSDP2Engine(hf, None).compute_logprobs(batch, 3, temperature=0.7)
    mask = batch["response_mask"].bool()
    assert lp.shape == (7, R) and lp.dtype == torch.float32
    torch.testing.assert_close(lp[mask], lp_ref[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[mask], ent_ref[mask], rtol=0, atol=1e-5)
    assert P > 0


def test_inference_only_engine_refuses_to_train(group):
    from verity.engines import EngineBuildContext, OptimConfig, build_training_engine

    ctx = EngineBuildContext(
        role="reference", load_model=tiny_qwen2, model_path="unused", device=torch.device("cpu")
    )
    engine = build_training_engine("megatron", ctx)
    assert (
        isinstance(engine, MegatronEngine) and engine.name == "megatron" and engine.supports_adapters is False
    )
    with pytest.raises(RuntimeError, match="inference only"):
        engine.train_step(make_padded_batch(), lambda *a: (torch.zeros(()), {}), 2)
    assert set(engine.state_dict_for_checkpoint()) == {"model", "global_step"}
    trained = MegatronEngine(tiny_qwen2(), OptimConfig(lr=1e-3))
    assert set(trained.state_dict_for_checkpoint()) == {"model", "optimizer", "lr_scheduler", "global_step"}


def test_bad_configs_are_refused_before_compute(group):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        MegatronOptions(tensor_parallel_size=0).validate()
    with pytest.raises(ValueError, match="not a multiple of 2"):
        MegatronEngine(tiny_qwen2(), None, MegatronOptions(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="sliding-window"):
        qwen2_shape(tiny_qwen2_config(use_sliding_window=True, sliding_window=4))
    with pytest.raises(ValueError, match="only the default rotary"):
        qwen2_shape(
            tiny_qwen2_config(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
        )
    from transformers import LlamaConfig

    with pytest.raises(ValueError, match="model_type"):
        qwen2_shape(LlamaConfig())


@pytest.mark.parametrize("tied", [False, True])
def test_a_checkpoint_folder_is_read_tensor_by_tensor_into_the_stage(group, tied, tmp_path):
    from verity.engines.model_source import ModelSource

    hf = tiny_qwen2(tie_word_embeddings=tied)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    engine = MegatronEngine(ModelSource(str(tmp_path)), None)
    assert engine.streamed
    got, want = full_weights(engine), hf_state_dict(hf)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_a_checkpoint_of_another_size_is_refused_naming_the_tensor(group, tmp_path):
    import json

    from verity.engines.model_source import ModelSource
    from verity.engines.safetensors_files import CheckpointError

    tiny_qwen2().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\]"):
        MegatronEngine(ModelSource(str(tmp_path)), None)
