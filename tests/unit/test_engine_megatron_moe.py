"""MegatronEngine on a tiny Qwen3-MoE in one process (EP=1): conversion, log-probs, what it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers.tiny_models import make_padded_batch, tiny_moe, tiny_moe_config

pytest.importorskip("megatron.core", reason="the megatron extra is not installed")

from verity.engines.megatron import MegatronEngine, MegatronOptions  # noqa: E402
from verity.engines.megatron.convert import hf_state_dict  # noqa: E402
from verity.engines.megatron.model import qwen2_shape  # noqa: E402


@pytest.fixture(scope="module")
def group():
    """A 1-rank gloo process group (the engine needs one), torn down with Megatron's groups."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def full_weights(engine) -> dict[str, torch.Tensor]:
    return {n: t for bucket in engine.iter_full_weights(1 << 16) for n, t in bucket}


def test_hf_to_megatron_to_hf_is_exact(group):
    hf = tiny_moe()
    engine = MegatronEngine(hf, None)
    params = dict(engine.model.named_parameters())
    experts = hf.model.layers[1].mlp.experts
    # local expert j of layer 1 is HF expert j: gate_up_proj[j] is linear_fc1 as is, down_proj[j] linear_fc2
    for j in (0, 7):
        fc1 = params[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc1.weight"]
        fc2 = params[f"decoder.layers.1.mlp.experts.local_experts.{j}.linear_fc2.weight"]
        assert torch.equal(fc1.detach(), experts.gate_up_proj[j]) and torch.equal(
            fc2.detach(), experts.down_proj[j]
        )
    assert torch.equal(
        params["decoder.layers.0.mlp.router.weight"].detach(), hf.model.layers[0].mlp.gate.weight
    )
    got, want = full_weights(engine), hf_state_dict(hf)
    assert set(got) == set(want) and "model.layers.0.self_attn.q_norm.weight" in got
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logprobs_equal_hf(group, norm_topk_prob):
    from verity.engines import FSDP2Engine

    hf = tiny_moe(norm_topk_prob=norm_topk_prob)
    engine = MegatronEngine(hf, None)
    batch = make_padded_batch()
    lp, ent = engine.compute_logprobs(batch, 3, temperature=0.7)
    lp_ref, ent_ref = FSDP2Engine(hf, None).compute_logprobs(batch, 3, temperature=0.7)
    mask = batch["response_mask"].bool()
    assert lp_ref[mask].std() > 0.01
    torch.testing.assert_close(lp[mask], lp_ref[mask], rtol=0, atol=1e-5)
    torch.testing.assert_close(ent[mask], ent_ref[mask], rtol=0, atol=1e-5)


def test_a_checkpoint_folder_is_read_into_the_experts(group, tmp_path):
    from verity.engines.model_source import ModelSource

    hf = tiny_moe(seed=3)
    hf.save_pretrained(tmp_path)
    engine = MegatronEngine(ModelSource(str(tmp_path)), None)
    got, want = full_weights(engine), hf_state_dict(hf)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_bad_moe_settings_are_refused_before_compute(group):
    from transformers import Qwen2MoeConfig

    with pytest.raises(ValueError, match="does not divide the model's num_experts=8"):
        MegatronEngine(tiny_moe(), None, MegatronOptions(expert_parallel_size=3))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model, and this model is dense"):
        from helpers.tiny_models import tiny_qwen2

        MegatronEngine(tiny_qwen2(), None, MegatronOptions(expert_parallel_size=2))
    with pytest.raises(ValueError, match="sequence parallelism"):
        MegatronEngine(tiny_moe(), None, MegatronOptions(tensor_parallel_size=2))
    with pytest.raises(ValueError, match="expert_tensor_parallel_size must be null or 1"):
        MegatronOptions(expert_tensor_parallel_size=2).validate()
    with pytest.raises(ValueError, match="every layer must be MoE"):
        qwen2_shape(tiny_moe_config(mlp_only_layers=[0]))
    with pytest.raises(ValueError, match="'qwen2_moe'"):
        qwen2_shape(Qwen2MoeConfig())
    with pytest.raises(ValueError, match="must divide the data-parallel size 1"):
        MegatronOptions(expert_parallel_size=2).data_parallel_size(1)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_top_k_child_routes_as_hf(norm_topk_prob):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
    from verity.engines.megatron.moe_routing import ReplayableTopKRouter, routing_map

    config = tiny_moe_config(norm_topk_prob=norm_topk_prob)
    hf = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(hf.weight, std=0.5)
    hidden = torch.randn(40, config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, want_weights, want_experts = hf(hidden)
    child = ReplayableTopKRouter(config.num_experts, config.num_experts_per_tok, norm_topk_prob)
    _, weights, experts = child(logits)
    assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)
    probs, chosen = routing_map(logits, weights, experts)
    assert torch.equal(chosen.sum(-1), torch.full((40,), config.num_experts_per_tok))
    assert torch.equal(probs.gather(1, experts), weights) and float(probs[~chosen].abs().max()) == 0.0


def test_router_settings_are_refused_where_they_cannot_run(group):
    from helpers.tiny_models import tiny_qwen2
    from verity.engines.megatron.moe_routing import stage_router_terms
    from verity.engines.moe_router import RouterSettings

    replay = RouterSettings(routing_replay=True)
    with pytest.raises(ValueError, match="need pipeline_parallel_size=1 \\(got 2\\)"):
        stage_router_terms(torch.nn.Linear(2, 2), replay, 2)
    assert stage_router_terms(torch.nn.Linear(2, 2), RouterSettings(), 2) is None
    with pytest.raises(ValueError, match="need a mixture-of-experts model"):
        MegatronEngine(tiny_qwen2(), None, router=RouterSettings(aux_loss_coef=0.1))
    engine = MegatronEngine(tiny_moe(), None)  # an MoE model's router metrics: always
    assert engine.router_terms is not None and engine.router_terms.tap.num_layers == 2
