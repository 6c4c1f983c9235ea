"""The weight stream handed to a vLLM engine in worker processes (no vLLM needed)."""

from __future__ import annotations

import torch
from safetensors.torch import load
from verity.rollout.vllm_weights import EMBED_NAME, LM_HEAD_NAME, to_safetensors_bytes, with_tied_lm_head


def test_tied_embedding_blob_holds_the_embedding_twice():
    # regression: safetensors refused the blob ("Some tensors share memory") for tied embeddings
    embed = torch.arange(12.0).view(4, 3)
    norm = torch.ones(3)
    stream = with_tied_lm_head([(EMBED_NAME, embed), ("model.norm.weight", norm)], tied=True)
    blob, count = to_safetensors_bytes(stream)
    tensors = load(blob)
    assert count == 3
    assert sorted(tensors) == sorted([EMBED_NAME, LM_HEAD_NAME, "model.norm.weight"])
    assert torch.equal(tensors[EMBED_NAME], embed) and torch.equal(tensors[LM_HEAD_NAME], embed)
    assert embed.data_ptr() != tensors[LM_HEAD_NAME].data_ptr()


def test_views_of_one_storage_are_saved_apart():
    weight = torch.arange(8.0).view(2, 4)
    blob, _ = to_safetensors_bytes([("a", weight[0]), ("b", weight[1]), ("c", weight.t())])
    tensors = load(blob)
    assert torch.equal(tensors["a"], weight[0]) and torch.equal(tensors["b"], weight[1])
    assert torch.equal(tensors["c"], weight.t())
