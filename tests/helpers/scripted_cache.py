"""The KV cache that scripted stand-in LMs hand back: which of the original rows are still in the batch."""

from __future__ import annotations

import torch


class ScriptedCache:
    """Follows the decode batch as the rollout shrinks or reorders it (no keys or values are kept)."""

    def __init__(self, prompt_len: int, rows: int) -> None:
        self.prompt_len = prompt_len
        self.rows = torch.arange(rows)  # original row of each decode-batch row

    def get_seq_length(self) -> int:
        return self.prompt_len

    def batch_select_indices(self, keep: torch.Tensor) -> None:
        self.rows = self.rows[keep]

    def reorder_cache(self, index: torch.Tensor) -> None:
        self.rows = self.rows[index]
