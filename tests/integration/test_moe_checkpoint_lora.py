"""The tiny Qwen3-MoE: checkpoint save and restore, HF export round trip, LoRA adapters (what they adapt)."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_padded_batch
from verity.checkpoint.export import export_hf
from verity.checkpoint.manager import CheckpointManager
from verity.checkpoint.sharded import load_engine, save_engine
from verity.checkpoint.state import TrainerState
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.moe_router import RouterSettings

ROUTER = RouterSettings(aux_loss_coef=0.01, z_loss_coef=0.001)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_moe import build_tiny_moe_for

    tokenizer = CharTokenizer()
    model = build_tiny_moe_for(tokenizer, family="qwen3_moe", hidden=32, expert_intermediate=32, seed=0)
    folder = tmp_path_factory.mktemp("moe")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class OneRankGroup:
    def __init__(self, engine: FSDP2Engine) -> None:
        self.engine = engine

    def save_checkpoint(self, path: str) -> list[dict]:
        return [save_engine(path, self.engine, rank=0, world_size=1)]

    def load_checkpoint(self, path: str) -> list[dict]:
        return [load_engine(path, self.engine, rank=0, world_size=1)]


def loss_fn(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def state_at(step: int) -> TrainerState:
    return TrainerState(
        step=step,
        total_steps=10,
        dataloader={},
        kl_coef=None,
        run_id=None,
        tracking_uri=None,
        config_hash="h",
        config={},
    )


def new_engine(model_dir) -> FSDP2Engine:
    from verity.engines.hf_loading import load_causal_lm

    return FSDP2Engine(load_causal_lm(model_dir), OptimConfig(lr=1e-2), router=ROUTER)


def test_restore_continues_training_exactly_and_the_export_scores_like_the_engine(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    engine = new_engine(model_dir)
    for seed in (1, 2):
        engine.train_step(make_padded_batch(seed=seed), loss_fn, 4)
    manager = CheckpointManager(tmp_path / "ckpt", 2, {"actor": OneRankGroup(engine)}, str(model_dir))
    path = manager.save(2, state_at(2))
    fresh = new_engine(model_dir)
    CheckpointManager(tmp_path / "ckpt", 2, {"actor": OneRankGroup(fresh)}).restore(path)
    batch = make_padded_batch(seed=3)
    a, b = engine.train_step(batch, loss_fn, 4), fresh.train_step(batch, loss_fn, 4)
    assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert a["moe/aux_loss"] == b["moe/aux_loss"]

    manager.save(3, state_at(3))
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(exported.state_dict()[name], tensor), name
    want, _ = engine.compute_logprobs(batch, micro_batch_size=4)
    got, _ = FSDP2Engine(exported).compute_logprobs(batch, micro_batch_size=4)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_lora_adapts_the_attention_projections_and_leaves_router_and_experts_frozen(model_dir):
    pytest.importorskip("peft")
    from verity.engines.fsdp2_lora import FSDP2LoRAEngine
    from verity.engines.hf_loading import load_causal_lm
    from verity.engines.lora import LoRAConfig

    engine = FSDP2LoRAEngine(
        load_causal_lm(model_dir), OptimConfig(lr=1e-2), lora=LoRAConfig(rank=4), seed=0, router=ROUTER
    )
    adapted = {
        n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in engine.model.named_parameters() if ".lora_A" in n
    }
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    trainable = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters() if "mlp" in n}
    metrics = engine.train_step(make_padded_batch(seed=1), loss_fn, 4)
    assert metrics["moe/aux_loss"] > 0
    for name, param in engine.model.named_parameters():
        if name in before:
            assert torch.equal(param, before[name]), name  # routers and experts stay the base's
