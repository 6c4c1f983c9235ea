"""Reward-model role: a Qwen2 sequence classifier scores conversations, independent of padding."""

from __future__ import annotations

import pytest
import torch
from verity.batch import Batch
from verity.workers.reward_model import (
    RewardModelWorker,
    load_reward_model,
    mix_scores,
    render_conversations,
)
from verity_toyworld.char_tokenizer import CharTokenizer
from verity_toyworld.tiny_model import build_tiny_qwen2_for


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("rm")
    tokenizer = CharTokenizer()
    build_tiny_qwen2_for(
        tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, intermediate=64
    ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_scores_equal_unpadded_forward(checkpoint):
    worker = RewardModelWorker(checkpoint, micro_batch_size=4)
    report = worker.init_model()
    assert report.rank == 0 and report.n_params > 0
    prompts = [[{"role": "user", "content": "2+3="}], [{"role": "user", "content": "10+20="}]]
    responses = ["5", "a much longer answer: 30"]
    batch = Batch.from_dict(None, {"raw_prompt": prompts, "response_text": responses})
    out = worker.compute_rm_score(batch)
    assert out["rm_scores"].shape == (2,) and out["rm_scores"].dtype == torch.float32
    texts = render_conversations(prompts, responses, worker.tokenizer)
    assert texts[0] == "<bos>2+3=5"  # the char tokenizer's template: contents after <bos>
    # reference: each conversation alone (no padding) through the same HF classifier
    # (a causal-LM checkpoint gets a randomly initialised head, so reuse the worker's model)
    model = worker.model
    for i, text in enumerate(texts):
        ids = worker.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0]
        assert out["rm_scores"][i].item() == pytest.approx(expected.item(), abs=1e-5)


def test_left_truncation_keeps_the_response_end(checkpoint):
    worker = RewardModelWorker(checkpoint, max_length=6)
    worker.init_model()
    batch = Batch.from_dict(
        None, {"raw_prompt": [[{"role": "user", "content": "xxxxxxxxxx"}]], "response_text": ["ab"]}
    )
    short = worker.compute_rm_score(batch)["rm_scores"]
    assert torch.isfinite(short).all()


def test_inputs_are_checked(checkpoint):
    worker = RewardModelWorker(checkpoint)
    with pytest.raises(RuntimeError, match="init_model"):
        worker.compute_rm_score(Batch.from_dict(None, {"response_text": ["a"]}))
    worker.init_model()
    with pytest.raises(ValueError, match="raw_prompt"):
        worker.compute_rm_score(Batch.from_dict(None, {"response_text": ["a"]}))
    with pytest.raises(FileNotFoundError):
        load_reward_model(checkpoint + "/missing")


def test_mix_scores():
    rule, rm = torch.tensor([1.0, 0.0]), torch.tensor([0.5, -2.0])
    assert mix_scores(rule, rm, 0.5).tolist() == [1.25, -1.0]
    assert mix_scores(rule, rm, 0.0).tolist() == [1.0, 0.0]
    with pytest.raises(ValueError):
        mix_scores(rule, rm[:1])
