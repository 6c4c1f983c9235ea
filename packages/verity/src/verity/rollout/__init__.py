"""verity.rollout: generation backends behind one interface.

``HFRollout`` (Hugging Face transformers, runs anywhere) is the default; the
interface is ``RolloutEngine`` (generate, load_weights, sleep, wake). Batch
keys and shapes are listed in ``verity.rollout.base``; the log-prob
convention in ``verity.rollout.sampling``.
"""

from __future__ import annotations

from verity.rollout.base import RolloutEngine
from verity.rollout.hf_rollout import HFRollout
from verity.rollout.prompts import encode_prompts, left_pad, position_ids_from_mask, render_chat
from verity.rollout.sampling import SamplingParams, filter_top_k_top_p, sample_next_token

__all__ = [
    "HFRollout",
    "RolloutEngine",
    "SamplingParams",
    "encode_prompts",
    "filter_top_k_top_p",
    "left_pad",
    "position_ids_from_mask",
    "render_chat",
    "sample_next_token",
]
