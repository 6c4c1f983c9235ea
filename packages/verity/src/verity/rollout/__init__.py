"""verity.rollout: generation backends behind one interface.

``HFRollout`` (``hf``: Hugging Face transformers, runs anywhere) is the default; the
interface is ``RolloutEngine`` (generate, set_seed, load_weights, sleep, wake);
``rollout.engine`` names one from the registry in ``verity.rollout.registry``. Batch
keys and shapes are listed in ``verity.rollout.base``; the log-prob
convention in ``verity.rollout.sampling``.
"""

from __future__ import annotations

from verity.rollout.base import RolloutEngine
from verity.rollout.hf_rollout import HFRollout
from verity.rollout.prompts import encode_prompts, left_pad, position_ids_from_mask, render_chat
from verity.rollout.registry import (
    ROLLOUT_ENGINES,
    RolloutBuildContext,
    build_rollout_engine,
    register_rollout_engine,
)
from verity.rollout.sampling import SamplingParams, filter_top_k_top_p, sample_next_token

__all__ = [
    "ROLLOUT_ENGINES",
    "HFRollout",
    "RolloutBuildContext",
    "build_rollout_engine",
    "register_rollout_engine",
    "RolloutEngine",
    "SamplingParams",
    "encode_prompts",
    "filter_top_k_top_p",
    "left_pad",
    "position_ids_from_mask",
    "render_chat",
    "sample_next_token",
]
