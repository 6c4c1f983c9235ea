"""Loading HF checkpoints quietly: no per-process progress bars from every worker.

``from_pretrained`` draws a "Loading weights" bar; with N workers (and every role in
them) a run prints N colored bars per role at start. Weights load in well under a
second for the models where the bar would help least, so it is switched off while
verity loads a checkpoint, and restored after.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from verity.data.multimodal import VISION_LANGUAGE_MODEL_TYPES

__all__ = ["load_causal_lm", "quiet_loading"]


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """Within the block, transformers shows no progress bars and only errors."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def load_causal_lm(
    model_path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None
) -> nn.Module:
    """Load an HF causal LM from a local directory (no download).

    ``attn_implementation``: the HF attention kernel (``sdpa``, ``eager``, ...); None: HF's default.
    """
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a directory with an HF checkpoint")
    extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
    auto_class: Any = AutoModelForCausalLM
    if _model_type(path) in VISION_LANGUAGE_MODEL_TYPES:
        # a vision-language model (Qwen2-VL family): same weights layout, loaded with its vision tower
        from transformers import AutoModelForImageTextToText

        auto_class = AutoModelForImageTextToText
    with quiet_loading():
        return auto_class.from_pretrained(str(path), dtype=dtype, local_files_only=True, **extra)


def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None


def use_attention_kernel(model: nn.Module, attn_implementation: str) -> None:
    """Switch an HF model, already built, to the attention kernel ``attn_implementation`` (``eager``, ``sdpa``, ...).

    Uses ``PreTrainedModel.set_attn_implementation``, which checks that the model supports
    the kernel; a module that is not an HF model raises ``TypeError`` naming it.
    """
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise TypeError(
            f"attn_implementation={attn_implementation!r}: {type(model).__name__} is not an HF model "
            "with set_attn_implementation()"
        )
    setter(attn_implementation)
