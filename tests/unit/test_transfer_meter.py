"""The driver's transfer meter counts the bytes of group-call arguments and answers."""

from __future__ import annotations

import pickle

import torch
from verity.batch import Batch
from verity.batch.transport import TransferMeter, payload_bytes


def test_payload_bytes_counts_tensors_in_batches_and_containers() -> None:
    batch = Batch.from_dict(
        {"ids": torch.zeros(4, 8, dtype=torch.int64), "mask": torch.ones(4, 8, dtype=torch.bool)}
    )
    assert payload_bytes(batch) == 4 * 8 * 8 + 4 * 8 * 1
    assert payload_bytes([batch, {"x": torch.zeros(3)}, "ignored", 7]) == 288 + 12
    assert payload_bytes(None) == 0


def test_per_row_python_values_count_at_their_pickled_size() -> None:
    texts = ["a long ground truth " * 4, "b", "c", "d"]
    batch = Batch.from_dict({"ids": torch.zeros(4, 8, dtype=torch.int8)}, {"text": texts})
    assert payload_bytes(batch) == 32 + len(pickle.dumps(texts, protocol=pickle.HIGHEST_PROTOCOL))
    assert payload_bytes(batch) > 32 + len(texts[0])
    # per-row tensors (images) count at their nbytes, not their pickled framing
    images = Batch.from_dict({"ids": torch.zeros(2, 1)}, {"pixels": [torch.zeros(5, 6), torch.zeros(2, 6)]})
    assert payload_bytes(images) == 8 + (30 + 12) * 4 + len(pickle.dumps([None, None], protocol=5))


def test_take_returns_the_totals_and_resets() -> None:
    meter = TransferMeter()
    meter.add(sent=(torch.zeros(10),), received=[torch.zeros(2, dtype=torch.float64)])
    meter.add(sent={"k": torch.zeros(1)})
    assert meter.take() == (44, 16)
    assert meter.take() == (0, 0)
