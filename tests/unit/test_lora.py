"""LoRA in one process: config checks, merged weights, adapter-only checkpoints, export (merged and peft folder)."""

from __future__ import annotations

import json

import pytest
import torch
from verity.checkpoint.export import export_hf, read_model_state
from verity.checkpoint.manager import CheckpointManager
from verity.checkpoint.sharded import load_engine, save_engine
from verity.checkpoint.state import TrainerState
from verity.config import ConfigError, load_config
from verity.engines import FSDP2Engine, OptimConfig
from verity.engines.fsdp2_lora import FSDP2LoRAEngine
from verity.engines.hf_loading import load_causal_lm
from verity.engines.lora import LoRAConfig, check_lora_targets
from verity.resharding.lora_merge import merge_lora_weight

P, R = 4, 5
LORA = LoRAConfig(rank=4, alpha=8.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_model import build_tiny_qwen2_for

    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    model = build_tiny_qwen2_for(tokenizer, hidden=32, layers=2, heads=4, kv_heads=2, intermediate=64)
    folder = tmp_path_factory.mktemp("model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_batch(vocab: int, rows: int = 6, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(4, vocab, (rows, P), generator=g)
    responses = torch.randint(4, vocab, (rows, R), generator=g)
    attention_mask = torch.ones(rows, P + R, dtype=torch.long)
    return {
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": attention_mask.cumsum(-1) - 1,
        "responses": responses,
        "response_mask": torch.ones(rows, R),
        "advantages": torch.randn(rows, R, generator=g),
    }


def loss_fn(mb, logprobs, entropy, agg):
    return -(logprobs * mb["advantages"] * mb["response_mask"]).sum() / agg.global_tokens, {}


def lora_engine(model_dir, lora: LoRAConfig = LORA) -> FSDP2LoRAEngine:
    return FSDP2LoRAEngine(
        load_causal_lm(model_dir),
        OptimConfig(lr=1e-2, warmup_steps=3),
        lora=lora,
        base_model_path=str(model_dir),
    )


def trained(model_dir, steps: int = 2) -> FSDP2LoRAEngine:
    engine = lora_engine(model_dir)
    vocab = engine.model.config.vocab_size
    for seed in range(1, steps + 1):
        engine.train_step(make_batch(vocab, seed=seed), loss_fn, 3)
    return engine


class OneRankGroup:
    def __init__(self, engine) -> None:
        self.engine = engine

    def save_checkpoint(self, path: str) -> list[dict]:
        return [save_engine(path, self.engine, rank=0, world_size=1)]

    def load_checkpoint(self, path: str) -> list[dict]:
        return [load_engine(path, self.engine, rank=0, world_size=1)]


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


# ------------------------------------------------------------------- config


def test_lora_is_off_by_default_and_configured_under_actor_lora() -> None:
    assert not load_config([]).actor.lora.enabled
    cfg = load_config(
        ["actor.lora.rank=8", "actor.lora.alpha=32", "actor.lora.target_modules=[q_proj,v_proj]"]
    )
    assert cfg.actor.lora.enabled and cfg.actor.lora.scale == 4.0
    assert cfg.actor.lora.target_modules == ["q_proj", "v_proj"]


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["actor.lora.rank=-1"], "actor.lora.rank must be an int >= 0"),
        (["actor.lora.rank=8", "actor.lora.alpha=0"], "actor.lora.alpha must be a number > 0"),
        (["actor.lora.rank=8", "actor.lora.dropout=1.0"], r"actor.lora.dropout must be in \[0, 1\)"),
        (
            ["actor.lora.rank=8", "actor.lora.target_modules=[]"],
            "actor.lora.target_modules must be a non-empty",
        ),
        (
            ["actor.lora.rank=8", "actor.engine=megatron"],
            "actor.lora.rank=8: the 'megatron' training engine .* does not train LoRA adapters",
        ),
    ],
)
def test_bad_lora_settings_fail_before_compute_naming_the_key(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(overrides)


def test_fsdp2_trains_adapters_and_megatron_refuses_them_even_when_built_directly(model_dir) -> None:
    from verity.engines import EngineBuildContext, build_training_engine
    from verity.engines.registry import TRAINING_ENGINES

    assert TRAINING_ENGINES.get("fsdp2").supports_adapters
    assert not TRAINING_ENGINES.get("megatron").supports_adapters
    ctx = EngineBuildContext(
        role="actor",
        load_model=lambda: load_causal_lm(model_dir),
        model_path=str(model_dir),
        device=torch.device("cpu"),
        optim=OptimConfig(),
        lora=LORA,
    )
    with pytest.raises(ValueError, match="'megatron' training engine does not train LoRA adapters"):
        build_training_engine("megatron", ctx)
    assert isinstance(build_training_engine("fsdp2", ctx), FSDP2LoRAEngine)


def test_target_modules_are_checked_against_the_model(model_dir) -> None:
    every = check_lora_targets(str(model_dir), LORA)
    assert (
        len(every) == 2 * 7 and "lm_head" not in every
    )  # all linear layers of the decoder, never the output
    some = check_lora_targets(
        str(model_dir),
        LoRAConfig(
            rank=2, target_modules=["q_proj", "v_proj"], exclude_modules=["model.layers.0.self_attn.v_proj"]
        ),
    )
    assert sorted(some) == sorted(
        [
            "model.layers.0.self_attn.q_proj",
            "model.layers.1.self_attn.q_proj",
            "model.layers.1.self_attn.v_proj",
        ]
    )
    with pytest.raises(ValueError, match="nope_proj"):
        check_lora_targets(str(model_dir), LoRAConfig(rank=2, target_modules=["nope_proj"]))


# --------------------------------------------------------------- the engine


def test_merged_weights_are_peft_merge_bit_for_bit_under_plain_names(model_dir) -> None:
    import copy

    engine = trained(model_dir)
    merged = {name: t for bucket in engine.iter_full_weights(4096) for name, t in bucket}
    plain = dict(load_causal_lm(model_dir).named_parameters())
    assert set(merged) == set(plain)  # the base model's names, tied weight once
    reference = copy.deepcopy(engine.peft_model).merge_and_unload().state_dict()
    for name, tensor in merged.items():
        assert torch.equal(tensor, reference[name]), name
    assert any(not torch.equal(merged[n], plain[n]) for n in merged)

    w, a, b = torch.randn(6, 5), torch.randn(3, 5), torch.randn(6, 3)
    assert torch.equal(merge_lora_weight(w, a, b, 0.5), w + (b @ a) * 0.5)
    with pytest.raises(ValueError, match="do not fit"):
        merge_lora_weight(w, b, a, 0.5)


def test_optimizer_state_is_the_adapters_only(model_dir) -> None:
    engine = trained(model_dir, steps=1)
    adapters = engine.trainable_parameters()
    total = sum(p.numel() for p in engine.model.parameters())
    assert 0 < adapters < total
    # AdamW: two float32 moments per adapter parameter plus one step count per tensor
    step_bytes = sum(s["step"].numel() * s["step"].element_size() for s in engine.optimizer.state.values())
    assert engine.optimizer_state_bytes() == 2 * 4 * adapters + step_bytes


# -------------------------------------------------------------- checkpoints


def test_checkpoint_holds_the_adapters_only_and_resumes_exactly(model_dir, tmp_path) -> None:
    engine = trained(model_dir)
    manager = CheckpointManager(tmp_path / "ckpt", 2, {"actor": OneRankGroup(engine)}, str(model_dir))
    path = manager.save(2, state_at(2))
    saved = read_model_state(path / "actor")
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert set(saved) == trainable  # no frozen base weight is written
    meta = json.loads((path / "actor" / "meta.json").read_text())["adapter"]
    assert meta["rank"] == 4 and meta["alpha"] == 8.0 and meta["base_model"] == str(model_dir)

    fresh = lora_engine(model_dir)
    CheckpointManager(tmp_path / "ckpt", 2, {"actor": OneRankGroup(fresh)}).restore(path)
    assert fresh.global_step == 2
    batch = make_batch(engine.model.config.vocab_size, seed=9)
    a, b = engine.train_step(batch, loss_fn, 3), fresh.train_step(batch, loss_fn, 3)
    assert a["lr"] == b["lr"] and a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    for (name, pa), (_, pb) in zip(
        engine.model.named_parameters(), fresh.model.named_parameters(), strict=True
    ):
        assert torch.equal(pa, pb), name


def test_a_checkpoint_loads_only_into_the_same_kind_of_engine(model_dir, tmp_path) -> None:
    lora = trained(model_dir, steps=1)
    save_engine(tmp_path / "lora", lora, rank=0, world_size=1)
    full = FSDP2Engine(load_causal_lm(model_dir), OptimConfig())
    with pytest.raises(ValueError, match="holds LoRA adapters but this engine trains a full model"):
        load_engine(tmp_path / "lora", full, rank=0, world_size=1)
    save_engine(tmp_path / "full", full, rank=0, world_size=1)
    with pytest.raises(ValueError, match="holds a full model but this engine trains LoRA adapters"):
        load_engine(tmp_path / "full", lora_engine(model_dir), rank=0, world_size=1)
    other = lora_engine(model_dir, LoRAConfig(rank=2, alpha=8.0))
    with pytest.raises(ValueError, match="adapters differ from this engine's .*rank: 4 -> 2"):
        load_engine(tmp_path / "lora", other, rank=0, world_size=1)


# ------------------------------------------------------------------- export


def test_export_merged_folder_and_peft_adapter_folder(model_dir, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    engine = trained(model_dir)
    manager = CheckpointManager(tmp_path / "ckpt", 1, {"actor": OneRankGroup(engine)}, str(model_dir))
    manager.save(2, state_at(2))
    merged = {name: t for bucket in engine.iter_full_weights() for name, t in bucket}

    out = export_hf(tmp_path / "ckpt", tmp_path / "merged")
    exported = AutoModelForCausalLM.from_pretrained(out).eval()
    for name, tensor in exported.named_parameters():
        assert torch.equal(tensor, merged[name]), name  # exactly the weights the rollout receives

    adapter = export_hf(tmp_path / "ckpt", tmp_path / "adapter", adapter=True)
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), adapter).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer(["12+3=", "7-9="], return_tensors="pt", padding=True)
    with torch.no_grad():
        want = exported.generate(**prompt, do_sample=False, max_new_tokens=6)
        got = loaded.generate(**prompt, do_sample=False, max_new_tokens=6)
        assert torch.equal(got, want)
        merged_back = loaded.merge_and_unload().state_dict()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(merged_back[name], tensor), name


def test_export_names_what_a_lora_export_needs(model_dir, tmp_path) -> None:
    full = FSDP2Engine(load_causal_lm(model_dir), OptimConfig())
    CheckpointManager(tmp_path / "full", 1, {"actor": OneRankGroup(full)}, str(model_dir)).save(
        0, state_at(0)
    )
    with pytest.raises(ValueError, match="trained every weight; it has no LoRA adapter"):
        export_hf(tmp_path / "full", tmp_path / "out", adapter=True)

    engine = FSDP2LoRAEngine(load_causal_lm(model_dir), OptimConfig(), lora=LORA)  # base folder not recorded
    CheckpointManager(tmp_path / "lora", 1, {"actor": OneRankGroup(engine)}, str(model_dir)).save(
        0, state_at(0)
    )
    with pytest.raises(FileNotFoundError, match="--base-model"):
        export_hf(tmp_path / "lora", tmp_path / "out")
    out = export_hf(tmp_path / "lora", tmp_path / "out", base_model=model_dir)
    assert (out / "config.json").is_file()
