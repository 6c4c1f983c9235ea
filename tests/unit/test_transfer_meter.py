"""The driver's transfer meter counts tensor bytes of group-call arguments and answers."""

from __future__ import annotations

import torch
from verity.batch import Batch
from verity.controller.transfer_meter import TransferMeter, payload_bytes


def test_payload_bytes_counts_tensors_in_batches_and_containers() -> None:
    batch = Batch.from_dict(
        {"ids": torch.zeros(4, 8, dtype=torch.int64), "mask": torch.ones(4, 8, dtype=torch.bool)},
        {"text": list("abcd")},
    )
    assert payload_bytes(batch) == 4 * 8 * 8 + 4 * 8 * 1  # strings are not counted
    assert payload_bytes([batch, {"x": torch.zeros(3)}, "ignored", 7]) == 288 + 12
    assert payload_bytes(None) == 0


def test_take_returns_the_totals_and_resets() -> None:
    meter = TransferMeter()
    meter.add(sent=(torch.zeros(10),), received=[torch.zeros(2, dtype=torch.float64)])
    meter.add(sent={"k": torch.zeros(1)})
    assert meter.take() == (44, 16)
    assert meter.take() == (0, 0)
