"""Per-step metrics computed on the driver from a finished RL batch.

Names follow :mod:`verity.tracking.names`: ``reward/*``, ``acc/*``,
``response_length/*`` (tokens), ``actor/*``, ``timing/*`` (seconds), ``perf/*``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from verity.batch import Batch
from verity.batch.transport import resident_row_tokens
from verity.testing.slow_stage import SLOWED, slow_down


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``values`` where ``mask`` is 1 (0.0 when the mask is empty)."""
    total = mask.sum()
    return float((values * mask).sum() / total) if total > 0 else 0.0


def real_tokens(batch: Batch) -> torch.Tensor:
    """``[B]`` real (attended) tokens of each row, prompt and response, whether or not its rows are resident."""
    if "attention_mask" in batch.tensor_keys():
        return batch["attention_mask"].sum(-1)
    tokens = resident_row_tokens(batch)
    if tokens is None:
        raise KeyError("the batch has no attention_mask and its resident rows do not record their token counts")
    return tokens


def batch_metrics(batch: Batch) -> dict[str, float]:
    """Reward, accuracy, length, entropy and KL statistics of one RL batch.

    Uses ``scores [B]``, ``response_mask [B, R]`` and, when present, ``acc [B]``,
    ``entropy``, ``old_logprobs``, ``ref_logprobs``, ``advantages`` ``[B, R]``.
    """
    mask = batch["response_mask"].float()
    lengths = mask.sum(-1)
    width = mask.shape[1]
    scores = batch["scores"].float()
    out = {
        "reward/mean": float(scores.mean()),
        "reward/std": float(scores.std()) if len(scores) > 1 else 0.0,
        "reward/max": float(scores.max()),
        "reward/min": float(scores.min()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response_length/min": float(lengths.min()),
        "response_length/clip_ratio": float((lengths >= width).float().mean()),
    }
    if "acc" in batch:
        out["acc/mean"] = float(batch["acc"].float().mean())
    if "entropy" in batch:
        out["actor/entropy"] = masked_mean(batch["entropy"], mask)
    if "ref_logprobs" in batch and "old_logprobs" in batch:
        out["actor/kl"] = masked_mean(batch["old_logprobs"] - batch["ref_logprobs"], mask)
    if "advantages" in batch:
        out["critic/advantages_mean"] = masked_mean(batch["advantages"], mask)
    if "group" in batch:
        out["reward/groups_all_equal"] = _fraction_of_constant_groups(batch["group"], scores)
    return out


def _fraction_of_constant_groups(group: torch.Tensor, scores: torch.Tensor) -> float:
    """Fraction of prompt groups whose samples all got the same score (no learning signal)."""
    _, inverse = torch.unique(group, return_inverse=True)
    n = int(inverse.max()) + 1
    hi = torch.full((n,), -torch.inf).scatter_reduce(0, inverse, scores, "amax")
    lo = torch.full((n,), torch.inf).scatter_reduce(0, inverse, scores, "amin")
    return float((hi == lo).float().mean())


class StageTimer:
    """Wall-clock seconds per named stage of one step: ``timing/<stage>_s``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if SLOWED:  # a planted slowdown (tests, the nightly's --plant-slowdown); empty otherwise
                slow_down(name, time.perf_counter() - start)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out = {f"timing/{name}_s": value for name, value in self.seconds.items()}
        out["timing/step_s"] = sum(self.seconds.values())
        return out
