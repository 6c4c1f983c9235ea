"""rollout.engine=vllm built by name through the rollout registry (its own module: one in-process engine at a time)."""

from __future__ import annotations

import torch
from helpers.tiny_models import save_char_qwen2
from helpers.vllm_required import require_vllm
from verity.rollout import (
    HFRollout,
    RolloutBuildContext,
    SamplingParams,
    build_rollout_engine,
    encode_prompts,
)
from verity.rollout.options import VLLMOptions

require_vllm()


def test_built_by_name_through_the_rollout_registry(tmp_path):
    model, tokenizer = save_char_qwen2(tmp_path / "model", seed=0)
    ctx = RolloutBuildContext(
        model_path=str(tmp_path / "model"),
        tokenizer=tokenizer,
        device=torch.device("cpu"),
        dtype=torch.float32,
        seed=3,
        max_model_len=64,
        options=VLLMOptions(kv_cache_bytes=16 * 1024**2, cache_dir=str(tmp_path / "cache")),
    )
    greedy = SamplingParams(do_sample=False, max_new_tokens=10)
    encoded = encode_prompts(tokenizer, ["12+34=", "7-2=", "ab"])
    batch = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    engine = build_rollout_engine("vllm", ctx)
    try:
        assert engine.name == "vllm" and engine.max_model_len == 64 and engine.dtype == "float32"
        expected = HFRollout(model, tokenizer).generate(batch, greedy)["responses"]
        assert torch.equal(engine.generate(batch, greedy)["responses"], expected)
    finally:
        engine.close()
