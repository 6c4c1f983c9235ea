"""vLLM (official ``vllm``) and SGLang rollouts on a CUDA device: greedy vs HF, weight sync, sleep/wake,
greedy requests through each engine's request scheduler vs its ``generate``.

Skipped without a GPU or without the engine's package. The model is the tiny character
Qwen2 of the CPU tests (float32, decisive logits), so HF greedy is the reference.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_models import save_char_qwen2
from verity.rollout import HFRollout, SamplingParams, encode_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(do_sample=False, max_new_tokens=10)


def _prompts(tokenizer):
    encoded = encode_prompts(tokenizer, ["12+34=", "7-2=", "hello world", "a"])
    return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}


def _hf(model, tokenizer, batch):
    return HFRollout(copy.deepcopy(model).cuda().eval(), tokenizer).generate(batch, GREEDY)["responses"].cpu()


def _check_engine(rollout, model, other, tokenizer):
    batch = _prompts(tokenizer)
    assert torch.equal(rollout.generate(batch, GREEDY)["responses"].cpu(), _hf(model, tokenizer, batch))
    rollout.load_weights((n, t.cuda()) for n, t in other.state_dict().items())
    assert torch.equal(rollout.generate(batch, GREEDY)["responses"].cpu(), _hf(other, tokenizer, batch))
    free_awake = torch.cuda.mem_get_info()[0]
    rollout.sleep()
    assert torch.cuda.mem_get_info()[0] > free_awake  # the engine gave memory back
    rollout.wake()
    assert torch.equal(rollout.generate(batch, GREEDY)["responses"].cpu(), _hf(other, tokenizer, batch))


def _check_request_scheduler(rollout, tokenizer):
    """Greedy requests through the engine's request scheduler, added at different steps, give generate's tokens."""
    from verity.rollout.requests import GenerationRequest

    batch = _prompts(tokenizer)
    out = rollout.generate(batch, GREEDY)
    expected = [
        tokens[: int(mask.sum())].tolist()
        for tokens, mask in zip(out["responses"].cpu(), out["response_mask"].cpu(), strict=True)
    ]
    contexts = [
        ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"], strict=True)
    ]
    scheduler = rollout.request_scheduler(GREEDY)
    finished, steps = {}, 0
    while scheduler.pending() or steps < 2:
        if steps < 2:  # half at the first step, half at the second
            for i in range(steps, len(contexts), 2):
                scheduler.add(GenerationRequest(i, contexts[i], GREEDY.max_new_tokens))
        finished.update({done.request_id: done for done in scheduler.step()})
        steps += 1
    assert [finished[i].token_ids for i in range(len(contexts))] == expected
    assert all(len(f.logprobs) == len(f.token_ids) for f in finished.values())


def test_vllm_on_gpu(tmp_path):
    pytest.importorskip("vllm")
    from verity.rollout.vllm_rollout import VLLMRollout

    model, tokenizer = save_char_qwen2(tmp_path / "m", seed=0)
    other, _ = save_char_qwen2(tmp_path / "o", seed=5)
    with VLLMRollout(
        str(tmp_path / "m"), tokenizer, max_model_len=128, kv_cache_bytes=256 * 1024**2
    ) as rollout:
        assert rollout.sleep_mode
        _check_engine(rollout, model, other, tokenizer)
        _check_request_scheduler(rollout, tokenizer)


def test_sglang_on_gpu(tmp_path):
    pytest.importorskip("sglang")
    from verity.rollout.sglang_rollout import SGLangRollout

    model, tokenizer = save_char_qwen2(tmp_path / "m", seed=0)
    other, _ = save_char_qwen2(tmp_path / "o", seed=5)
    with SGLangRollout(
        str(tmp_path / "m"), tokenizer, max_model_len=128, dtype="float32", mem_fraction_static=0.2
    ) as rollout:
        _check_engine(rollout, model, other, tokenizer)
        _check_request_scheduler(rollout, tokenizer)
