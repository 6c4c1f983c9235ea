"""Ulysses pieces that run in one process: packed rows split for SP ranks, the within-row attention, checks.

The exchanges themselves (all-to-all, sequence gather) need several ranks:
``tests/integration/test_ulysses_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_padded_batch, tiny_qwen2
from verity.engines.logprobs import response_logprobs
from verity.engines.packed import pack_rows, unpack_responses
from verity.engines.packed_attention import PACKED_SDPA, packed_sdpa_attention
from verity.engines.ulysses import (
    ULYSSES_ATTENTION,
    SequenceParallelGroup,
    _inner_attention,
    new_sequence_parallel_group,
    split_sequence,
)
from verity.engines.ulysses_engine import check_heads, sequence_parallel_packed, sequence_parallel_scoring
from verity.engines.ulysses_scoring import sp_response_logprobs, split_for_sp

CPU = torch.device("cpu")


def small_batch() -> dict[str, torch.Tensor]:
    """Two rows: prompt [5, 6] + response [7, 8, 9]; prompt [3] + response [4] (P=2, R=3)."""
    return {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9], [0, 3, 4, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 4], [0, 0, 1, 1, 1]]),
        "responses": torch.tensor([[7, 8, 9], [4, 0, 0]]),
    }


@pytest.mark.parametrize("size", [1, 2, 4])
def test_split_for_sp_pads_the_packed_rows_to_a_multiple_and_keeps_rank_chunks(size):
    packed = pack_rows(small_batch())
    total = 7 + (-7) % size
    chunks = [split_for_sp(packed, rank, size) for rank in range(size)]
    ids = torch.cat([c.input_ids for c in chunks], dim=1)
    positions = torch.cat([c.position_ids for c in chunks], dim=1)
    labels = torch.cat([c.labels for c in chunks], dim=1)
    assert ids.shape == (1, total) and all(c.input_ids.shape == (1, total // size) for c in chunks)
    assert ids[0, :7].tolist() == [5, 6, 7, 8, 9, 3, 4]
    assert positions[0, :7].tolist() == [0, 1, 2, 3, 4, 0, 1]
    # the next token within the row; 0 at each row's last token (the packed layout's labels)
    assert labels[0, :7].tolist() == [6, 7, 8, 9, 0, 4, 0]
    bounds = [0, 5, 7] + ([total] if total > 7 else [])
    assert chunks[0].cu_seqlens.tolist() == bounds and chunks[0].cu_seqlens.dtype == torch.int32
    assert chunks[0].pad == total - 7 and chunks[0].max_seqlen == 5


def test_unpack_of_a_gathered_padded_sequence_reads_response_tokens_and_zeroes_padding():
    packed = pack_rows(small_batch())
    per_token = torch.arange(8.0) + 1  # T = 7 padded to 8 for 2 SP ranks
    assert unpack_responses(per_token, packed, 3).tolist() == [[2.0, 3.0, 4.0], [6.0, 0.0, 0.0]]


def test_split_sequence_gives_contiguous_chunks_and_refuses_a_remainder():
    x = torch.arange(8)[None]
    assert [split_sequence(x, r, 4)[0].tolist() for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="divide by the 3 SP ranks"):
        split_sequence(x, 0, 3)


def test_the_inner_attention_is_the_packed_layouts_kernel():
    assert _inner_attention(None) is packed_sdpa_attention
    assert _inner_attention(PACKED_SDPA) is packed_sdpa_attention


def test_one_rank_ulysses_path_equals_the_padded_logprobs_and_gradient():
    batch = make_padded_batch()
    padded = tiny_qwen2()
    want, want_entropy = response_logprobs(padded, batch)
    (want * batch["advantages"]).sum().backward()
    packed = tiny_qwen2()
    packed.set_attn_implementation(ULYSSES_ATTENTION)
    got, entropy = sp_response_logprobs(packed, batch, sp=SequenceParallelGroup(1, 0, 0, 1))
    (got * batch["advantages"]).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(padded.named_parameters(), packed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_heads_and_kv_heads_must_divide_by_the_sp_size():
    check_heads(4, 2, 2)
    with pytest.raises(
        ValueError, match="must divide the model's 4 attention heads and its 2 key/value heads"
    ):
        check_heads(4, 2, 4)
    with pytest.raises(ValueError, match="14 attention heads"):
        check_heads(14, 2, 4)


def test_sp_groups_need_a_process_group_that_the_size_divides():
    assert new_sequence_parallel_group(1) == SequenceParallelGroup(1, 0, 0, 1, None, None)
    with pytest.raises(ValueError, match="must divide the 1 ranks"):
        new_sequence_parallel_group(2)
    with pytest.raises(ValueError, match="int >= 1"):
        new_sequence_parallel_group(0)
    # a tiny model whose 4 heads and 2 kv heads do not split 4 ways is refused before any group forms
    with pytest.raises(ValueError, match="key/value heads"):
        sequence_parallel_scoring(tiny_qwen2(), 4, True, CPU)


def test_sp_implies_the_packed_layout_and_refuses_packed_false():
    model = tiny_qwen2()
    assert sequence_parallel_packed(None, 2, model) is True
    assert sequence_parallel_packed(False, 1, model) is False
    with pytest.raises(ValueError, match="splits the packed layout, so packed=false cannot be kept"):
        sequence_parallel_packed(False, 2, model)
